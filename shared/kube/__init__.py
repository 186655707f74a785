"""Kubernetes client helpers shared by the services."""
