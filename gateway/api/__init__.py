"""Route handlers: the OpenAI (chat and Responses) and Anthropic shapes in, health and metrics beside them."""

from __future__ import annotations

from gateway.api import anthropic, feedback, health, openai, responses

ROUTES = [*openai.ROUTES, *responses.ROUTES, *anthropic.ROUTES, *health.ROUTES, *feedback.ROUTES]
