"""Completions, embeddings and token counts through routes: the same plan, retries, fallbacks, breakers and hedging
as chat (routing.execute), with the upstream call built per candidate.

A completions route may mix backends: an OpenAI-compatible candidate gets the native
`/v1/completions` call, any other gets the prompt as a one-message chat; the API renders whichever
answered. An embeddings candidate that cannot embed (an Anthropic model), or a counting one that cannot count (an
OpenAI model), is skipped.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest
from gateway.pipeline import Call
from gateway.providers import openai as openai_provider
from gateway.providers.base import UpstreamRequest
from gateway.router_basic import Target
from gateway.runtime import Gateway
from gateway.types import ChatRequest, CompletionRequest, EmbeddingRequest, Message
from routing.execute import Operation
from routing.plan import Plan, features, prompt_request


def completion_as_chat(request: CompletionRequest) -> ChatRequest:
    """A completions request as a one-message chat, for backends without a completions endpoint."""
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise InvalidRequest("this model takes a single text prompt", param="prompt")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("this model takes a text prompt, not token ids", param="prompt")
    return ChatRequest(
        model=request.model,
        messages=[Message(role="user", content=prompt)],
        stream=request.stream,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=request.stop,
        seed=request.seed,
        n=request.n,
        user=request.user,
    )


def completion_op(body: CompletionRequest) -> Operation:
    stream = bool(body.stream)

    def check(target: Target) -> None:
        if not target.provider.native_completions:
            completion_as_chat(body)  # raises the 400 when the prompt is token ids

    def prepare(target: Target) -> tuple[UpstreamRequest, Any]:
        model = target.upstream_model
        if target.provider.native_completions:
            upstream = openai_provider.completions_request(target.backend, body, model)
            reader = (
                openai_provider.CompletionStream(model) if stream else openai_provider.completions_response
            )
            return upstream, reader
        chat = completion_as_chat(body)
        upstream = target.provider.chat_request(target.backend, chat, model)
        return upstream, target.provider.chat_stream(chat, model) if stream else target.provider.chat_response

    return Operation(stream, prepare, check)


def embeddings_op(body: EmbeddingRequest) -> Operation:
    def check(target: Target) -> None:
        provider = target.provider
        if provider.embeddings_request is None or provider.embeddings_response is None:
            raise InvalidRequest(
                f"The model `{target.model.name}` does not support embeddings ({provider.name} backend).",
                param="model",
            )

    def prepare(target: Target) -> tuple[UpstreamRequest, Any]:
        provider = target.provider
        assert provider.embeddings_request is not None  # check() ran first
        upstream = provider.embeddings_request(target.backend, body, target.upstream_model)
        return upstream, provider.embeddings_response

    return Operation(False, prepare, check)


class NoTokenCounter(InvalidRequest):
    """No candidate of the route can count tokens: the API estimates instead."""


def count_tokens_op(request: ChatRequest) -> Operation:
    def check(target: Target) -> None:
        if target.provider.count_tokens_request is None:
            raise NoTokenCounter(f"The model `{target.model.name}` cannot count tokens.", param="model")

    def prepare(target: Target) -> tuple[UpstreamRequest, Any]:
        provider = target.provider
        assert provider.count_tokens_request is not None  # check() ran first
        upstream = provider.count_tokens_request(target.backend, request, target.upstream_model)
        return upstream, provider.count_tokens_response

    return Operation(False, prepare, check)


async def run_routed(
    gateway: Gateway, call: Call, model: str, prompt: str | list[Any], op: Operation
) -> tuple[Any, Plan]:
    """Plan the route for `model` (a plain model: one candidate, one attempt) and run `op` through
    the executor; the result and the plan (whose `chosen` candidate says how to render it)."""
    call.info.model = model
    call.info.stream = op.stream
    feats = features(prompt_request(model, prompt), call.principal.tenant_name, call.principal.key_id)
    plan = await gateway.router.plan(model, call.principal, feats)
    try:
        return await gateway.executor.run(call, plan, op, feats), plan
    finally:
        call.info.route = plan.header()
