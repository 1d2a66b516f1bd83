"""The chat pipeline shared by both inbound APIs: resolve the model, translate, run one attempt."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.pipeline import Call
from gateway.router_basic import Target
from gateway.runtime import Gateway
from gateway.types import ChatChunk, ChatRequest, ChatResponse


def target_for(gateway: Gateway, call: Call, model: str, stream: bool | None) -> Target:
    """The first candidate for the public model name (404 model_not_found when there is none)."""
    call.info.model = model
    call.info.stream = bool(stream)
    return gateway.models.resolve(model, call.principal)[0]


async def run_chat(
    gateway: Gateway, call: Call, request: ChatRequest
) -> ChatResponse | AsyncIterator[list[ChatChunk]]:
    """The chat pipeline for any inbound API: a canonical response, or a stream of batches of
    canonical chunks (see Pipeline.stream). `target_for` is where the routing engine will plug in."""
    target = target_for(gateway, call, request.model, request.stream)
    upstream = target.provider.chat_request(target.backend, request, target.upstream_model)
    if request.stream:
        decoder = target.provider.chat_stream(request, target.upstream_model)
        return await gateway.pipeline.stream(call, target, upstream, decoder)
    return await gateway.pipeline.exchange(call, target, upstream, target.provider.chat_response)
