"""Provider adapters, one per vendor wire format. The bundled engine speaks the OpenAI API."""

from __future__ import annotations

from gateway.config import Backend, Model
from gateway.providers import anthropic, gemini, openai, openai_responses
from gateway.providers.base import Provider, StreamDecoder, UpstreamRequest

PROVIDERS: dict[str, Provider] = {
    "openai": openai.PROVIDER,
    "engine": openai.ENGINE_PROVIDER,
    "anthropic": anthropic.PROVIDER,
    "gemini": gemini.PROVIDER,
}


def provider_for(backend: Backend, model: Model) -> Provider:
    """The adapter `model` is asked through: its backend type's, or (`api: responses`, on the model
    or its backend) the Responses API's."""
    if (model.api or backend.api) == "responses":
        return openai_responses.PROVIDER
    return PROVIDERS[backend.type]


__all__ = ["PROVIDERS", "Provider", "StreamDecoder", "UpstreamRequest", "provider_for"]
