"""Provider adapters, one per vendor wire format. The bundled engine speaks the OpenAI API."""

from __future__ import annotations

from gateway.providers import anthropic, gemini, openai
from gateway.providers.base import Provider, StreamDecoder, UpstreamRequest

PROVIDERS: dict[str, Provider] = {
    "openai": openai.PROVIDER,
    "engine": openai.ENGINE_PROVIDER,
    "anthropic": anthropic.PROVIDER,
    "gemini": gemini.PROVIDER,
}

__all__ = ["PROVIDERS", "Provider", "StreamDecoder", "UpstreamRequest"]
