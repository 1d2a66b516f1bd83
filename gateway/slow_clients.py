"""Slow-client limits for uvicorn (slowloris): uvicorn bounds the idle time between two requests on
a kept-alive connection (`timeout_keep_alive`), but not the time a client takes to send a request.
A client sending its headers or body a byte at a time held a connection (and, for a body, a request
task) for as long as it liked; a few thousand of them exhaust the process's file descriptors.

`guarded(protocol, header_timeout, body_timeout)` is uvicorn's HTTP protocol with two deadlines:
the request headers must be complete `header_timeout` seconds after the connection opens (or after
the first byte of the next request on a kept-alive connection), and the body `body_timeout` seconds
after the headers. A client that misses one gets a 408 in the OpenAI error shape (Anthropic's on the
Messages API's paths), with the request's id where it has one, and the connection is closed.
Responses (long streams included) are not limited here.

The same protocol bounds the size of the request line and headers (`max_header_bytes`): uvicorn's
httptools parser keeps every header byte a client sends, without limit, so one client could make the
process buffer hundreds of megabytes within the header timeout. Past the limit: 431, closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.errors import GatewayError, encode_anthropic_error, encode_openai_error, is_anthropic_path

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


def _refusal(error: GatewayError, path: str = "", request_id: str | None = None) -> bytes:
    """The whole HTTP response refusing a request to `path` (as far as it arrived) with `error`, in
    the error shape its API's clients read, with the id the gateway gave it (None before its headers
    were in: the request middleware has not seen it)."""
    anthropic = is_anthropic_path(path)
    body = encode_anthropic_error(error, request_id) if anthropic else encode_openai_error(error)
    ids = ""
    if request_id is not None:  # a valid id (gateway.ids.is_request_id): safe in a header line
        ids = f"x-request-id: {request_id}\r\n" + (f"request-id: {request_id}\r\n" if anthropic else "")
    head = (
        f"HTTP/1.1 {error.status} {_REASONS[error.status]}\r\ncontent-type: application/json\r\n"
        f"connection: close\r\n{ids}content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _timeout_response(what: str, seconds: float, path: str = "", request_id: str | None = None) -> bytes:
    error = GatewayError(
        f"The request {what} did not arrive within {seconds:g}s.",
        status=408,
        type="invalid_request_error",
        code="request_timeout",
    )
    return _refusal(error, path, request_id)


def _headers_too_large_response(limit: int, path: str) -> bytes:
    error = GatewayError(
        f"The request line and headers are larger than {limit} bytes.",
        status=431,
        type="invalid_request_error",
        code="request_headers_too_large",
    )
    return _refusal(error, path)


def _request_id(scope: dict[str, Any]) -> str | None:
    state = scope.get("state")
    info = state.get("weir") if isinstance(state, dict) else None
    request_id = getattr(info, "request_id", None)
    return request_id if isinstance(request_id, str) else None


def guarded(
    protocol: type[asyncio.Protocol], header_timeout: float, body_timeout: float, max_header_bytes: int
) -> type[Any]:
    """A subclass of uvicorn's `protocol` (httptools' or h11's) that enforces the two deadlines and
    the size of the request headers."""

    class Guarded(protocol):  # type: ignore[valid-type,misc]
        _timer: asyncio.TimerHandle | None = None
        _waiting_for: str | None = None  # "headers" or "body": what the armed timer waits for
        _header_bytes = 0  # bytes received since the request began, while its headers are incomplete
        _header_tail = b""  # the last 3 of them

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm("headers", header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self._waiting_for is None:  # the first byte of the next request
                self._arm("headers", header_timeout)
            within = self._within_header_limit(data) if self._waiting_for == "headers" else None
            if within is not None:
                # The parser gets the bytes up to the limit (the request line: which API's error
                # shape), never those past it: it would keep them all. None is no call (to h11,
                # empty data is the end of the connection).
                if within:
                    super().data_received(data[:within])
                self._refuse(_headers_too_large_response(max_header_bytes, self._partial_path()))
                return
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return  # still reading headers
            if not cycle.more_body:
                self._disarm()  # the whole request is in
            elif self._waiting_for == "headers":
                self._arm("body", body_timeout)

        def _within_header_limit(self, data: bytes) -> int | None:
            """None when `data`, the next bytes of a request whose headers are incomplete, keeps
            them within `max_header_bytes` (a read may end the headers and carry body bytes after
            them); else how many of its bytes are within the limit."""
            seen, tail = self._header_bytes, self._header_tail
            self._header_bytes += len(data)
            self._header_tail = (tail + data[-3:])[-3:]  # a blank line split between two reads
            if self._header_bytes <= max_header_bytes:
                return None
            within = max(0, max_header_bytes - seen)
            end = (tail + data[:within]).find(b"\r\n\r\n")
            return within if end == -1 else None

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._waiting_for = what
            if what == "headers":
                self._header_bytes, self._header_tail = 0, b""
            self._timer = asyncio.get_running_loop().call_later(seconds, self._expired, what, seconds)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._waiting_for = None, None

        def _partial_path(self) -> str:
            # The request target as far as it came while the headers are incomplete (httptools keeps
            # it; h11 nothing until the headers are in).
            url = getattr(self, "url", b"")
            return url.split(b"?", 1)[0].decode("latin-1") if isinstance(url, bytes) else ""

        def _refuse(self, response: bytes) -> None:
            """Answer `response` to a request whose headers are incomplete, and hang up."""
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

        def _expired(self, what: str, seconds: float) -> None:
            self._timer, self._waiting_for = None, None
            transport = self.transport
            if transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # the headers are late
                self._refuse(_timeout_response(what, seconds, self._partial_path()))
                return
            if not cycle.response_started:  # the body is late: its request's path and id are known
                path = cycle.scope["path"]
                transport.write(_timeout_response(what, seconds, path, _request_id(cycle.scope)))
            transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{protocol.__name__}"
    return Guarded


def uvicorn_protocol(header_timeout: float, body_timeout: float, max_header_bytes: int) -> type[Any]:
    """uvicorn's own choice of HTTP protocol (httptools when installed, else h11), guarded."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base: type[asyncio.Protocol] = HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is optional for uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    return guarded(base, header_timeout, body_timeout, max_header_bytes)
