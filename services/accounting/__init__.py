"""The accounting service."""
