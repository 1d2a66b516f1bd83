"""The chat pipeline shared by both inbound APIs: plan the route, translate, run the attempts."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.pipeline import Call
from gateway.router_basic import Target
from gateway.runtime import Gateway
from gateway.types import ChatChunk, ChatRequest, ChatResponse
from routing.plan import features


def target_for(gateway: Gateway, call: Call, model: str, stream: bool | None) -> Target:
    """The first candidate for the public model name (404 model_not_found when there is none); for
    the endpoints routing policies do not apply to (completions, embeddings, model lookups)."""
    call.info.model = model
    call.info.stream = bool(stream)
    routes = gateway.router.routes.get(model)
    if routes and call.principal.may_use(model):
        target = gateway.models.targets[routes[0].candidates[0].model]
        policy, reason = routes[0].policy, "first_candidate"
    else:
        target = gateway.models.resolve(model, call.principal)[0]
        policy, reason = "fixed", "model"
    call.info.route = (
        f"route={model}; policy={policy}; candidate={target.model.name}; reason={reason}; attempts=1"
    )
    return target


async def run_chat(
    gateway: Gateway, call: Call, request: ChatRequest
) -> ChatResponse | AsyncIterator[list[ChatChunk]]:
    """The chat pipeline for any inbound API: a canonical response, or a stream of batches of
    canonical chunks (see Pipeline.stream), after routing and failover (routing.execute)."""
    call.info.model = request.model
    call.info.stream = bool(request.stream)
    gateway.limits.check_messages(call.principal, len(request.messages))
    feats = features(request, call.principal.tenant_name, call.principal.key_id)
    plan = await gateway.router.plan(request.model, call.principal, feats)
    try:
        return await gateway.executor.chat(call, plan, request, feats)
    finally:
        call.info.route = plan.header()
