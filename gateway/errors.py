"""Errors as types, and how each renders for the client's API (OpenAI's or Anthropic's error shape)."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import structlog

from gateway.usage import Usage


class GatewayError(Exception):
    """An error the client sees: its HTTP status and the fields of the OpenAI error object."""

    status: int = 500
    type: str = "api_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        billed: Usage | None = None,
        upstream_code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        # What the vendor reported, and bills, for the 200 this error stands for (a prompt it blocked,
        # an answer it failed to give): the attempt is recorded at it, not at nothing.
        self.billed = billed
        # The backend's own error code behind a 5xx the client sees under the gateway's code
        # (`backend_unavailable`...): never rendered, read where it decides a retry (the bundled
        # engine's `model_not_ready` is not worth one).
        self.upstream_code = upstream_code
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers = headers or {}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class TooManyFailedKeys(GatewayError):
    status = 429
    type = "requests"
    code = "too_many_failed_authentications"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UpstreamError(GatewayError):
    """A backend answered with an error; 4xx keep the vendor's status and message."""

    type = "upstream_error"


class BadGateway(GatewayError):
    status = 502
    type = "upstream_error"
    code = "bad_gateway"


class BackendUnavailable(GatewayError):
    status = 503
    type = "upstream_error"
    code = "backend_unavailable"


class ServerShuttingDown(GatewayError):
    """The gateway stopped (SIGTERM, SIGINT) and its drain ran out before the stream ended
    (gateway.drain): the client retries, on a replica that is not stopping."""

    status = 503
    type = "server_error"
    code = "server_shutting_down"


class GatewayTimeout(GatewayError):
    status = 504
    type = "upstream_error"
    code = "timeout"


class Unreachable(GatewayError):
    """A backend this gateway could not reach: no connection (refused, no route, DNS, TLS, the connect
    timeout), or one that broke before any answer. Mixed into the error the client sees, whose status
    and code stay those of that error; the breakers tell it from a bad answer (a 5xx, a 429), since
    this gateway alone may be cut off from a backend that answers the others."""


class CannotConnect(Unreachable, BackendUnavailable):
    """No connection to the backend (a 503)."""


class ConnectTimeout(Unreachable, GatewayTimeout):
    """No connection to the backend within its connect timeout (a 504)."""


class DroppedBeforeAnswer(Unreachable, BadGateway):
    """The connection broke before the backend sent any response (a 502)."""


# Anthropic names its error types by status; https://docs.anthropic.com/en/api/errors. Each type's
# own status comes first: the statuses after it that share its type are other vendors' words for it.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# The other way, for an error Anthropic names by type alone (an `error` event inside a 200 stream):
# the status that type has when Anthropic says it in the status line, so a route's `failover_on` and
# retries see the same failure either way.
ANTHROPIC_ERROR_STATUSES = {kind: status for status, kind in reversed(ANTHROPIC_ERROR_TYPES.items())}


def stream_failure(exc: BaseException) -> GatewayError:
    """What a client is told when a stream breaks after it started: the gateway error itself, or, for
    a bug, a generic 500 (the log has the traceback, the client never does)."""
    if isinstance(exc, GatewayError):
        return exc
    structlog.get_logger("weir.gateway").error("stream_failed", exc_info=exc)
    return GatewayError("The server had an error while processing your request.")


def openai_error_body(error: GatewayError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


OVERLOADED_STATUS = 529  # Anthropic's status for its `overloaded_error`


def anthropic_error_type(error: GatewayError) -> str:
    """The error's type in Anthropic's words. The bundled engine's full queue (its 429
    `engine_overloaded`, which OpenAI's words put as a rate limit) is an overload to Anthropic: the
    server lacks capacity, whatever the client's own rate."""
    if error.code == "engine_overloaded":
        return "overloaded_error"
    return ANTHROPIC_ERROR_TYPES.get(
        error.status, "api_error" if error.status >= 500 else "invalid_request_error"
    )


def anthropic_status(error: GatewayError) -> int:
    """The HTTP status an Anthropic client gets for `error`: 529 for an overload, as Anthropic's own
    API says it (its error list has no 503), else the error's own. The anthropic SDK retries both as
    5xx, but raises `OverloadedError` only for a 529, and its fallback middleware changes model on a
    429 or 529 only; Claude Code counts 529s as overloads (its `fallbackModel` switches on them).
    OpenAI-shaped endpoints keep the 503 (and the engine's 429) that OpenAI's clients know."""
    return OVERLOADED_STATUS if anthropic_error_type(error) == "overloaded_error" else error.status


ANTHROPIC_PATH = "/v1/messages"  # the Anthropic Messages API's (gateway.api.anthropic serves it)


def is_anthropic_path(path: str) -> bool:
    """Whether errors on `path` come in Anthropic's shape: the Messages API's, those Weir serves (a
    trailing slash too) and those it does not (`/v1/messages/batches`), whose clients read no other.
    Here, not with the routes: the server's own answers (gateway.slow_clients, gateway.disconnect),
    given outside any route, use it too."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(error: GatewayError, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error shape; `request_id` beside the error, as Anthropic's bodies carry it (the id
    of the `request-id` header, which a client that shows the body alone shows too)."""
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": anthropic_error_type(error), "message": error.message},
    }
    if request_id:
        body["request_id"] = request_id
    return body


def encode_openai_error(error: GatewayError) -> bytes:
    return msgspec.json.encode(openai_error_body(error))


def encode_anthropic_error(error: GatewayError, request_id: str | None = None) -> bytes:
    return msgspec.json.encode(anthropic_error_body(error, request_id))


def validation_error(exc: msgspec.ValidationError, prefix: str = "") -> InvalidRequest:
    """A msgspec validation error as a 400 that names the parameter (`messages[0].role`)."""
    text = str(exc)
    param = None
    marker = " - at `$"
    at = text.rfind(marker)
    if at != -1:
        param = text[at + len(marker) :].rstrip("`").lstrip(".")
        text = text[:at]
    if prefix:  # an error at the root of what was converted has no location: it is the prefix itself
        param = f"{prefix}.{param}" if param else prefix
    message = f"Invalid value for '{param}': {text}" if param else f"Invalid request: {text}"
    # msgspec says "Object missing required field `messages`": the field is the parameter.
    if text.startswith("Object missing required field `"):
        field = text.split("`")[1]
        param = f"{param}.{field}" if param else field
        message = f"Missing required parameter: '{param}'."
    return InvalidRequest(message, param=param)


S = TypeVar("S", bound=msgspec.Struct)
_decode = msgspec.json.Decoder().decode
NESTED_TOO_DEEPLY = "The JSON body of your request is nested too deeply."


def decode_body(body: bytes | str, type_: type[S]) -> S:
    """A request's JSON body as `type_`: 400 naming the parameter when it does not fit. Top-level keys
    the type does not model are kept in its `extra` field (forwarded to OpenAI-compatible backends)."""
    try:
        raw = _decode(body)
    except msgspec.DecodeError:
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The body must be a JSON object."
        ) from None
    except RecursionError:  # JSON nested thousands deep: a hostile body, not a server fault
        raise InvalidRequest(NESTED_TOO_DEEPLY) from None
    if not isinstance(raw, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    fields = type_.__struct_fields__
    if "extra" in fields:
        raw["extra"] = {key: value for key, value in raw.items() if key not in fields}
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
