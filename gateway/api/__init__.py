"""Route handlers: the OpenAI and Anthropic shapes in, health and metrics beside them."""

from __future__ import annotations

from gateway.api import anthropic, feedback, health, openai

ROUTES = [*openai.ROUTES, *anthropic.ROUTES, *health.ROUTES, *feedback.ROUTES]
