"""One upstream attempt, from translated request to canonical result, with its usage event.

The API layer resolves targets and calls these; the routing executor (retries, fallback) will call
them once per attempt. Every attempt ends in exactly one UsageEvent, whatever happens to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import math
import re
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
import structlog

from gateway.accounting.events import UsageEvent
from gateway.accounting.money import usd_per_mtok_to_micro
from gateway.accounting.pricing import LongContextSheet, PricesAt, TokenClass, price_usage, vendor_prices
from gateway.aio import Background
from gateway.auth import Principal
from gateway.config import Backend, Model, Price, TierPrice
from gateway.errors import (
    ANTHROPIC_ERROR_TYPES,
    BadGateway,
    CannotConnect,
    GatewayError,
    GatewayTimeout,
)
from gateway.estimate import Produced, whole_answer
from gateway.ids import ordered_id
from gateway.logging import REDACTED
from gateway.metrics import Metrics
from gateway.providers.base import StreamDecoder, UpstreamRequest
from gateway.router_basic import Target
from gateway.transport import MAX_RESPONSE_BODY, Transport, UpstreamResponse, body_size, describe
from gateway.types import is_answer, streams_reasoning
from gateway.usage import Usage
from gateway.usage_sink import UsageSink
from routing.load import LoadReports


class HasUsage(Protocol):
    @property
    def usage(self) -> Usage | None: ...


log = structlog.get_logger("weir.gateway")

R = TypeVar("R", bound=HasUsage)
T = TypeVar("T")


@dataclass(slots=True)
class RequestInfo:
    """What the request log line and the metrics say about one request; filled in as it goes."""

    request_id: str
    # The gateway's own id of this exchange (`ids.ordered_id`) when `request_id` is the client's
    # `x-request-id`, which a client may send on many requests: the ledger tells such requests apart
    # by it. None when `request_id` is the gateway's own, unique already.
    exchange_id: str | None = None
    endpoint: str = ""
    model: str = ""
    backend: str = ""
    tenant: str | None = None
    stream: bool = False
    usage: Usage | None = None
    ttft: float | None = None  # seconds
    error: str | None = None
    route: str | None = None  # the routing decision (x-weir-route header, usage events)
    # The x-ratelimit-* headers of the tenant's and key's RPM/TPM limits, as admission counted the
    # request (gateway.accounting.admission.rate_headers); a refusal's are on its 429 instead.
    rate_limits: dict[str, str] | None = None
    # The client left before its response started, and its request was cancelled for it
    # (gateway.disconnect): the attempts that cancels are the client's 499s, not the gateway's own.
    client_gone: bool = False
    answered: bool = False  # an attempt answered: the line names it, whatever is recorded after it
    over: bool = False  # the exchange ended: later log lines are not its (gateway.logging)


@dataclass(slots=True)
class Call:
    """One client request as the pipeline sees it."""

    info: RequestInfo
    principal: Principal
    endpoint: str
    started: float = field(default_factory=time.perf_counter)
    # Awaited with an attempt's usage event once it is recorded, by attempt number: a spend cap charged
    # an estimate (hedged attempts, comparisons) is corrected with what the attempt is billed.
    on_cost: dict[int, Callable[[UsageEvent], Awaitable[None]]] = field(default_factory=dict)
    # The routing decision as of each attempt, by attempt number, for that attempt's usage event: a
    # hedge runs beside the primary, so `info.route` names whichever of them started last.
    routes: dict[int, str] = field(default_factory=dict)
    # Attempts the router itself ends, by attempt number, with the error type and status to record for
    # them, set before it cancels them: a stream too slow for the route's TTFT timeout is its backend's
    # 504 (`upstream_error`), a hedge that lost is `cancelled` (499). An attempt cancelled without an
    # entry here was ended by its client leaving.
    stopped: dict[int, tuple[str, int]] = field(default_factory=dict)
    # Attempts admitted (past the gateway's own limits, `Pipeline._admit`), by attempt number: each has a usage event,
    # recorded as it ends or, a whole answer whose body is still awaited, later in the background.
    admitted: set[int] = field(default_factory=set)
    # The model (configured name) the first attempt went to: a later attempt on another is a fallback
    # (its usage event's `fallback`), one on the same model a retry, which is none.
    first_model: str | None = None
    # Seconds from `started` the client said it waits for its response (`x-stainless-read-timeout`,
    # which the OpenAI and Anthropic SDKs send): a hint, None when it said nothing usable.
    client_timeout: float | None = None
    # Why Weir itself makes this call (`UsageEvent.purpose`: a comparison's `compare` or `judge`);
    # None for a client's request, the only kind the usage report counts as requests.
    purpose: str | None = None

    def time_left(self) -> float:
        """Seconds until the client gives up, as it said (`client_timeout`): infinite if it did not."""
        if self.client_timeout is None:
            return math.inf
        return self.client_timeout - (time.perf_counter() - self.started)


# `weir_errors_total`'s `type` values: the gateway's own, and the error types of the vendors' APIs.
# A vendor's 4xx passes its own `type` on to the client; an OpenAI-compatible server may send any
# string there, which must not mint a series.
_ERROR_LABELS = frozenset(
    {
        *ANTHROPIC_ERROR_TYPES.values(),
        "upstream_error",
        "client_disconnected",
        "cancelled",
        "insufficient_quota",
        "server_shutting_down",  # a stream the drain's deadline ended (gateway.drain)
    }
)


def _error_label(failure: str, status: int) -> str:
    if failure in _ERROR_LABELS:
        return failure
    return (
        "rate_limit_error"
        if status == 429
        else "invalid_request_error"
        if 400 <= status < 500
        else "upstream_error"
    )


_PRICE_CLASSES = (
    TokenClass.INPUT,
    TokenClass.CACHED_INPUT,
    TokenClass.CACHE_WRITE_5M,
    TokenClass.CACHE_WRITE_1H,
    TokenClass.OUTPUT,
    TokenClass.WEB_SEARCH,  # the base price's alone (`Price.web_search`): no tier sets one
)


def _rates(price: Price | TierPrice) -> dict[TokenClass, int]:
    """The classes `price` sets, in micro-USD per 1M tokens (or searches)."""
    return {
        token_class: usd_per_mtok_to_micro(value)
        for token_class in _PRICE_CLASSES
        if (value := getattr(price, token_class, None)) is not None
    }


def price_sheet(model: Model) -> dict[TokenClass, int]:
    return _rates(model.price)


def tier_sheets(model: Model) -> dict[str, dict[TokenClass, int]]:
    """Each service tier's prices of `model` (`Price.tiers`): its rates over the base prices."""
    base = price_sheet(model)
    return {name: base | _rates(tier) for name, tier in model.price.tiers.items()}


def long_context_sheet(model: Model) -> LongContextSheet | None:
    tier = model.price.long_context
    return (
        None if tier is None else LongContextSheet(tier.above_prompt_tokens, _rates(tier), price_sheet(model))
    )


def model_prices(
    model: Model,
    catalog: dict[TokenClass, int],
    service_tier: str | None,
    prompt_tokens: int,
    vendor: str = "",
) -> dict[TokenClass, int]:
    """The prices that bill an attempt on `model` served at `service_tier` with a prompt of
    `prompt_tokens`: the catalog's (`catalog`, empty where it has none for the model), else the
    config's `price`, at the tier's own prices where it has some, else the base ones; where the
    prompt is above the config's `long_context` threshold, those prices times its multiples of the
    base (`LongContextSheet.apply`: a flex long prompt keeps its discount). One rule for billing
    (`Pipeline.billing_prices`) and for the prices `cheapest` expects (`routing.policies`).
    `vendor`: the backend's type, whose rule prices the cache reads and writes those prices leave out
    (`pricing.vendor_prices`: Anthropic's 0.1x, 1.25x and 2x the input price that bills the attempt)."""
    prices = catalog or (service_tier and tier_sheets(model).get(service_tier)) or price_sheet(model)
    tier = long_context_sheet(model)
    if tier is not None:
        prices = tier.apply(prices, prompt_tokens)
    return vendor_prices(prices, vendor)


# How long an attempt cancelled while its whole answer's body comes in still waits for it, for its
# vendor's usage report (`_cut_answer`): the body usually arrives with the headers. The attempt ends
# at once, and waits in the background (`Pipeline.background`): whoever cancelled it (a hedge race's
# winner, `routing.execute._abandon`) does not wait for it.
CUT_ANSWER_WAIT = 0.2  # seconds

# Rate limits and budgets (the control plane): raises a 429 GatewayError to refuse a request.
Admission = Callable[[Call, Target, UpstreamRequest], Awaitable[None]]


class Pipeline:
    def __init__(
        self,
        transport: Transport,
        sink: UsageSink,
        metrics: Metrics,
        models: list[Model],
        admission: Admission | None = None,
        loads: LoadReports | None = None,
    ) -> None:
        self.transport = transport
        self.sink = sink
        self.metrics = metrics
        self.admission = admission
        # What engine replicas report of their queues, for the router (its PolicyContext's).
        self.loads = loads if loads is not None else LoadReports()
        self.long_context = {
            model.name: tier for model in models if (tier := long_context_sheet(model)) is not None
        }
        # The admin DB's price catalog (`PriceCatalog.prices_at`) where there is one: it bills an
        # attempt whose backend and upstream model it prices (`billing_prices`).
        self.catalog: PricesAt | None = None
        # Attempts ended whose usage events are still to be recorded (`exchange`): awaited at shutdown.
        self.background = Background()
        # Why a backend is known to be unreachable, by its name, without a connection tried: a
        # supervised engine given up on (gateway.runtime), whose client is told why, not only that
        # nothing listens on its port.
        self.given_up: Callable[[str], str | None] = lambda backend: None

    def billing_prices(
        self, target: Target, at: dt.datetime, prompt_tokens: int = 0, service_tier: str | None = None
    ) -> dict[TokenClass, int]:
        """The prices that bill an attempt on `target` started at `at` with a prompt of `prompt_tokens`,
        served at `service_tier` (as its vendor said; None: it said none): the catalog's valid then,
        where it has any for the backend and upstream model, else the config's `price`; a tier's own
        prices where it has some, else the base ones; at the config's `long_context` rates where the
        prompt is above its threshold."""
        catalog: dict[TokenClass, int] = {}
        if self.catalog is not None:
            catalog = self.catalog(target.backend.name, target.upstream_model, at, service_tier)
        return model_prices(target.model, catalog, service_tier, prompt_tokens, target.backend.type)

    async def exchange(
        self,
        call: Call,
        target: Target,
        upstream: UpstreamRequest,
        parse: Callable[[bytes, str], R],
        attempt: int = 1,
        sending: Callable[[], None] | None = None,
        answering: Callable[[], bool] | None = None,
    ) -> R:
        """A non-streaming attempt: send, read, translate. `sending` is called once the attempt is
        admitted, as it goes upstream: where the router's clocks for the backend start. `answering` is
        asked once the answer is read, before its usage event is recorded: False when the router will
        not take it (a hedge race the other attempt won meanwhile), and the attempt ends as one the
        router cancelled a moment earlier would (`Call.stopped`, else `cancelled`), billed the usage
        its vendor reported. Cancelled once its status line arrived, before its body was read, or
        with its body not read to its end (broken off, silent past `timeouts.read`, larger than
        MAX_RESPONSE_BODY), it is billed what `_cut_answer` says: the attempt ends at once, and its
        usage event is recorded once that is known, in the background (`background`) while its body
        may still come."""
        left = await self._admit(call, target, upstream, attempt)
        started_at, t0 = time.time(), time.perf_counter()
        record = functools.partial(
            self._record, call, target, attempt, started_at, t0, ttft=None, stream=False
        )
        status, usage, failure = 0, Usage(), None
        response: UpstreamResponse | None = None
        reading: asyncio.Task[bytes] | None = None  # the body, while the attempt waits for it
        backend = target.backend
        try:
            response = await self._send(target, upstream, left, sending)
            status = response.status
            # Read in a task of its own: cancelled meanwhile, the attempt can still have the body (and
            # its usage) that is coming in, where a cancelled read would drop what it had read.
            reading = asyncio.ensure_future(
                self.transport.read(response, backend.timeouts, backend.name, MAX_RESPONSE_BODY)
            )
            body = await asyncio.shield(reading)
            reading = None
            if status >= 400:
                raise target.provider.error(status, body, response.headers)
            result = decode(parse, backend.name, body, target.upstream_model)
            usage = result.usage or usage
            if answering is not None and not answering():
                raise asyncio.CancelledError
            return result
        except GatewayError as exc:
            redact_secrets(exc, backend)
            failure = exc.type
            if 0 < status < 400:  # answered, then broke: the attempt failed as the client saw it
                status = exc.status
            if exc.billed is not None:
                usage = exc.billed
            raise
        except asyncio.CancelledError:
            # A hedge that lost or a client that left (499), unless the router says otherwise.
            gone = ("client_disconnected", 499) if call.info.client_gone else ("cancelled", 499)
            failure, status = call.stopped.get(attempt, gone)
            raise
        finally:
            if response is None or reading is None:
                await record(usage, status, failure)
            else:
                # Its body not read to its end: the read failed (it broke off, went silent, or ran
                # past the size cap), or the body is still coming as the attempt was cancelled, and
                # is waited for in the background.
                billed = _cut_answer(call, target, upstream, parse, response, reading)
                recording = _record_cut(billed, record, status, failure)
                if reading.done():
                    await recording
                else:
                    self.background.start(recording)

    async def stream(
        self,
        call: Call,
        target: Target,
        upstream: UpstreamRequest,
        decoder: StreamDecoder,
        attempt: int = 1,
        sending: Callable[[], None] | None = None,
    ) -> AsyncIterator[Any]:
        """A streaming attempt, as batches (lists) of canonical chunks: the chunks decoded from one
        upstream read, for the API to write in one piece. Errors before the first batch raise here, so
        the API can still answer with an HTTP error status (and the router can fail over invisibly);
        later ones raise mid-stream. `sending` as in `exchange`."""
        chunks = self._stream(call, target, upstream, decoder, attempt, sending)
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            return _empty()
        return _prepend(first, chunks)

    async def _stream(
        self,
        call: Call,
        target: Target,
        upstream: UpstreamRequest,
        decoder: StreamDecoder,
        attempt: int,
        sending: Callable[[], None] | None,
    ) -> AsyncIterator[Any]:
        left = await self._admit(call, target, upstream, attempt)
        started_at, t0 = time.time(), time.perf_counter()
        status, usage, failure, ttft = 0, Usage(), None, None
        produced, usage_reported, streaming, cancelled = Produced(), False, False, False
        reasoning_streamed = False
        backend = target.backend
        try:
            response = await self._send(target, upstream, left, sending)
            status = response.status
            if status >= 400:
                body = await self.transport.read(response, backend.timeouts, backend.name, MAX_RESPONSE_BODY)
                raise target.provider.error(status, body, response.headers)
            streaming = True
            progress = time.monotonic()
            async for events in self.transport.events(response, backend.name):
                batch: list[Any] = []
                try:
                    for event, data in events:
                        for chunk in decode(decoder.feed, backend.name, event, data):
                            produced.add(chunk)
                            if chunk.usage is not None:
                                usage, usage_reported = chunk.usage, True
                            # Not the role announcement; a chunk that also reports the usage so far
                            # (vLLM's `continuous_usage_stats`) counts, as the usage report alone does not.
                            if ttft is None and is_answer(chunk):
                                ttft = time.perf_counter() - t0
                                call.info.ttft = ttft
                            reasoning_streamed = reasoning_streamed or streams_reasoning(chunk)
                            batch.append(chunk)
                except GatewayError:
                    if batch:
                        yield batch  # what arrived before the failure still reaches the client
                    raise
                if batch:
                    yield batch
                    progress = time.monotonic()  # after the client took it: its pace is not the backend's
                elif time.monotonic() - progress > backend.timeouts.read:
                    # Bytes keep coming (keep-alive comments, pings) but no content: as silent as
                    # a backend that sends nothing, which the socket's read timeout would end.
                    raise GatewayTimeout(
                        f"backend {backend.name} sent no content for {backend.timeouts.read:g}s"
                    )
            tail = decode(decoder.close, backend.name)
            for chunk in tail:
                if chunk.usage is not None:
                    usage, usage_reported = chunk.usage, True
            if tail:
                yield tail
        except GatewayError as exc:
            redact_secrets(exc, backend)
            failure = exc.type
            if 0 < status < 400:  # answered, then broke: the attempt failed as the client saw it
                status = exc.status
            if exc.billed is not None:  # the vendor's own report, in the event that ended the stream
                usage, usage_reported = exc.billed, True
            raise
        except (GeneratorExit, asyncio.CancelledError):
            # The client went away mid-stream (499), unless the router ended it (Call.stopped).
            cancelled = True
            failure, status = call.stopped.get(attempt, ("client_disconnected", 499))
            raise
        finally:
            # Cut short before the vendor's usage report (the client left, the upstream broke after
            # generating, a hedge lost): bill what the backend produced, estimated, not nothing. A
            # backend that broke before generating anything (garbage, an error event) bills nothing.
            estimated = (
                streaming
                and failure is not None
                and not usage_reported
                and (produced.chunks > 0 or cancelled)
            )
            if estimated:
                usage = _cut_usage(decoder, produced.estimate(upstream.body))
            await self._record(
                call,
                target,
                attempt,
                started_at,
                t0,
                usage,
                status,
                failure,
                ttft=ttft,
                stream=True,
                estimated=estimated,
                reasoning_streamed=reasoning_streamed,
            )

    async def _send(
        self, target: Target, upstream: UpstreamRequest, left: bool, sending: Callable[[], None] | None
    ) -> UpstreamResponse:
        """Send an admitted attempt upstream and note the load its backend reports. One admitted as its
        client left (`left`) is not sent: it raises CancelledError, for its caller to record as its
        499. Its one await is the transport's: cancelled there, its caller holds no response yet."""
        if left:
            raise asyncio.CancelledError
        if sending is not None:
            sending()
        backend = target.backend
        if (why := self.given_up(backend.name)) is not None:
            raise CannotConnect(why)  # as a refused connection is, for the breakers and failover
        response = await self.transport.send(upstream, backend.timeouts, backend.name)
        self.loads.observe(backend.name, response.headers)
        return response

    async def _admit(self, call: Call, target: Target, upstream: UpstreamRequest, attempt: int) -> bool:
        """Admit the request's first attempt (rate limits, budgets, stream slots); a refusal raises.
        Cancelled meanwhile (its client left), the admission still runs to its end: with Redis, the
        shared state may have counted the request in (a budget reservation, a stream slot) when the
        cancellation arrives, and what was counted is given back only when it is known: the stream
        slot when the exchange ends, the reservation when the attempt's usage event (a 499, which the
        caller records when this returns True) settles. Cut short, both were held for their TTLs (a
        stream slot 30 s, a budget reservation 10 minutes)."""
        cancelled = False
        if call.first_model is None:
            call.first_model = target.model.name
        if attempt == 1 and self.admission is not None:
            admitting = asyncio.ensure_future(self.admission(call, target, upstream))
            while not admitting.done():
                try:
                    await asyncio.wait({admitting})
                except asyncio.CancelledError:
                    cancelled = True
            if cancelled and admitting.exception() is not None:
                raise asyncio.CancelledError  # refused anyway: nothing was counted, and nobody is waiting
            admitting.result()  # a refusal (429) raises
        call.admitted.add(attempt)  # from here on, its usage event is recorded whatever happens
        return cancelled

    async def _record(
        self,
        call: Call,
        target: Target,
        attempt: int,
        started_at: float,
        t0: float,
        usage: Usage,
        status: int,
        failure: str | None,
        *,
        ttft: float | None,
        stream: bool,
        estimated: bool = False,
        reasoning_streamed: bool = False,
    ) -> None:
        info = call.info
        if failure is None or not info.answered:
            # A hedge that lost is recorded as it is cancelled, after a non-streaming winner's answer
            # (perhaps in the background, before that answer went out): the request's log line and
            # metrics still name the attempt that answered, with its usage, and no error.
            info.backend, info.usage = target.backend.name, usage
            info.answered = failure is None
            if failure is not None:
                info.error = failure
        labels = (call.endpoint, target.backend.name, target.model.name)
        self.metrics.attempt_done(target.backend.name, target.model.name, status)
        if ttft is not None:
            self.metrics.ttft.labels(*labels).observe(ttft)
        if failure is not None:
            self.metrics.errors.labels(*labels, _error_label(failure, status)).inc()
        ts = dt.datetime.fromtimestamp(started_at, dt.UTC)
        # Priced once, here: the ledger, budgets, spend caps and every sink take this cost.
        cost = price_usage(usage, self.billing_prices(target, ts, usage.prompt_tokens, usage.service_tier))
        event = UsageEvent(
            request_id=info.request_id,
            exchange_id=info.exchange_id,
            attempt=attempt,
            ts=ts,
            tenant_id=call.principal.tenant_id,
            key_id=call.principal.key_id,
            route=info.model or target.model.name,
            backend=target.backend.name,
            model=target.upstream_model,
            usage=usage,
            prices=cost.prices,
            cost_pico_usd=cost.cost_pico_usd,
            savings_pico_usd=cost.savings_pico_usd,
            latency_ms=(time.perf_counter() - t0) * 1000,
            ttft_ms=ttft * 1000 if ttft is not None else None,
            status=status,  # 0: the backend never answered
            error=failure,
            stream=stream,
            reasoning_streamed=reasoning_streamed,
            fallback=target.model.name != call.first_model,
            routing=call.routes.pop(attempt, None) or info.route,
            estimated=estimated,
            purpose=call.purpose,
            event_id=ordered_id(),  # time-ordered: appended at the ledger index's edge (gateway/ids.py)
        )
        self.sink.record(event)
        if (on_cost := call.on_cost.pop(attempt, None)) is not None:
            await on_cost(event)


async def _cut_answer(
    call: Call,
    target: Target,
    upstream: UpstreamRequest,
    parse: Callable[[bytes, str], HasUsage],
    response: UpstreamResponse,
    reading: asyncio.Task[bytes],
) -> tuple[Usage, bool]:
    """What a whole answer not read to its end is billed (cancelled after its status line, before its
    body was read; or its read failed: the body broke off mid-read, went silent past `timeouts.read`,
    or ran past MAX_RESPONSE_BODY), and whether that is an estimate. A 2xx comes once its vendor
    generated the whole answer, which it bills, whatever became of its body on the way: the vendor's
    own report when the body comes within CUT_ANSWER_WAIT (billed as the answer read uncancelled is:
    nothing for a body without usage or unreadable), else an estimate (`estimate.whole_answer`) from
    the request and the answer's size as far as known (`transport.body_size`, at most
    MAX_RESPONSE_BODY), less its vendor's envelope (no output for an embedding; counting tokens is
    free). An error status bills nothing, as ever."""
    ok = 200 <= response.status < 300
    body = await _read_within(reading, CUT_ANSWER_WAIT if ok else 0.0)
    if not ok or call.endpoint == "count_tokens":
        return Usage(), False
    if body is not None:
        backend, model = target.backend.name, target.upstream_model
        try:
            return decode(parse, backend, body, model).usage or Usage(), False
        except GatewayError as exc:
            return exc.billed or Usage(), False
    if call.endpoint == "embeddings":  # vectors: no output tokens, whatever their size
        return whole_answer(upstream.body, 0, 0), True
    envelope = len(target.provider.empty_answer(target.upstream_model))
    size = body_size(response)
    if size is not None and size >= MAX_RESPONSE_BODY:
        # No model writes 64 MiB of answer (16M tokens): a broken backend sent it (a gzip bomb). It is
        # billed what admission reserved for it (the request's output cap, else the default), not
        # its size.
        size = None
    return whole_answer(upstream.body, size, envelope), True


async def _record_cut(
    billed: Awaitable[tuple[Usage, bool]],
    record: Callable[..., Awaitable[None]],
    status: int,
    failure: str | None,
) -> None:
    """Record an attempt whose whole answer was not read to its end, once what it is billed, and
    whether that is an estimate, is known (`billed`, `_cut_answer`)."""
    usage, estimated = await billed
    await record(usage, status, failure, estimated=estimated)


# Names of a backend's configured headers and query parameters whose values are credentials.
# A proxy in front of a backend may take a session cookie or a credential of another name
# (`Cookie`, `x-goog-credentials`, `x-session-id`): echoed, those are as much a secret as a key.
_SECRET_NAME = re.compile(
    r"auth|key|token|secret|signature|password|cookie|credential|session", re.IGNORECASE
)


def backend_secrets(backend: Backend) -> list[str]:
    """The credentials `backend` sends upstream: its API key (the stored one where one is), and the
    values of configured headers and query parameters named like one (Azure's `api-key`, a `?key=`,
    an `Authorization: Bearer ...` and its token alone). Short values are left out: they are no
    secret, and blanking them would blank ordinary words of a message."""
    values = [backend.api_key or ""]
    for name, value in (*backend.headers.items(), *backend.query.items()):
        if _SECRET_NAME.search(name):
            values += [value, value.partition(" ")[2]]
    return sorted({value for value in values if len(value) >= 8}, key=len, reverse=True)


def redact_secrets(exc: GatewayError, backend: Backend) -> None:
    """Blank `backend`'s credentials in an error the client will see. A vendor's message reaches the
    client as the vendor wrote it, and some echo what they were sent (a proxy its `Authorization`, an
    API its whole request URL, `?key=` included)."""
    for secret in backend_secrets(backend):
        if secret in exc.message:
            exc.message = exc.message.replace(secret, REDACTED)
            exc.args = (exc.message,)


def _cut_usage(decoder: StreamDecoder, estimate: Usage) -> Usage:
    """What a stream cut before its usage report is billed: the output estimated from what arrived,
    and the prompt as the vendor had already counted it where it had (Anthropic's message_start,
    Gemini's running usageMetadata), cache reads and writes included. Estimated from the body's size
    instead, a prompt read from the cache was billed at the full input price, and a cache write (which
    costs more) at it too: a failover's cut attempt on a long cached prompt cost ten times too much.
    The reasoning is the vendor's running count where it gave one (Gemini's), else the estimate's.
    The tier is the one the stream said it was served at where it said so before its usage report
    (OpenAI's `service_tier`, in every chunk: `auto` served at `priority`), else the estimate's (the
    tier asked for)."""
    served = getattr(decoder, "served_tier", None)  # optional: only OpenAI says so in every chunk
    if served is not None:
        estimate = msgspec.structs.replace(estimate, service_tier=served)
    partial = getattr(decoder, "partial_usage", None)  # optional: OpenAI reports usage only at the end
    reported = partial() if partial is not None else None
    if reported is None or reported.prompt_tokens == 0:
        return estimate
    output = max(reported.output_tokens, estimate.output_tokens)
    if reported.reasoning_tokens:
        return msgspec.structs.replace(reported, output_tokens=output)
    return msgspec.structs.replace(
        reported,
        output_tokens=output,
        reasoning_tokens=estimate.reasoning_tokens,
        reasoning_estimated=estimate.reasoning_estimated,
    )


def decode(step: Callable[..., T], backend: str, *args: Any) -> T:
    """Run a provider's decoding step; a body or event of a shape it did not expect (JSON `null`
    where an object belongs, a list for a string, JSON nested thousands deep...) is the backend's
    fault: a 502, never a crash."""
    try:
        return step(*args)
    except GatewayError:
        raise
    except (AttributeError, TypeError, KeyError, IndexError, ValueError, RecursionError) as exc:
        # The client gets words that stay the same across releases; the operator, what broke where
        # (the innermost frame: the decoder's line that choked, or a bug in it).
        innermost = traceback.extract_tb(exc.__traceback__, limit=-1)
        where = f"{innermost[0].filename}:{innermost[0].lineno}" if innermost else None
        log.warning("upstream_response_malformed", backend=backend, error=describe(exc)[:200], at=where)
        raise BadGateway(f"backend {backend} sent a malformed response") from None


async def _read_within(reading: asyncio.Task[bytes], seconds: float) -> bytes | None:
    """What `reading` read, if it ends within `seconds`; else None, and the read is cancelled (ending,
    it lets its connection go: the vendor stops sending). Its attempt was cancelled already, so
    cancellations meanwhile do not cut the wait short: it is bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not reading.done():
        left = deadline - loop.time()
        if left <= 0:
            reading.cancel()  # done within the next step
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({reading}, timeout=left if left > 0 else None)
    if reading.cancelled() or reading.exception() is not None:
        return None
    return reading.result()


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def _empty() -> AsyncIterator[Any]:
    return
    yield
