"""OpenAI's Responses API inbound (POST /v1/responses), stateless, routed to any backend through the
canonical chat shape (gateway/responses_inbound.py)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.response import Stream

from gateway.api.chat import run_chat
from gateway.api.common import SSE_HEADERS, begin, json_response, parse_body
from gateway.responses_inbound import ResponsesRequest, from_canonical, stream_events, to_canonical
from gateway.types import ChatResponse

PATH = "/v1/responses"


@post(PATH, status_code=200)
async def responses(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway, call = await begin(request, "responses")
    body = await parse_body(request, ResponsesRequest)
    # `metadata` tags a stored response: Weir stores none, so it only reaches route conditions (and the
    # echo); upstream, OpenAI's chat API refuses it without `store` and Mistral refuses it outright.
    canonical, metadata = to_canonical(body), body.metadata or {}
    result = await run_chat(gateway, call, canonical, output_param="max_output_tokens", metadata=metadata)
    if isinstance(result, ChatResponse):
        return json_response(from_canonical(result, body))
    return Stream(stream_events(result, body), media_type="text/event-stream", headers=SSE_HEADERS)


ROUTES = [responses]
