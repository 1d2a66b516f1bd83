"""Per-tenant request limits (messages per request, concurrent streams) and the per-request `Exchange`
the guard middleware keeps: the stream leases a request holds, and its bodies when its tenant stores
prompts.

A stream slot is leased when a streaming request is admitted (before it goes upstream) and given
back by the middleware when the HTTP exchange ends, however it ends (last byte, client gone, error),
so a lease can never leak. With Redis the slots are shared by every replica (gateway.stream_slots),
without it each replica counts its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, cast

from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from gateway.auth import Principal
from gateway.config import Config
from gateway.errors import GatewayError, InvalidRequest
from gateway.stream_slots import LocalSlots, RedisSlots

MAX_CAPTURED_BYTES = 1024 * 1024  # a stored request or response body is cut here
STREAM_RETRY_AFTER_S = 1  # when a stream slot frees is unknown; streams are usually short


class TooManyStreams(GatewayError):
    status = 429
    type = "requests"
    code = "concurrent_streams_exceeded"


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A tenant's own settings; None falls back to the config's `limits:`."""

    max_messages: int | None = None
    max_concurrent_streams: int | None = None
    store_prompts: bool = False
    max_output_tokens: int | None = None  # config tenants only (admin-DB tenants use `limits:`)


NO_POLICY = TenantPolicy()


@dataclass(slots=True)
class Exchange:
    """One HTTP exchange under the guard middleware."""

    leases: list[tuple[str, str]] = field(default_factory=list)  # (tenant id, lease id) of stream slots
    capture: bool = False  # keep the bodies (the tenant stores prompts)
    tenant_id: str = ""
    request: list[bytes] = field(default_factory=list)
    request_bytes: int = 0
    response: list[bytes] = field(default_factory=list)
    response_bytes: int = 0
    status: int = 0


_current: ContextVar[Exchange | None] = ContextVar("weir_exchange", default=None)
Admission = Callable[[Any, Any, Any], Awaitable[None]]
# Called when a captured exchange ends: (exchange, request id, endpoint).
CaptureSink = Callable[[Exchange, str, str], None]


def current() -> Exchange | None:
    return _current.get()


class RequestLimits:
    def __init__(self, config: Config) -> None:
        self.defaults = config.limits
        self.static = {
            t.name: TenantPolicy(
                t.max_messages, t.max_concurrent_streams, max_output_tokens=t.max_output_tokens
            )
            for t in config.tenants or []
        }
        # Admin-DB tenants: set by the app to read the policy cached with the caller's key.
        self.lookup: Callable[[Principal], TenantPolicy | None] | None = None
        self.on_capture: CaptureSink | None = None
        self.local = LocalSlots()
        self.shared: RedisSlots | None = None  # set when Redis is configured: slots across replicas

    @property
    def streams(self) -> dict[str, int]:
        """Streams this replica counts itself (all of them without Redis), per tenant id."""
        return self.local.streams if self.shared is None else self.shared.local.streams

    def policy(self, principal: Principal) -> TenantPolicy:
        found = self.lookup(principal) if self.lookup is not None else None
        if found is None:
            found = self.static.get(principal.tenant_id)
        return found or NO_POLICY

    def check_messages(self, principal: Principal, count: int) -> None:
        limit = self.policy(principal).max_messages or self.defaults.max_messages
        if limit is not None and count > limit:
            raise InvalidRequest(
                f"'messages' has {count} messages; at most {limit} are allowed per request.",
                param="messages",
                code="too_many_messages",
            )

    def output_cap(self, principal: Principal, requested: int | None, param: str) -> int | None:
        """The output-token cap for this request: None when no limit applies; a request asking for more
        is refused (400, nothing sent upstream); one asking for nothing gets the cap, so a backend's own
        default can never run past it."""
        limit = self.policy(principal).max_output_tokens or self.defaults.max_output_tokens
        if limit is None:
            return None
        if requested is not None and requested > limit:
            raise InvalidRequest(
                f"'{param}' is {requested}; at most {limit} output tokens are allowed per request.",
                param=param,
                code="max_tokens_exceeded",
            )
        return limit if requested is None else None

    def admission(self, then: Admission | None) -> Admission:
        """The pipeline's admission hook: these limits first, then `then` (rate limits, budgets)."""

        async def admit(call: Any, target: Any, upstream: Any) -> None:
            await self.admit(call.principal, upstream.stream)
            if then is not None:
                await then(call, target, upstream)

        return admit

    async def admit(self, principal: Principal, stream: bool) -> None:
        exchange = _current.get()
        if exchange is None:  # not under the middleware: nothing could give a lease back
            return
        policy = self.policy(principal)
        if policy.store_prompts:
            exchange.capture, exchange.tenant_id = True, principal.tenant_id
        if not stream:
            return
        limit = policy.max_concurrent_streams or self.defaults.max_concurrent_streams
        if limit is None:
            return
        tenant = principal.tenant_id
        if self.shared is not None:
            lease = await self.shared.acquire(tenant, limit)
        else:
            lease = "local" if self.local.acquire(tenant, limit) else None
        if lease is None:
            raise TooManyStreams(
                f"Too many concurrent streams: at most {limit} at a time for this organization. "
                "Retry when one of your streams has finished.",
                headers={"retry-after": str(STREAM_RETRY_AFTER_S)},
            )
        exchange.leases.append((tenant, lease))

    def release(self, exchange: Exchange) -> None:
        for tenant, lease in exchange.leases:
            if self.shared is not None:
                self.shared.release(tenant, lease)
            else:
                self.local.release(tenant)
        exchange.leases.clear()

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Gives every /v1/ request an Exchange; releases its leases and hands over its captured
        bodies once the exchange is over."""

        async def guard(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                await app(scope, receive, send)
                return
            exchange = Exchange()
            token = _current.set(exchange)

            async def receive_body() -> ReceiveMessage:
                message = await receive()
                if message["type"] == "http.request" and exchange.request_bytes < MAX_CAPTURED_BYTES:
                    body = message.get("body", b"")
                    exchange.request.append(body)  # a reference, kept only while the exchange lasts
                    exchange.request_bytes += len(body)
                return message

            async def send_body(message: Message) -> None:
                if message["type"] == "http.response.start":
                    exchange.status = message["status"]
                else:
                    if exchange.capture and exchange.response_bytes < MAX_CAPTURED_BYTES:
                        # An http scope: of what follows the start, only http.response.body has a body.
                        body = cast("bytes", message.get("body", b""))
                        exchange.response.append(body)
                        exchange.response_bytes += len(body)
                    if exchange.leases and not message.get("more_body", False):
                        # Free before the last byte leaves: a client that starts its next stream
                        # the moment this one ends must find the slot free.
                        self.release(exchange)
                await send(message)

            try:
                await app(scope, receive_body, send_body)
            finally:
                _current.reset(token)
                self.release(exchange)
                if exchange.capture and self.on_capture is not None:
                    info = scope.get("state", {}).get("weir")
                    request_id = getattr(info, "request_id", "")
                    self.on_capture(exchange, request_id, getattr(info, "endpoint", "") or scope["path"])

        return guard
