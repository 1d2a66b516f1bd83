"""OpenAI's Responses API inbound (POST /v1/responses), stateless, routed to any backend through the
canonical chat shape (gateway/responses_inbound.py)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post, route
from litestar.response import Stream

from gateway.api.chat import run_chat
from gateway.api.common import SSE_HEADERS, begin, json_response, parse_body
from gateway.errors import GatewayError, NotFound
from gateway.responses_inbound import (
    ResponsesRequest,
    from_canonical,
    responses_param,
    stream_events,
    to_canonical,
)
from gateway.types import ChatResponse

PATH = "/v1/responses"


@post(PATH, status_code=200)
async def responses(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway, call = await begin(request, "responses")
    body = await parse_body(request, ResponsesRequest)
    # `metadata` tags a stored response: Weir stores none, so it only reaches route conditions (and the
    # echo); upstream, OpenAI's chat API refuses it without `store` and Mistral refuses it outright.
    canonical, metadata = to_canonical(body), body.metadata or {}
    try:
        result = await run_chat(gateway, call, canonical, output_param="max_output_tokens", metadata=metadata)
    except GatewayError as error:
        error.param = responses_param(error.param)  # a backend's 400 names the chat request's
        raise
    if isinstance(result, ChatResponse):
        return json_response(from_canonical(result, body))
    return Stream(stream_events(result, body, canonical), media_type="text/event-stream", headers=SSE_HEADERS)


def _not_stored(response_id: str) -> NotFound:
    return NotFound(
        f"No response found with id '{response_id}': Weir does not store responses (each says "
        '"store": false), so none can be retrieved, deleted, cancelled or listed. Keep the output '
        "you received and send the whole conversation in `input`.",
        param="response_id",
    )


# What the SDK's responses.retrieve / delete / cancel / input_items.list call: a clear 404 (after the
# key is checked) rather than the router's bare "Not Found", which reads like a wrong base URL.
@route(f"{PATH}/{{response_id:str}}", http_method=["GET", "DELETE"], status_code=200)
async def stored_response(request: Request[Any, Any, Any], response_id: str) -> Response[Any]:
    await begin(request, "responses")
    raise _not_stored(response_id)


@post(f"{PATH}/{{response_id:str}}/cancel", status_code=200)
async def cancel_response(request: Request[Any, Any, Any], response_id: str) -> Response[Any]:
    await begin(request, "responses")
    raise _not_stored(response_id)


@get(f"{PATH}/{{response_id:str}}/input_items")
async def response_input_items(request: Request[Any, Any, Any], response_id: str) -> Response[Any]:
    await begin(request, "responses")
    raise _not_stored(response_id)


@post(f"{PATH}/{{operation:str}}", status_code=200)
async def other_operation(request: Request[Any, Any, Any], operation: str) -> Response[Any]:
    # input_tokens, compact, ...: still a 404, not the 405 the GET and DELETE routes above would make it.
    await begin(request, "responses")
    raise NotFound(f"POST {PATH}/{operation} is not supported: Weir serves POST {PATH} only.")


ROUTES = [responses, stored_response, cancel_response, response_input_items, other_operation]
