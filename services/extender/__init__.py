"""The extender service."""
