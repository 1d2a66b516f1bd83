"""Completions, embeddings and token counts through routes: the same plan, retries, fallbacks, breakers and hedging
as chat (routing.execute), with the upstream call built per candidate.

A completions route may mix backends: an OpenAI-compatible candidate gets the native
`/v1/completions` call, any other gets the prompt as a one-message chat (unless the request asks for
what a chat cannot give: `echo`, `logprobs`...); the API renders whichever answered. An embeddings
candidate that cannot embed (an Anthropic model), or one of another embedding model than the route's
first (its vectors would have another size and space), or a counting one that cannot count (an OpenAI
model), is skipped.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import msgspec

from gateway.drain import answered_by_deadline, ending_at_deadline
from gateway.errors import InvalidRequest
from gateway.estimate import BYTES_PER_TOKEN
from gateway.pipeline import Call
from gateway.providers import openai as openai_provider
from gateway.providers.base import UpstreamRequest, chat_response_reader
from gateway.router_basic import Target
from gateway.runtime import Gateway
from gateway.types import ChatRequest, CompletionRequest, EmbeddingRequest, EmbeddingResponse, Message
from gateway.usage import Usage
from routing.execute import Operation, within_output_limit
from routing.plan import Choice, Plan, prompt_features


def _chat_cannot(request: CompletionRequest) -> str | None:
    """The first completions parameter a chat cannot honour: the prompt echoed back, token logprobs,
    an insertion suffix, server-side best-of, or biases on token ids of the completions model's
    tokenizer. Dropped, the client got an answer of another shape than it asked for, from whichever
    candidate a failover reached, without a word."""
    for name, asked in (
        ("echo", bool(request.echo)),
        ("logprobs", request.logprobs is not None),
        ("suffix", bool(request.suffix)),
        ("best_of", (request.best_of or 1) > 1),
        ("logit_bias", bool(request.logit_bias)),
    ):
        if asked:
            return name
    return None


def completion_as_chat(request: CompletionRequest) -> ChatRequest:
    """A completions request as a one-message chat, for backends without a completions endpoint."""
    if (name := _chat_cannot(request)) is not None:
        raise InvalidRequest(f"'{name}' needs a model with a native completions endpoint", param=name)
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
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
    )


def completion_op(body: CompletionRequest) -> Operation:
    stream = bool(body.stream)

    def check(target: Target) -> None:
        if not target.provider.native_completions:
            completion_as_chat(body)  # raises the 400 when the prompt is token ids

    def prepare(choice: Choice) -> tuple[UpstreamRequest, Any]:
        target = choice.target
        model = target.upstream_model
        if target.provider.native_completions:
            # As a chat's (`routing.execute.within_output_limit`): at most what the model writes.
            limit = body.max_tokens
            sent = (
                body
                if limit is None
                else msgspec.structs.replace(body, max_tokens=choice.output_within(limit))
            )
            upstream = openai_provider.completions_request(target.backend, sent, model)
            reader = (
                openai_provider.CompletionStream(model) if stream else openai_provider.completions_response
            )
            return upstream, reader
        chat = within_output_limit(completion_as_chat(body), choice)
        upstream = target.provider.chat_request(target.backend, chat, model)
        if stream:
            return upstream, target.provider.chat_stream(chat, model)
        return upstream, chat_response_reader(target.provider, chat)

    return Operation(stream, prepare, check)


def _as_base64(vector: list[float] | str) -> str:
    """A vector as OpenAI sends it for `encoding_format: base64`: little-endian float32, base64."""
    if isinstance(vector, str):
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _input_tokens(body: EmbeddingRequest) -> int:
    """The input tokens of an embeddings request, estimated (4 bytes of text a token, at least one an
    input; a token-id input counts its ids)."""
    inputs = [body.input] if isinstance(body.input, str) or isinstance(body.input[0], int) else body.input
    return sum(
        max(1, -(-len(x.encode()) // BYTES_PER_TOKEN)) if isinstance(x, str) else len(x) for x in inputs
    )


def embeddings_op(body: EmbeddingRequest) -> Operation:
    # The embedding model of the route's first candidate that can embed: the space (and size) of the
    # vectors this request may get. Vectors of another model are useless beside them in the client's
    # index, and a failover to one was silent (only the response's `model` told), so candidates of
    # another model are skipped. The executor checks the candidates in plan order (`Executor._able`).
    space: list[str] = []

    def check(target: Target) -> None:
        provider = target.provider
        if provider.embeddings_request is None or provider.embeddings_response is None:
            raise InvalidRequest(
                f"The model `{target.model.name}` does not support embeddings ({provider.name} backend).",
                param="model",
            )
        if not space:
            space.append(target.upstream_model)
        elif target.upstream_model != space[0]:
            raise InvalidRequest(
                f"The model `{target.model.name}` embeds with `{target.upstream_model}`, not with the "
                f"route's `{space[0]}`: its vectors would have another size and space.",
                param="model",
            )
        provider.embeddings_request(target.backend, body, target.upstream_model)  # its 400 (token ids)

    def prepare(choice: Choice) -> tuple[UpstreamRequest, Any]:
        target = choice.target
        provider = target.provider
        assert provider.embeddings_request is not None  # check() ran first
        assert provider.embeddings_response is not None
        parse = provider.embeddings_response
        upstream = provider.embeddings_request(target.backend, body, target.upstream_model)

        def reader(raw: bytes, model: str) -> EmbeddingResponse:
            response = parse(raw, model)
            if body.encoding_format == "base64":
                # Gemini (and some compatible servers) answer floats only; the client decodes base64.
                data = [msgspec.structs.replace(d, embedding=_as_base64(d.embedding)) for d in response.data]
                response = msgspec.structs.replace(response, data=data)
            if response.usage.prompt_tokens == 0:
                # Gemini's batchEmbedContents reports no usage, but bills the input: estimated, not free.
                response = msgspec.structs.replace(response, usage=Usage(input_tokens=_input_tokens(body)))
            return response

        return upstream, reader

    return Operation(False, prepare, check)


class NoTokenCounter(InvalidRequest):
    """No candidate of the route can count tokens: the API estimates instead."""


def count_tokens_op(request: ChatRequest) -> Operation:
    def check(target: Target) -> None:
        if target.provider.count_tokens_request is None:
            raise NoTokenCounter(f"The model `{target.model.name}` cannot count tokens.", param="model")

    def prepare(choice: Choice) -> tuple[UpstreamRequest, Any]:
        target = choice.target
        provider = target.provider
        assert provider.count_tokens_request is not None  # check() ran first
        upstream = provider.count_tokens_request(target.backend, request, target.upstream_model)
        return upstream, provider.count_tokens_response

    return Operation(False, prepare, check)


async def run_routed(
    gateway: Gateway,
    call: Call,
    model: str,
    prompt: str | list[Any],
    op: Operation,
    max_tokens: int | None = None,
    n: int | None = None,
    best_of: int | None = None,
) -> tuple[Any, Plan]:
    """Plan the route for `model` (a plain model: one candidate, one attempt) and run `op` through
    the executor; the result and the plan (whose `chosen` candidate says how to render it).
    `max_tokens`, `n` and `best_of`: a completions request's output limit and choices."""
    call.info.model = model
    call.info.stream = op.stream
    principal = call.principal
    feats = prompt_features(model, prompt, principal.tenant_name, principal.key_id, max_tokens, n, best_of)
    plan = await gateway.router.plan(model, call.principal, feats)
    try:
        result = await answered_by_deadline(call, gateway.executor.run(call, plan, op, feats))
        return (ending_at_deadline(call, result) if op.stream else result), plan
    finally:
        call.info.route = plan.header()
