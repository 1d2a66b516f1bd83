"""What every route handler shares: the runtime, authentication, body parsing and JSON responses."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.exceptions import InternalServerException

from gateway.errors import GatewayError, decode_body
from gateway.pipeline import Call, RequestInfo
from gateway.runtime import Gateway
from gateway.throttle import client_address

T = TypeVar("T", bound=msgspec.Struct)

_encode = msgspec.json.Encoder().encode


def runtime(request: Request[Any, Any, Any]) -> Gateway:
    return request.app.state.gateway


def request_info(request: Request[Any, Any, Any]) -> RequestInfo:
    """Set by gateway.middleware for every request; read back for the request log line."""
    return request.scope["state"]["weir"]


async def begin(request: Request[Any, Any, Any], endpoint: str) -> tuple[Gateway, Call]:
    gateway = runtime(request)
    info = request_info(request)
    info.endpoint = endpoint
    principal = await gateway.authenticate(request.headers, client_address(request.scope))
    info.tenant = principal.tenant_name
    timeout = client_timeout(request.headers.get(CLIENT_TIMEOUT_HEADER))
    return gateway, Call(info=info, principal=principal, endpoint=endpoint, client_timeout=timeout)


# How long the OpenAI and Anthropic SDKs wait for a response (their read timeout, in seconds).
CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"


def client_timeout(value: str | None) -> float | None:
    """The client's stated timeout in seconds: None unless a finite number above 0 (a hint, and any
    client may send the header)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return seconds if 0 < seconds < math.inf else None


async def parse_body(request: Request[Any, Any, Any], type_: type[T]) -> T:
    """The JSON body as `type_` (`gateway.errors.decode_body`); a client gone before sending it all is a 499."""
    try:
        body = await request.body()
    except InternalServerException as exc:
        if "disconnected" not in str(exc.detail):
            raise
        # The client left, or was dropped for sending too slowly (gateway/slow_clients.py), before
        # its body arrived: its fault, logged as 499 (nginx's "client closed request"), not a 500.
        raise GatewayError(
            "The client disconnected before sending the whole request body.",
            status=499,
            type="invalid_request_error",
            code="client_disconnected",
        ) from None
    return decode_body(body, type_)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(_encode(data), status_code=status, media_type="application/json", headers=headers)


SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
