"""The Anthropic Messages API inbound (/v1/messages and /v1/messages/count_tokens), routed to any
backend through the canonical shape."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.response import Stream

from gateway.anthropic_inbound import (
    CountTokensRequest,
    MessagesRequest,
    beta_flags,
    from_canonical,
    stream_events,
    to_canonical,
)
from gateway.api.chat import run_chat
from gateway.api.common import SSE_HEADERS, begin, json_response, parse_body
from gateway.api.routed import NoTokenCounter, count_tokens_op
from gateway.drain import answered_by_deadline
from gateway.errors import ANTHROPIC_PATH, GatewayError, InvalidRequest
from gateway.estimate import input_tokens
from gateway.media_urls import check_media_urls
from gateway.types import ChatRequest, ChatResponse
from routing.execute import refuses_parameter
from routing.plan import features

PATH = ANTHROPIC_PATH
COUNT_PATH = PATH + "/count_tokens"
PATHS = (PATH, COUNT_PATH)  # the paths served


BETA_HEADER = "anthropic-beta"  # the client's beta features, passed on to Anthropic backends


@post(PATH, status_code=200)
async def messages(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway, call = await begin(request, "messages")
    body = await parse_body(request, MessagesRequest)
    if not body.messages:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    if body.max_tokens < 1:
        raise InvalidRequest("max_tokens: must be at least 1", param="max_tokens")
    beta = beta_flags(request.headers.getall(BETA_HEADER, []))
    metadata = body.metadata.entries() if body.metadata else None
    result = await run_chat(gateway, call, to_canonical(body, beta), metadata=metadata)
    thinking = body.shows_thinking
    if isinstance(result, ChatResponse):
        return json_response(from_canonical(result, body.model, thinking))
    events = stream_events(result, body.model, thinking, call.info.request_id)
    return Stream(events, media_type="text/event-stream", headers=SSE_HEADERS)


@post(COUNT_PATH, status_code=200)
async def count_tokens(request: Request[Any, Any, Any]) -> Response[Any]:
    """The input tokens a Messages request would cost, counted by the route's first candidate that can
    count (an Anthropic or Gemini model, Weir's engine) with the same retries and fallbacks as a chat;
    estimated from the request's size when none can (OpenAI has no counting endpoint; the engine
    cannot count what its model does not take, an image, which a chat would send to the route's
    vendor: its `unsupported_*` 400 is no reason to refuse the count)."""
    gateway, call = await begin(request, "count_tokens")
    body = await parse_body(request, CountTokensRequest)
    if not body.messages:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    chat = body.to_canonical(beta_flags(request.headers.getall(BETA_HEADER, [])))
    call.info.model = chat.model
    check_media_urls(chat)  # as its chat would be: a counting backend may fetch them too
    feats = features(chat, call.principal.tenant_name, call.principal.key_id)
    # Counting generates nothing: no traffic for the policy to learn from (a strong-share window).
    plan = await gateway.router.plan(chat.model, call.principal, feats, record=False)
    try:
        count = await answered_by_deadline(
            call, gateway.executor.run(call, plan, count_tokens_op(chat), feats)
        )
    except NoTokenCounter:
        return _estimated(chat)
    except GatewayError as exc:
        if not refuses_parameter(exc):
            raise
        return _estimated(chat)
    finally:
        call.info.route = plan.header()
    return json_response({"input_tokens": count.input_tokens}, headers={"x-weir-token-count": "backend"})


def _estimated(chat: ChatRequest) -> Response[Any]:
    return json_response({"input_tokens": input_tokens(chat)}, headers={"x-weir-token-count": "estimate"})


ROUTES = [messages, count_tokens]
