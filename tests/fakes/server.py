"""The machinery every fake vendor shares: an aiohttp server in its own thread and event loop,
request recording, fault injection and usage overrides.

A fake works the same from sync tests, async tests, benchmarks and drills::

    with FakeOpenAI() as fake:             # or the pytest fixture `fake_openai`
        client = openai.OpenAI(base_url=fake.base_url, api_key=fake.api_key)
        fake.fail_next(Fault.status(429, retry_after=1))
        ...
        fake.requests[-1].json["model"]

Faults apply to POST requests only (generation, embeddings, token counting), so a gateway's health
probes (GET /v1/models and the like) never consume a fault meant for a real call; to fail a probe,
queue the fault with a path (``fake.fail_next(503, path="/v1/models")``). To take a whole backend
down and bring it back, use `stop()` and `start()`: the port stays the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import logging
import socket
import struct
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from aiohttp import web

from tests.fakes.behaviour import Rejoin, Reply, ReportedUsage, Turn, plan_reply
from tests.fakes.faults import Fault, FaultKind

# A reset or cut connection is the point of some faults; aiohttp would log each as an error.
logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
log = logging.getLogger("tests.fakes")

INVALID_JSON: Any = object()  # RecordedRequest.json when the body was not JSON
CONTROL_PREFIX = "/__fake__/"
BODY = web.RequestKey("fake_body", object)  # the parsed JSON body (or INVALID_JSON)
FAULT = web.RequestKey("fake_fault", Fault | None)  # the fault this request must suffer, if any
USAGE = web.RequestKey("fake_usage", ReportedUsage)  # what this request's response reports
_current: contextvars.ContextVar[web.Request] = contextvars.ContextVar("fake_request")


def current_request() -> web.Request:
    """The request the fake is answering now (in its handlers and what they call)."""
    return _current.get()


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # names lower-cased
    body: bytes
    json: Any  # parsed body; None when empty, INVALID_JSON when not JSON


class ConnectionDropped(Exception):
    """Raised inside a handler after a fault closed the connection on purpose."""


class ConnectionStalled(Exception):
    """Raised inside a handler whose reply a fault stalls midway (the reply's body is its argument)."""


class StreamFinished(Exception):
    """Raised inside a handler after a fault ended the stream early (e.g. an in-stream error event)."""


@dataclass
class UsageOverride:
    fields: dict[str, int]
    raw: dict[str, Any] | None


class Invalid(Exception):
    """A request the vendor would refuse: its status and message, rendered in the vendor's error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class FakeServer:
    """Base class: subclasses add routes and the vendor's error shapes."""

    vendor: ClassVar[str] = "fake"
    default_models: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        api_key: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        models: tuple[str, ...] | None = None,
        max_recorded: int = 50_000,
    ) -> None:
        self.api_key = api_key or f"test-{self.vendor}-key"
        self.max_recorded = max_recorded  # older requests and usages are dropped (soaks, drills)
        self.host = host
        self.port = port
        self.requests: list[RecordedRequest] = []
        self.usages: list[ReportedUsage] = []  # one per generation response, in order
        self._initial_models = models if models is not None else self.default_models
        self.models: set[str] = set(self._initial_models)
        self._faults: deque[tuple[Fault, str | None]] = deque()  # (fault, path filter)
        self.first_token_delay = 0.0  # seconds before the first token of every generation (set_latency)
        self.token_delay = 0.0  # seconds per further token
        self._usage_overrides: deque[UsageOverride] = deque()
        self._answers: dict[str, Callable[[str], str]] = {}  # model -> reply to the last user text
        self.rejoin: Rejoin | None = None  # how continuations asked for in a user turn are joined
        self.queue_waiting: int | None = None  # reported as ORCA load when a request asks (report_load)
        self.capacity_tier: str | None = None  # the tier `auto` requests are served at (serve_auto_at)
        self._lock = threading.Lock()
        self._generation = 0  # bumped by reset() and stop() to release hanging requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Self:
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        started: asyncio.Future[None] = loop.create_future()
        self._loop = loop
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=f"fake-{self.vendor}", daemon=True
        )
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._await(started), loop).result(timeout=30)
        return self

    def stop(self) -> None:
        """Close the server (open connections included); `start()` brings it back on the same port."""
        if self._thread is None or self._loop is None:
            return
        self._generation += 1
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        self._thread = self._loop = self._runner = None

    close = stop

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def origin(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.origin

    @property
    def running(self) -> bool:
        return self._thread is not None

    def reset(self) -> None:
        """Forget requests, queued faults, usage overrides and cached prompts; release hung requests."""
        with self._lock:
            self.requests.clear()
            self.usages.clear()
            self._faults.clear()
            self._usage_overrides.clear()
            self._answers.clear()
            self.rejoin = None
            self.queue_waiting = None
            self.capacity_tier = None
            self.models = set(self._initial_models)
            self.first_token_delay = self.token_delay = 0.0
            self._generation += 1
        self.reset_state()

    def reset_state(self) -> None:
        """Subclasses clear their prompt caches and other vendor state here."""

    # ---- test controls ---------------------------------------------------------------------------

    def fail_next(self, fault: Fault | int, times: int = 1, *, path: str | None = None) -> None:
        """Queue `fault` for the next `times` POST requests (an int means `Fault.status(code)`).

        With `path`, the fault waits instead for the next request of any method whose path contains
        that string (e.g. ``path="/v1/models"`` to fail a gateway's health probe).
        """
        if isinstance(fault, int):
            fault = Fault.status(fault)
        with self._lock:
            self._faults.extend([(fault, path)] * times)

    def answer_as(self, model: str, reply: Callable[[str], str]) -> None:
        """The model `model` answers chats with `reply(last user text)` instead of the echo (a grader,
        a model that gets some questions wrong), until `reset()`. OpenAI and Anthropic fakes."""
        with self._lock:
            self._answers[model] = reply

    def continue_loosely(self, restate: int = 0, restart: bool = False) -> None:
        """Continuations asked for in a user turn (Weir's `CONTINUE_INSTRUCTION`) are joined as real
        models often join them, until `reset()`: the partial answer's last `restate` words written
        again, the whole answer from its beginning (`restart`), or else the rest without the space
        that joins it (`behaviour.Rejoin`)."""
        self.rejoin = Rejoin(restate=restate, restart=restart)

    def reply_to(self, model: object, turn: Turn) -> Reply:
        """What `model` says to `turn`: its `answer_as` reply, else the deterministic behaviour."""
        answer = self._answers.get(model) if isinstance(model, str) else None
        if answer is None or turn.tools:
            return plan_reply(turn)
        return Reply(text=answer(turn.last_user_text))

    def serve_auto_at(self, tier: str | None) -> None:
        """Requests that leave the service tier to the vendor (`auto`, or none: OpenAI's and
        Anthropic's default) are served, and report being served, at `tier` until `reset()`: a project
        with Scale Tier or Priority capacity (None: the vendor's standard tier)."""
        self.capacity_tier = tier

    def report_load(self, waiting: int | None) -> None:
        """Answer requests that carry ``endpoint-load-metrics-format`` with an ORCA load report of
        `waiting` queued requests, as vLLM and Weir's engine do (None: no report), until `reset()`."""
        self.queue_waiting = waiting

    async def _load_report(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.queue_waiting is not None and "endpoint-load-metrics-format" in request.headers:
            response.headers["endpoint-load-metrics"] = (
                f"TEXT named_metrics.num_requests_running=1, named_metrics.num_requests_waiting={self.queue_waiting}"
            )

    def set_latency(self, first_token: float = 0.0, per_token: float = 0.0) -> None:
        """Make every generation take time like a real model: `first_token` seconds to the first token,
        then `per_token` per token (streams: between chunks; JSON replies: all of it before the answer).
        Until `reset()`; for one-off slowness use `Fault.delay` / `Fault.slow_stream`."""
        self.first_token_delay, self.token_delay = first_token, per_token

    def set_next_usage(self, raw: dict[str, Any] | None = None, **fields: int) -> None:
        """Override the usage the next response that reports usage (generation, embeddings) carries.

        Keyword fields use Weir's normalised names (those of `ReportedUsage`: input_tokens,
        cached_input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, output_tokens,
        reasoning_tokens) and are rendered in the vendor's own format; `raw` is a vendor-format dict
        deep-merged over the rendered usage last, for reporting quirks the fields cannot express.
        """
        unknown = set(fields) - {f.name for f in dataclasses.fields(ReportedUsage)}
        if unknown:
            raise TypeError(f"unknown usage fields: {sorted(unknown)}")
        self._usage_overrides.append(UsageOverride(fields, raw))

    @property
    def last_request(self) -> RecordedRequest:
        return self.requests[-1]

    @property
    def posts(self) -> list[RecordedRequest]:
        """The requests that asked for work: a gateway's health probes (GETs) are left out, so a test
        waiting for "the request is upstream now" cannot be woken by a probe."""
        return [r for r in self.requests if r.method == "POST"]

    @property
    def last_usage(self) -> ReportedUsage:
        return self.usages[-1]

    # ---- for subclasses --------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        raise NotImplementedError

    def auth_error(self, request: web.Request) -> web.StreamResponse | None:
        """The vendor's response to a missing or wrong key, or None when the key is right."""
        raise NotImplementedError

    def error_response(self, status: int, message: str | None = None, **extra: Any) -> web.Response:
        """The vendor's error body for `status`."""
        raise NotImplementedError

    def stream_error_frame(self, status: int, message: str | None) -> bytes:
        """The vendor's in-stream error event."""
        raise NotImplementedError

    def is_stream(self, request: web.Request, body: Any) -> bool:
        return isinstance(body, dict) and body.get("stream") is True

    def response_headers(self) -> dict[str, str]:
        return {}

    def take_usage(self, computed: ReportedUsage) -> tuple[ReportedUsage, dict[str, Any] | None]:
        """Apply the queued override, if any, and record what this response reports."""
        raw = None
        with contextlib.suppress(IndexError):
            override = self._usage_overrides.popleft()
            computed = dataclasses.replace(computed, **override.fields)
            raw = override.raw
        self.usages.append(computed)
        _trim(self.usages, self.max_recorded)
        with contextlib.suppress(LookupError):
            _current.get()[USAGE] = computed
        return computed, raw

    def json_response(
        self, request: web.Request, payload: Any, status: int = 200, headers: dict[str, str] | None = None
    ) -> web.Response:
        body = json.dumps(payload).encode()
        fault = request.get(FAULT)
        if fault is not None and fault.kind is FaultKind.CUT_STREAM:
            raise ConnectionDropped(body)  # the middleware sends part of it, then drops the connection
        if fault is not None and fault.kind is FaultKind.STALL:
            raise ConnectionStalled(body)  # the middleware sends part of it, then nothing
        return web.Response(
            body=body,
            status=status,
            content_type="application/json",
            headers={**self.response_headers(), **(headers or {})},
        )

    def open_stream(self, request: web.Request, content_type: str = "text/event-stream") -> EventStream:
        return EventStream(self, request, content_type)

    def _hang_released(self, generation: int) -> bool:
        return generation != self._generation or self._thread is None

    async def _hang(self) -> None:
        """Until `reset()` or `stop()` releases the requests hanging now."""
        generation = self._generation
        while not self._hang_released(generation):
            await asyncio.sleep(0.05)

    # ---- internals -------------------------------------------------------------------------------

    @staticmethod
    async def _await(fut: asyncio.Future[None]) -> None:
        await fut

    def _run(self, started: asyncio.Future[None]) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)

        async def boot() -> None:
            try:
                await self._serve()
            except BaseException as exc:
                started.set_exception(exc)
            else:
                started.set_result(None)

        self._loop.create_task(boot())
        self._loop.run_forever()

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._middleware], client_max_size=256 * 1024 * 1024)
        app.add_routes(self.routes())
        app.on_response_prepare.append(self._load_report)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True, shutdown_timeout=0.5)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _take_fault(self, request: web.Request) -> Fault | None:
        with self._lock:
            for i, (fault, path) in enumerate(self._faults):
                if (path is None and request.method == "POST") or (path is not None and path in request.path):
                    del self._faults[i]
                    return fault
        return None

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = INVALID_JSON
        if request.path.startswith(CONTROL_PREFIX):
            return self._control(request, body)
        self.requests.append(
            RecordedRequest(
                method=request.method,
                path=request.path,
                query=dict(request.query),
                headers={k.lower(): v for k, v in request.headers.items()},
                body=raw,
                json=body,
            )
        )
        _trim(self.requests, self.max_recorded)
        request[BODY] = body
        denied = self.auth_error(request)
        if denied is not None:
            return denied
        fault = self._take_fault(request)
        request[FAULT] = fault
        try:
            if fault is not None:
                early = await self._early_fault(request, fault, body)
                if early is not None:
                    return early
            _current.set(request)
            response = await handler(request)
            usage = request.get(USAGE)
            if usage is not None and not response.prepared and (self.first_token_delay or self.token_delay):
                await asyncio.sleep(
                    self.first_token_delay + self.token_delay * max(0, usage.output_tokens - 1)
                )
            return response
        except ConnectionDropped as dropped:
            return await self._drop_midway(request, dropped.args[0] if dropped.args else b"")
        except ConnectionStalled as stalled:
            return await self._drop_midway(request, stalled.args[0], stall=True)
        except StreamFinished as finished:
            return finished.args[0]
        except ConnectionResetError:
            # The caller hung up before the reply (a gateway that cancelled a losing hedge or a
            # stream too slow for its TTFT timeout): nobody is left to answer, and the fake is fine.
            raise asyncio.CancelledError from None
        except Exception:
            # a bug in the fake itself: make it loud in the test log, answer like the vendor's 500
            log.exception("fake %s failed on %s %s", self.vendor, request.method, request.path)
            return self.error_response(500, f"fake {self.vendor} crashed; see the test log")

    def _control(self, request: web.Request, body: Any) -> web.Response:
        """Out-of-process controls (``python -m tests.fakes``): queue a fault, reset."""
        action = request.path.removeprefix(CONTROL_PREFIX)
        if request.method != "POST" or action not in ("fail_next", "reset"):
            return web.json_response({"error": "POST /__fake__/fail_next or /__fake__/reset"}, status=404)
        if action == "reset":
            self.reset()
            return web.json_response({"ok": True})
        spec = dict(body) if isinstance(body, dict) else {}
        times, path = int(spec.pop("times", 1)), spec.pop("path", None)
        try:
            fault = Fault(kind=FaultKind(spec.pop("kind")), **spec)
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response({"error": f"bad fault: {exc!r}"}, status=400)
        self.fail_next(fault, times, path=path)
        return web.json_response({"ok": True, "queued": times})

    async def _early_fault(self, request: web.Request, fault: Fault, body: Any) -> web.StreamResponse | None:
        kind = fault.kind
        if kind is FaultKind.STATUS:
            headers = {} if fault.retry_after is None else {"retry-after": f"{fault.retry_after:g}"}
            extra: dict[str, Any] = {}
            if fault.retry_delay is not None:
                extra["retry_delay"] = fault.retry_delay
            if fault.code is not None:
                extra["code"] = fault.code
            resp = self.error_response(fault.status_code, fault.message, **extra)
            resp.headers.update(headers)
            return resp
        if kind is FaultKind.DELAY:
            await asyncio.sleep(fault.seconds)
            return None
        if kind is FaultKind.HANG:
            await self._hang()
            return self.error_response(503, "released")
        if kind is FaultKind.RESET:
            _reset_connection(request)
            raise asyncio.CancelledError
        if kind is FaultKind.GARBAGE:
            if self.is_stream(request, body):
                return web.Response(
                    body=b'data: {"id": "garbage", "choices": [{"ind <<garbage>>\n\nnot-an-event\n\n',
                    content_type="text/event-stream",
                )
            return web.Response(
                body=b'{"id": "garbage", "choices": [{"ind <<garbage>>', content_type="application/json"
            )
        if kind is FaultKind.WRONG_CONTENT_TYPE:
            return web.Response(
                text="<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>",
                content_type="text/html",
            )
        return None  # CUT_STREAM, STREAM_ERROR, SLOW_STREAM, STALL and HUGE are applied while responding

    async def _drop_midway(
        self, request: web.Request, body: bytes, stall: bool = False
    ) -> web.StreamResponse:
        """Half of `body` (its headers announce all of it), then the connection drops: at once, or
        (`stall`) once `reset()` or `stop()` releases it."""
        resp = web.StreamResponse(
            status=200, headers={**self.response_headers(), "content-type": "application/json"}
        )
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        if stall:
            await self._hang()
        _drop_connection(request)
        raise asyncio.CancelledError


def _trim(items: list[Any], limit: int) -> None:
    if len(items) > limit:
        del items[: len(items) - limit]


def _reset_connection(request: web.Request) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed upstream or a middlebox would."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _drop_connection(request: web.Request) -> None:
    """Close mid-body (a plain FIN): what was written arrives, the end of the body never does."""
    if request.transport is not None:
        request.transport.close()


class EventStream:
    """A streamed response that applies the request's stream faults as chunks go out."""

    def __init__(self, server: FakeServer, request: web.Request, content_type: str) -> None:
        self.server = server
        self.request = request
        self.fault = request.get(FAULT)
        self.sent = 0
        self.response = web.StreamResponse(
            status=200,
            headers={
                **server.response_headers(),
                "content-type": content_type,
                "cache-control": "no-cache",
            },
        )

    async def __aenter__(self) -> Self:
        await self.response.prepare(self.request)
        return self

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            await self.response.write_eof()

    async def send(self, frame: bytes) -> None:
        fault = self.fault
        if fault is not None and self.sent >= fault.after:
            if fault.kind in (FaultKind.CUT_STREAM, FaultKind.STALL):
                if fault.kind is FaultKind.STALL:
                    await self.server._hang()
                _drop_connection(self.request)
                raise asyncio.CancelledError
            if fault.kind in (FaultKind.STREAM_ERROR, FaultKind.END_STREAM):
                if fault.kind is FaultKind.STREAM_ERROR:
                    await self.response.write(
                        self.server.stream_error_frame(fault.status_code, fault.message)
                    )
                await self.response.write_eof()
                raise StreamFinished(self.response)
        if fault is not None and fault.kind is FaultKind.SLOW_STREAM and self.sent:
            await asyncio.sleep(fault.seconds)
        elif self.sent == 0 and self.server.first_token_delay:
            await asyncio.sleep(self.server.first_token_delay)
        elif self.sent > 0 and self.server.token_delay:
            await asyncio.sleep(self.server.token_delay)
        await self.response.write(frame)
        self.sent += 1


def sse(data: Any, event: str | None = None, sep: bytes = b"\n\n") -> bytes:
    """One server-sent event: optional `event:` line, then `data:` with compact-ish JSON."""
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}".encode() + sep
