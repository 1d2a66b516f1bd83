"""Slow-client limits for uvicorn (slowloris): uvicorn bounds the idle time between two requests on
a kept-alive connection (`timeout_keep_alive`), but not the time a client takes to send a request.
A client sending its headers or body a byte at a time held a connection (and, for a body, a request
task) for as long as it liked; a few thousand of them exhaust the process's file descriptors.

`guarded(protocol, header_timeout, body_timeout)` is uvicorn's HTTP protocol with two deadlines:
the request headers must be complete `header_timeout` seconds after the connection opens (or after
the first byte of the next request on a kept-alive connection), and the body `body_timeout` seconds
after the headers. A client that misses one gets a 408 in the OpenAI error shape and the connection
is closed. Responses (long streams included) are not limited here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.errors import GatewayError, encode_openai_error


def _timeout_response(what: str, seconds: float) -> bytes:
    body = encode_openai_error(
        GatewayError(
            f"The request {what} did not arrive within {seconds:g}s.",
            status=408,
            type="invalid_request_error",
            code="request_timeout",
        )
    )
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def guarded(protocol: type[asyncio.Protocol], header_timeout: float, body_timeout: float) -> type[Any]:
    """A subclass of uvicorn's `protocol` (httptools' or h11's) that enforces the two deadlines."""

    class Guarded(protocol):  # type: ignore[valid-type,misc]
        _timer: asyncio.TimerHandle | None = None
        _waiting_for: str | None = None  # "headers" or "body": what the armed timer waits for

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
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return  # still reading headers
            if not cycle.more_body:
                self._disarm()  # the whole request is in
            elif self._waiting_for == "headers":
                self._arm("body", body_timeout)

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._waiting_for = what
            self._timer = asyncio.get_running_loop().call_later(seconds, self._expired, what, seconds)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._waiting_for = None, None

        def _expired(self, what: str, seconds: float) -> None:
            self._timer, self._waiting_for = None, None
            transport = self.transport
            if transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete or not cycle.response_started:
                transport.write(_timeout_response(what, seconds))
            transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{protocol.__name__}"
    return Guarded


def uvicorn_protocol(header_timeout: float, body_timeout: float) -> type[Any]:
    """uvicorn's own choice of HTTP protocol (httptools when installed, else h11), guarded."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base: type[asyncio.Protocol] = HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is optional for uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    return guarded(base, header_timeout, body_timeout)
