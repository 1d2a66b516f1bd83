"""Pytest fixtures for the fake vendor servers (registered in tests/conftest.py)."""
