"""Weir: an LLM gateway and control plane with a bundled self-hosted inference engine."""

__version__ = "0.1.0"
