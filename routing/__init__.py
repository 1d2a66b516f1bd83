"""Weir routing: policies, difficulty classifier, fallback and health."""
