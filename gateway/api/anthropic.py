"""The Anthropic Messages API inbound (/v1/messages), routed to any backend through the canonical shape."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.response import Stream

from gateway.anthropic_inbound import MessagesRequest, from_canonical, stream_events, to_canonical
from gateway.api.chat import run_chat
from gateway.api.common import SSE_HEADERS, begin, json_response, parse_body
from gateway.errors import InvalidRequest
from gateway.types import ChatResponse

PATH = "/v1/messages"


@post(PATH, status_code=200)
async def messages(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway, call = await begin(request, "messages")
    body = await parse_body(request, MessagesRequest)
    if not body.messages:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    if body.max_tokens < 1:
        raise InvalidRequest("max_tokens: must be at least 1", param="max_tokens")
    result = await run_chat(gateway, call, to_canonical(body))
    if isinstance(result, ChatResponse):
        return json_response(from_canonical(result, body.model))
    return Stream(stream_events(result, body.model), media_type="text/event-stream", headers=SSE_HEADERS)


ROUTES = [messages]
