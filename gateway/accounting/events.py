"""The usage event: one per upstream attempt, priced when it happened, identified by `event_id` so the
ledger can take it exactly once however often the queue delivers it."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import msgspec

from gateway.accounting.money import pico_to_usd
from gateway.ids import ordered_id
from gateway.usage import Usage

# An attempt's status when the gateway cancelled it (a hedge race's loser) or its client left. It is
# neither an answer nor a failure of its backend: the reports count it apart, never as an error.
CANCELLED = 499


def is_error(status: int) -> bool:
    """Whether an attempt with this status failed: not answered (2xx/3xx), and not cancelled."""
    return not 200 <= status < 400 and status != CANCELLED


# The number of a request's first upstream attempt: each request (a plan of the executor, a comparison's
# call) has exactly one in the ledger, the one admission let through (a refused try is no attempt and
# gives its number back), however many retries, failovers and hedges follow it (2, 3...). The rollups
# and reports count client requests as their first attempts: once, in that attempt's group.
FIRST_ATTEMPT = 1


def starts_client_request(attempt: int, purpose: str | None) -> bool:
    """Whether an attempt is a client request's first: the one the reports count that request by. A
    call Weir makes of its own (`purpose`: a comparison's other answer or its judge) is an attempt,
    and costs, but no client asked for it. The SQL that counts them says the same
    (`STARTS_CLIENT_REQUEST_SQL`; migration 0015 keeps its own copy)."""
    return attempt == FIRST_ATTEMPT and purpose is None


# `starts_client_request` in SQL over the ledger's columns (the writer's PostgreSQL statement, the
# reports). With an answer's test (2xx/3xx; a 499 is none), the predicates of the ledger's two partial
# indexes that the uptime report reads (gateway/db/models.py): a client request's first attempt that
# did not answer, and a later attempt that did. Literals, not bound parameters: a query's WHERE must
# say the index's predicate for either database to use the index.
STARTS_CLIENT_REQUEST_SQL = f"attempt = {FIRST_ATTEMPT} AND purpose IS NULL"
UNANSWERED_START_SQL = f"{STARTS_CLIENT_REQUEST_SQL} AND (status < 200 OR status >= 400)"
ANSWERED_RETRY_SQL = f"attempt > {FIRST_ATTEMPT} AND status >= 200 AND status < 400"


# gc=False: the collector never tracks an event. It holds no reference that could lead back to it
# (text, numbers, a datetime, a Usage, a dict of ints), so it can never be part of a cycle. One is
# made per attempt, and the batch writer decodes thousands at a time: tracked, every decoded batch
# set off young collections that walked it (decoding 500 lines cost ~6 us per event, untracked ~1).
class UsageEvent(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    request_id: str
    # The gateway's own id of the exchange when `request_id` is a client's x-request-id (which may name
    # other requests too); None when `request_id` is the gateway's own (`pipeline.RequestInfo`).
    exchange_id: str | None = None
    attempt: int  # 1 for the first upstream attempt of a request, 2 for its first retry or fallback...
    ts: dt.datetime  # when the attempt started (UTC); prices valid at this moment apply
    tenant_id: str | None
    key_id: str | None
    route: str  # the public model name the client asked for
    backend: str
    model: str  # the upstream model id
    usage: Usage
    prices: dict[str, int]  # token class -> micro-USD per 1M tokens applied
    cost_pico_usd: int
    savings_pico_usd: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    status: int = 200  # HTTP status of the attempt; 0 when the backend never answered
    # Why the attempt failed (its error type: `cancelled` when the router ended it, a hedge race's
    # loser; `client_disconnected`; `upstream_error`...); None when it answered. Not in the ledger:
    # routing reads it (`routing.stats`), to tell what a 499 says about the backend's speed.
    error: str | None = None
    stream: bool = False  # a streamed attempt: its answer starts at its first token (`ttft_ms`)
    # A stream that sent reasoning text (`gateway.types.streams_reasoning`): the reasoning tokens its
    # usage reports came after its first token, not hidden before it. Not in the ledger: routing
    # reads it (`routing.stats`, decode speed).
    reasoning_streamed: bool = False
    fallback: bool = False  # on another model than the request's first attempt (a retry is none)
    routing: str | None = None  # the routing decision so far (policy, candidate, score; x-weir-route)
    estimated: bool = False  # usage estimated by the gateway: the stream ended before the vendor's report
    # Why Weir itself made this call, None for a client's request: `compare` (a comparison's other
    # answer) or `judge` (routing/compare.py). Counted as attempts and billed, never as client requests.
    purpose: str | None = None
    event_id: str = msgspec.field(default_factory=ordered_id)  # time-ordered (gateway/ids.py)

    @property
    def cost_usd(self) -> Decimal:
        return pico_to_usd(self.cost_pico_usd)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 400


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(UsageEvent)


def encode(event: UsageEvent) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> UsageEvent:
    return _decoder.decode(data)


class Unreadable(msgspec.Struct, frozen=True):
    """A queued line that is no usage event: torn by a crash mid-write, or an event shape this version
    cannot read. The queue hands it on in the event's place, so the writer sets it aside (the
    dead-letter file) before the line is acknowledged, instead of dropping it."""

    line: bytes
    error: str  # why it could not be read: msgspec's error class and message


def decode_or_unreadable(data: bytes) -> UsageEvent | Unreadable:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError too
        return Unreadable(data, f"{exc.__class__.__name__}: {exc}")
