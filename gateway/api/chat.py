"""The chat pipeline shared by both inbound APIs: plan the route, translate, run the attempts."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from gateway.drain import answered_by_deadline, ending_at_deadline
from gateway.media_urls import check_media_urls
from gateway.pipeline import Call
from gateway.runtime import Gateway
from gateway.types import ChatChunk, ChatRequest, ChatResponse
from routing.plan import features


async def run_chat(
    gateway: Gateway,
    call: Call,
    request: ChatRequest,
    output_param: str | None = None,
    metadata: dict[str, str] | None = None,
) -> ChatResponse | AsyncIterator[list[ChatChunk]]:
    """The chat pipeline for any inbound API: a canonical response, or a stream of batches of
    canonical chunks (see Pipeline.stream), after routing and failover (routing.execute).
    `output_param`: what the client's API calls the output limit, for the 400 when it is too large.
    `metadata`: what route conditions see of the client's metadata where the canonical request does
    not carry it (`routing.plan.features`)."""
    call.info.model = request.model
    call.info.stream = bool(request.stream)
    gateway.limits.check_messages(call.principal, len(request.messages))
    check_media_urls(request)
    param = output_param or (
        "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    )
    if (cap := gateway.limits.output_cap(call.principal, request.output_limit, param)) is not None:
        request = msgspec.structs.replace(request, max_completion_tokens=cap)
    feats = features(request, call.principal.tenant_name, call.principal.key_id, metadata)
    plan = await gateway.router.plan(request.model, call.principal, feats)
    compared = gateway.comparer.wants(plan, request, feats, call.principal)
    try:
        result = await answered_by_deadline(call, gateway.executor.chat(call, plan, request, feats))
    finally:
        call.info.route = plan.header()
    if compared:
        result = gateway.comparer.follow(call, plan, request, feats, result)
    return result if isinstance(result, ChatResponse) else ending_at_deadline(call, result)
