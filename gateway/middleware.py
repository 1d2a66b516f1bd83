"""Per-request bookkeeping as plain ASGI: a request id (echoed in `x-request-id`, and in `request-id` on
the Anthropic Messages paths, as Anthropic sends it), one structlog line per API request when its last
byte is sent (streams included), the request's fields on every other line logged while serving it
(gateway.logging), and the request metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import is_anthropic_path
from gateway.ids import exchange_tag, is_request_id, ordered_id, tag_exchange
from gateway.logging import logged_model, logging_for
from gateway.metrics import NO_BACKEND, Metrics
from gateway.pipeline import RequestInfo

log = structlog.get_logger("weir.request")


def _incoming_id(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            # Latin-1 maps every byte to a character; any outside ASCII then fails the rule.
            return value if is_request_id(value.decode("latin-1")) else None
    return None


def request_middleware(metrics: Metrics, on_finish: Callable[[str], None] | None = None) -> Any:
    """Request id, metrics and the one log line per request; `on_finish(request_id)` runs once the
    exchange is over, every attempt included (the control plane forgets the request then)."""

    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            incoming = _incoming_id(scope)
            raw_id = incoming or ordered_id().encode()
            # A client's own id may be on other requests too: the ledger keeps this one apart by an id
            # of the gateway's own (the client's is still the one echoed, logged and searched by).
            info = RequestInfo(request_id=raw_id.decode(), exchange_id=ordered_id() if incoming else None)
            scope.setdefault("state", {})["weir"] = info
            api = scope["path"].startswith("/v1/")
            # The anthropic SDK reads the id from `request-id` (its errors' and messages' request_id);
            # the openai SDK, and everything else, from `x-request-id`. Anthropic's clients: the
            # Messages API's paths, and any request an Anthropic SDK sends (`/v1/models` answers those
            # in Anthropic's shape), which carries `anthropic-version`.
            anthropic = is_anthropic_path(scope["path"]) or any(
                name == b"anthropic-version" for name, _ in scope["headers"]
            )
            started = time.perf_counter()
            status = 500
            done = False

            def finish() -> None:
                nonlocal done
                done = True
                if not api:
                    return
                elapsed = time.perf_counter() - started
                # The model label only once a backend was chosen: clients cannot mint label values.
                backend = info.backend or NO_BACKEND
                model = info.model if info.backend else NO_BACKEND
                metrics.request_done(info.endpoint or "unknown", backend, model, status, elapsed)
                usage = info.usage
                log.info(
                    "request",
                    request_id=info.request_id,
                    # The gateway's own id of the exchange where request_id is the client's, which
                    # other requests may share (None otherwise): the ledger's, to join them by.
                    exchange_id=info.exchange_id,
                    # litestar types scope["type"] as its ScopeType enum, so == "http" above cannot
                    # narrow the scope to HTTPScope for mypy; it is one.
                    method=scope["method"],  # type: ignore[typeddict-item]
                    path=scope["path"],
                    status=status,
                    duration_ms=round(elapsed * 1000, 3),
                    ttft_ms=round(info.ttft * 1000, 3) if info.ttft is not None else None,
                    endpoint=info.endpoint or None,
                    tenant=info.tenant,
                    model=logged_model(info.model) if info.model else None,
                    backend=info.backend or None,
                    stream=info.stream,
                    input_tokens=usage.input_tokens if usage else None,
                    cached_input_tokens=usage.cached_input_tokens if usage else None,
                    cache_write_tokens=usage.cache_write_tokens if usage else None,
                    output_tokens=usage.output_tokens if usage else None,
                    error=info.error,
                    route=info.route,
                )

            async def send_wrapper(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    headers = [*message.get("headers", ()), (b"x-request-id", raw_id)]
                    if anthropic:
                        headers.append((b"request-id", raw_id))
                    if info.route is not None:
                        headers.append((b"x-weir-route", info.route.encode()))
                    if info.rate_limits:
                        headers += [
                            (name.encode(), value.encode()) for name, value in info.rate_limits.items()
                        ]
                    message["headers"] = headers
                    await send(message)
                    return
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    finish()

            if api:
                metrics.in_flight.inc()
            # A client's own id may be on other requests too: this exchange's own tag keeps what is
            # kept per request (admission, `on_finish`) apart from theirs (gateway.ids).
            tag = tag_exchange() if incoming is not None else None
            with logging_for(info):
                try:
                    await app(scope, receive, send_wrapper)
                finally:
                    if api:
                        metrics.in_flight.dec()
                        if on_finish is not None:
                            on_finish(info.request_id)
                    if not done:
                        status = 499 if status < 400 else status  # the client left before the last byte
                        finish()
                    if tag is not None:
                        exchange_tag.reset(tag)

        return middleware

    return factory
