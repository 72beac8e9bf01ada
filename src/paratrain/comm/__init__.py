"""Collectives watched with timeouts, and what we do to torch's process groups and Work handles."""
