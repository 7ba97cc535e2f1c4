"""Reproducers: each shows one hazard in seconds, and shows it gone with capsafe in place."""
