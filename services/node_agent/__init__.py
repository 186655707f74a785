"""The node_agent service."""
