"""The binder service."""
