"""Weir engine: a paged, continuously batched, prefix-caching inference engine."""
