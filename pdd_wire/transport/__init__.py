"""Transports: how frames move between agents (TCP/TLS today; UCX joins for same-site peers)."""
