"""What every route handler shares: the runtime, authentication, body parsing and JSON responses."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.exceptions import InternalServerException

from gateway.errors import GatewayError, InvalidRequest, validation_error
from gateway.pipeline import Call, RequestInfo
from gateway.runtime import Gateway

T = TypeVar("T", bound=msgspec.Struct)

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def runtime(request: Request[Any, Any, Any]) -> Gateway:
    return request.app.state.gateway


def request_info(request: Request[Any, Any, Any]) -> RequestInfo:
    """Set by gateway.middleware for every request; read back for the request log line."""
    return request.scope["state"]["weir"]


async def begin(request: Request[Any, Any, Any], endpoint: str) -> tuple[Gateway, Call]:
    gateway = runtime(request)
    info = request_info(request)
    info.endpoint = endpoint
    principal = await gateway.authenticate(request.headers)
    info.tenant = principal.tenant_name
    return gateway, Call(info=info, principal=principal, endpoint=endpoint)


async def parse_body(request: Request[Any, Any, Any], type_: type[T]) -> T:
    """The JSON body as `type_`: 400 naming the parameter when it does not fit. Top-level keys the
    type does not model are kept in its `extra` field (forwarded to OpenAI-compatible backends)."""
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
    try:
        raw = _decode(body)
    except msgspec.DecodeError:
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The body must be a JSON object."
        ) from None
    except RecursionError:  # JSON nested thousands deep: a hostile body, not a server fault
        raise InvalidRequest("The JSON body of your request is nested too deeply.") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    fields = type_.__struct_fields__
    if "extra" in fields:
        raw["extra"] = {key: value for key, value in raw.items() if key not in fields}
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(_encode(data), status_code=status, media_type="application/json", headers=headers)


SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
