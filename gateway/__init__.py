"""Weir gateway: HTTP API, provider adapters, auth, accounting, admin API."""
