"""The batch writer: drains the usage queue into the ledger, many events per INSERT.

Each batch is one transaction: insert the events (a repeated event id is skipped), add the newly
inserted ones to the daily rollups, commit, and only then acknowledge them in the queue. If the DB is
down the batch is kept and retried with backoff; the queue keeps growing meanwhile, the gateway keeps
serving, and when the DB returns every event lands once. If the DB refuses the batch for its data
(`deadletter.refusal`), the batch is split in halves, each written on its own, down to the events it
refuses, which are set aside in the dead-letter file (`deadletter.DeadLetters`) before the batch is
acknowledged: one bad event no longer stops the ledger for every tenant. A queued line that is no
event at all (`events.Unreadable`: torn, or a shape this version cannot read) is set aside there too,
as its raw text, before it is acknowledged: it used to be logged and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import math
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
from sqlalchemy import Table, TextClause, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.accounting.deadletter import DEAD_LETTER_FILE, DeadLetters, Refused, error_text, refusal
from gateway.accounting.events import (
    CANCELLED,
    STARTS_CLIENT_REQUEST_SQL,
    Unreadable,
    UsageEvent,
    decode,
    decode_or_unreadable,
    encode,
    is_error,
    starts_client_request,
)
from gateway.accounting.queue import RedisStreamQueue, SpoolQueue, Token, UsageQueue
from gateway.aio import stop_if_cancelled
from gateway.db.models import UsageEventRow, UsageRollup, UsageRouteRollup
from gateway.usage import TOKEN_FIELDS

log = logging.getLogger(__name__)

EVENTS: Table = UsageEventRow.__table__  # type: ignore[assignment]
ROLLUPS: Table = UsageRollup.__table__  # type: ignore[assignment]
ROUTE_ROLLUPS: Table = UsageRouteRollup.__table__  # type: ignore[assignment]
ROLLUP_GROUP = ("day", "tenant_id", "key_id", "backend", "model")  # the rollups' unique key
ROUTE_ROLLUP_GROUP = (*ROLLUP_GROUP, "route")  # the route rollups'
# What each rollup row sums: counts of attempts (all; failed; cancelled, 499s, which are no error) and of
# the client requests that started in the group (their first attempts, not Weir's own calls:
# `events.starts_client_request`), then the events' own amounts.
COUNTS = ("requests", "errors", "cancelled", "client_requests")
AMOUNTS = (*TOKEN_FIELDS, "cost_pico_usd", "savings_pico_usd")
SUMMED = (*COUNTS, *AMOUNTS)
# SQLite allows 32766 bound parameters per statement; usage_events has 29 columns.
MAX_ROWS_PER_INSERT = 1000
OUTAGE_REMINDER_S = 60.0  # how often a database outage the writer is waiting out is logged again
_json = msgspec.json.Encoder()


def event_row(event: UsageEvent) -> dict[str, Any]:
    u = event.usage
    return {
        "event_id": event.event_id,
        "request_id": event.request_id,
        "exchange_id": event.exchange_id,
        "attempt": event.attempt,
        "ts": event.ts,
        "day": event.ts.date(),
        "tenant_id": event.tenant_id,
        "key_id": event.key_id,
        "route": event.route,
        "backend": event.backend,
        "model": event.model,
        "input_tokens": u.input_tokens,
        "cached_input_tokens": u.cached_input_tokens,
        "cache_write_5m_tokens": u.cache_write_5m_tokens,
        "cache_write_1h_tokens": u.cache_write_1h_tokens,
        "output_tokens": u.output_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "web_search_requests": u.web_search_requests,
        "service_tier": u.service_tier,
        "prices": event.prices,
        "cost_pico_usd": event.cost_pico_usd,
        "savings_pico_usd": event.savings_pico_usd,
        "latency_ms": event.latency_ms,
        "ttft_ms": event.ttft_ms,
        "status": event.status,
        "fallback": event.fallback,
        "estimated": event.estimated,
        "routing": event.routing[:1000] if event.routing else None,
        "purpose": event.purpose,
    }


@functools.cache
def _unnest_insert(names: tuple[str, ...]) -> TextClause:
    """PostgreSQL: the whole batch as one array per column, unnested into rows by the server. One
    small prepared statement whatever the batch size, and asyncpg encodes the arrays natively,
    instead of SQLAlchemy processing every value of a multi-row VALUES list in Python."""
    dialect = postgresql.dialect()
    arrays = ", ".join(f"CAST(:{n} AS {EVENTS.c[n].type.compile(dialect=dialect)}[])" for n in names)
    return text(
        f"INSERT INTO {EVENTS.name} ({', '.join(names)}) SELECT * FROM unnest({arrays}) "
        "ON CONFLICT (event_id) DO NOTHING RETURNING event_id"
    )


# Each JSON field of an encoded UsageEvent (`events.encode`) as its column; fields an older encoding
# may lack take the UsageEvent's defaults, as decoding it would.
_LINE_COLUMNS = {
    "event_id": "e->>'event_id'",
    "request_id": "e->>'request_id'",
    "exchange_id": "e->>'exchange_id'",
    "attempt": "(e->>'attempt')::int",
    "ts": "(e->>'ts')::timestamptz",
    # The date as written (in the time's own offset, as `ts.date()` gives it).
    "day": "substr(e->>'ts', 1, 10)::date",
    "tenant_id": "e->>'tenant_id'",
    "key_id": "e->>'key_id'",
    "route": "e->>'route'",
    "backend": "e->>'backend'",
    "model": "e->>'model'",
    **{name: f"coalesce((e->'usage'->>'{name}')::bigint, 0)" for name in TOKEN_FIELDS},
    "service_tier": "e->'usage'->>'service_tier'",
    "prices": "e->'prices'",
    "cost_pico_usd": "(e->>'cost_pico_usd')::bigint",
    "savings_pico_usd": "coalesce((e->>'savings_pico_usd')::bigint, 0)",
    "latency_ms": "coalesce((e->>'latency_ms')::float8, 0)",
    "ttft_ms": "(e->>'ttft_ms')::float8",
    "status": "coalesce((e->>'status')::int, 200)",
    "fallback": "coalesce((e->>'fallback')::boolean, false)",
    "estimated": "coalesce((e->>'estimated')::boolean, false)",
    "routing": "left(e->>'routing', 1000)",
    "purpose": "e->>'purpose'",
}


@functools.cache
def _lines_insert() -> TextClause:
    """PostgreSQL: a batch of encoded events (the queue's JSON lines, as they came) inserted and added
    to the rollups by the server, in one statement. The client neither decodes the events nor builds
    rows or rollups: per event it only joins bytes. The count of new events comes back (no row when
    none was new)."""
    names = list(_LINE_COLUMNS)
    group = ", ".join(ROLLUP_GROUP)
    route_group = ", ".join(ROUTE_ROLLUP_GROUP)
    return text(
        f"WITH inserted AS (INSERT INTO {EVENTS.name} ({', '.join(names)}) "
        f"SELECT {', '.join(_LINE_COLUMNS.values())} FROM jsonb_array_elements(CAST(:rows AS jsonb)) AS e "
        "ON CONFLICT (event_id) DO NOTHING "
        f"RETURNING day, tenant_id, key_id, backend, model, route, status, attempt, purpose, "
        f"{', '.join(AMOUNTS)}), "
        # The new events' sums per route, added to the route rollups, then per group to the rollups.
        f"by_route AS (SELECT day, coalesce(tenant_id, '') AS tenant_id, coalesce(key_id, '') AS key_id, "
        "backend, model, route, count(*) AS requests, "
        f"count(*) FILTER (WHERE (status < 200 OR status >= 400) AND status <> {CANCELLED}) AS errors, "
        f"count(*) FILTER (WHERE status = {CANCELLED}) AS cancelled, "
        f"count(*) FILTER (WHERE {STARTS_CLIENT_REQUEST_SQL}) AS client_requests, "
        f"{', '.join(f'sum({n}) AS {n}' for n in AMOUNTS)} FROM inserted GROUP BY 1, 2, 3, 4, 5, 6), "
        f"routes AS (INSERT INTO {ROUTE_ROLLUPS.name} ({route_group}, {', '.join(SUMMED)}) "
        f"SELECT {route_group}, {', '.join(SUMMED)} FROM by_route ORDER BY {route_group} "
        f"ON CONFLICT ({route_group}) DO UPDATE SET "
        f"{', '.join(f'{n} = {ROUTE_ROLLUPS.name}.{n} + excluded.{n}' for n in SUMMED)}) "
        f"INSERT INTO {ROLLUPS.name} ({group}, {', '.join(SUMMED)}) "
        f"SELECT {group}, {', '.join(f'sum({n})' for n in SUMMED)} FROM by_route GROUP BY 1, 2, 3, 4, 5 "
        f"ORDER BY {group} "  # one lock order for every replica (`_sum_rollups`)
        f"ON CONFLICT ({group}) DO UPDATE SET "
        f"{', '.join(f'{n} = {ROLLUPS.name}.{n} + excluded.{n}' for n in SUMMED)} "
        "RETURNING (SELECT count(*) FROM inserted)"
    )


def _finite(event: UsageEvent) -> bool:
    # JSON has no NaN or infinity (msgspec writes null): such an event takes the array path.
    return math.isfinite(event.latency_ms) and (event.ttft_ms is None or math.isfinite(event.ttft_ms))


# The columns of `event_row`, in its order.
EVENT_COLUMNS = (
    "event_id",
    "request_id",
    "exchange_id",
    "attempt",
    "ts",
    "day",
    "tenant_id",
    "key_id",
    "route",
    "backend",
    "model",
    *TOKEN_FIELDS,
    "service_tier",
    "prices",
    "cost_pico_usd",
    "savings_pico_usd",
    "latency_ms",
    "ttft_ms",
    "status",
    "fallback",
    "estimated",
    "routing",
    "purpose",
)
_token_counts = operator.attrgetter(*TOKEN_FIELDS)


def _sqlite_params(events: list[UsageEvent]) -> list[Any]:
    """Every event's `event_row` values in EVENT_COLUMNS order, one flat list, as SQLAlchemy's SQLite
    types store them (UTCDateTime: UTC text with microseconds; Date: ISO text; JSON: text), without
    a dict or a call per value."""
    params: list[Any] = []
    prices_of: dict[str, int] | None = None
    prices_text = ""
    for e in events:
        ts = e.ts
        if ts.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        # Most events of a batch have the same prices: encoded once. Compared by value, not
        # identity: events decoded from the spool each come with a dict of their own.
        if e.prices is not prices_of and e.prices != prices_of:
            prices_of, prices_text = e.prices, _json.encode(e.prices).decode()
        params += (
            e.event_id,
            e.request_id,
            e.exchange_id,
            e.attempt,
            ts.astimezone(dt.UTC).replace(tzinfo=None).isoformat(" ", "microseconds"),
            ts.date().isoformat(),
            e.tenant_id,
            e.key_id,
            e.route,
            e.backend,
            e.model,
            *_token_counts(e.usage),
            e.usage.service_tier,
            prices_text,
            e.cost_pico_usd,
            e.savings_pico_usd,
            e.latency_ms,
            e.ttft_ms,
            e.status,
            e.fallback,
            e.estimated,
            e.routing[:1000] if e.routing else None,
            e.purpose,
        )
    return params


# One attempt as the rollups count it: its group (day, tenant, key, backend, model, route), its status,
# whether it starts a client request (`events.starts_client_request`), and its `AMOUNTS`, in that order.
_Counted = tuple[dt.date, str | None, str | None, str, str, str, int, bool, Iterable[int]]
# The rows of both rollup tables: (usage_rollups', usage_route_rollups').
_Rollups = tuple[list[dict[str, Any]], list[dict[str, Any]]]


def _sum_rollups(attempts: Iterable[_Counted]) -> _Rollups:
    """The rollup rows of these attempts: `SUMMED` per group, a missing tenant or key as "" (the
    rollups' unique key must hold for anonymous traffic), per route for the route rollups and over
    the routes for the rollups. The one count of both writer paths."""
    totals: dict[tuple[Any, ...], list[int]] = {}
    for day, tenant, key, backend, model, route, status, starts_request, amounts in attempts:
        group = (day, tenant or "", key or "", backend, model, route)
        sums = totals.get(group)
        if sums is None:
            sums = totals[group] = [0] * len(SUMMED)
        sums[0] += 1
        if is_error(status):
            sums[1] += 1
        elif status == CANCELLED:
            sums[2] += 1
        if starts_request:
            sums[3] += 1
        for i, value in enumerate(amounts, len(COUNTS)):
            sums[i] += value
    by_group: dict[tuple[Any, ...], list[int]] = {}
    for group, sums in totals.items():
        into = by_group.get(group[:-1])
        if into is None:
            by_group[group[:-1]] = list(sums)
        else:
            for i, value in enumerate(sums):
                into[i] += value
    # In the rollup key's order: replicas upserting the same rows lock them in one order, so one
    # waits for the other; in event order, two batches deadlocked (PostgreSQL aborted one, 40P01).
    return (
        [
            {**dict(zip(ROLLUP_GROUP, g, strict=True)), **dict(zip(SUMMED, sums, strict=True))}
            for g, sums in sorted(by_group.items())
        ],
        [
            {**dict(zip(ROUTE_ROLLUP_GROUP, g, strict=True)), **dict(zip(SUMMED, sums, strict=True))}
            for g, sums in sorted(totals.items())
        ],
    )


def _event_rollups(events: list[UsageEvent]) -> _Rollups:
    """The rollup rows of these events, read from the events themselves: SQLite's path, which builds
    no ledger row (`_sqlite_params`)."""
    return _sum_rollups(
        (
            e.ts.date(),
            e.tenant_id,
            e.key_id,
            e.backend,
            e.model,
            e.route,
            e.status,
            starts_client_request(e.attempt, e.purpose),
            (*_token_counts(e.usage), e.cost_pico_usd, e.savings_pico_usd),
        )
        for e in events
    )


@functools.lru_cache(maxsize=8)  # batch sizes vary; a few statements of up to ~100 kB each
def _sqlite_insert(names: tuple[str, ...], rows: int) -> str:
    one = "(" + ", ".join("?" * len(names)) + ")"
    return (
        f"INSERT INTO {EVENTS.name} ({', '.join(names)}) VALUES {', '.join([one] * rows)} "
        "ON CONFLICT (event_id) DO NOTHING RETURNING event_id"
    )


def _rollup_rows(rows: list[dict[str, Any]]) -> _Rollups:
    """The rollup rows of these ledger rows (`event_row`): the path that builds them."""
    return _sum_rollups(
        (
            r["day"],
            r["tenant_id"],
            r["key_id"],
            r["backend"],
            r["model"],
            r["route"],
            r["status"],
            starts_client_request(r["attempt"], r["purpose"]),
            [r[name] for name in AMOUNTS],
        )
        for r in rows
    )


@dataclass
class WriterStats:
    batches: int = 0  # committed transactions
    statements: int = 0  # INSERT statements into usage_events
    inserted: int = 0
    duplicates: int = 0  # events already in the ledger (a redelivery), skipped
    failures: int = 0  # batches that failed and were retried
    # events the database refused for their data, and lines that are no event: in the dead-letter file
    set_aside: int = 0
    unreadable: int = 0  # of those, lines that are no event


class BatchWriter:
    def __init__(
        self,
        queue: UsageQueue,
        engine: AsyncEngine,
        # Events per transaction, at most. Each transaction has a fixed cost (commit, WAL sync,
        # rollup upsert, the queue's acknowledgement) of a few ms of CPU on SQLite: 500 events
        # cost ~17 us of CPU each to write, 2,000 ~12.5 us (docs/benchmarks.md).
        batch_size: int = 2000,
        idle_wait_s: float = 0.2,
        max_backoff_s: float = 5.0,
        linger_s: float = 1.0,
        # Where refused events go; by default `DEAD_LETTER_FILE` beside the queue's spool slot (under
        # WEIR_USAGE_SPOOL). None with no spool either: a refused batch is retried as any failure.
        dead_letter: str | Path | None = None,
    ) -> None:
        self.queue = queue
        self.engine = engine
        self.batch_size = batch_size
        self.idle_wait_s = idle_wait_s
        self.max_backoff_s = max_backoff_s
        self.linger_s = linger_s
        self.stats = WriterStats()
        self._pending: list[tuple[Token, Any]] = []  # (token, event), or (token, line) read as lines
        self._insert_events, self._upsert_rollups, self._upsert_route_rollups = self._statements(
            engine.dialect.name
        )
        self._unnest = engine.dialect.name == "postgresql" and engine.dialect.driver == "asyncpg"
        self._raw_sqlite = engine.dialect.name == "sqlite" and engine.dialect.driver == "aiosqlite"
        self._task: asyncio.Task[None] | None = None
        # PostgreSQL and a queue that hands out encoded lines: the lines go to the server as they are.
        self._read_lines = queue.read_lines if self._unnest and isinstance(queue, RedisStreamQueue) else None
        if dead_letter is None:
            spool = queue if isinstance(queue, SpoolQueue) else getattr(queue, "spool", None)
            dead_letter = spool.directory.parent / DEAD_LETTER_FILE if spool is not None else None
        self.dead_letters = DeadLetters(dead_letter) if dead_letter is not None else None

    @staticmethod
    def _statements(dialect: str) -> tuple[Any, Any, Any]:
        insert = (postgresql if dialect == "postgresql" else sqlite).insert  # these know ON CONFLICT
        events = (
            insert(EVENTS).on_conflict_do_nothing(index_elements=["event_id"]).returning(EVENTS.c.event_id)
        )
        upserts = []
        for table, group in ((ROLLUPS, ROLLUP_GROUP), (ROUTE_ROLLUPS, ROUTE_ROLLUP_GROUP)):
            upsert = insert(table)
            upserts.append(
                upsert.on_conflict_do_update(
                    index_elements=list(group),
                    set_={name: table.c[name] + upsert.excluded[name] for name in SUMMED},
                )
            )
        return events, upserts[0], upserts[1]

    async def write_lines(self, lines: list[bytes]) -> int:
        """Insert a batch of encoded events (`events.encode`) in one transaction; returns how many
        were new. On PostgreSQL the server unpacks them; elsewhere they are decoded and written."""
        if not self._unnest:
            return await self.write([decode(line) for line in lines])
        async with self.engine.begin() as conn:
            result = await conn.execute(_lines_insert(), {"rows": "[" + b",".join(lines).decode() + "]"})
            new = result.scalar() or 0
        self.stats.statements += 1
        self.stats.batches += 1
        self.stats.inserted += new
        self.stats.duplicates += len(lines) - new
        return new

    async def _write_lines_or_set_aside(self, lines: list[bytes]) -> None:
        try:
            await self.write_lines(lines)
        except DBAPIError as exc:
            # A refusal of the data (`refusal`): a line the server cannot read as an event (a torn
            # spool line forwarded to the stream), or an event it will not store. Write the readable
            # events and set aside those refused and the unreadable lines, instead of retrying the
            # batch forever. Anything else (the DB away) is retried as it is.
            if refusal(exc) is None:
                raise
            await self._write_or_set_aside([decode_or_unreadable(line) for line in lines])

    async def _write_or_set_aside(self, items: list[UsageEvent | Unreadable]) -> None:
        """`write` the batch's events; if the database refuses them for their data, write what it
        takes and set the events it refuses aside (`set_aside`), and the lines that are no event
        (`set_aside_unreadable`), durably, before the caller acknowledges them."""
        events = [item for item in items if isinstance(item, UsageEvent)]
        unreadable = [item for item in items if isinstance(item, Unreadable)]
        if self.dead_letters is None:
            if events:
                await self.write(events)
        else:
            _, refused = await self.write_what_is_taken(events) if events else (0, [])
            if refused:
                self.set_aside(refused)
        if unreadable:
            self.set_aside_unreadable(unreadable)

    async def write_what_is_taken(self, events: list[UsageEvent]) -> tuple[int, list[Refused]]:
        """`write` the batch; refused for its data (`refusal`), write each half on its own, and so on
        down to the events refused on their own: the count written and those refused. Each part is a
        transaction of its own that adds only its newly inserted events to the rollups, so a batch
        retried after some parts committed (the database went away meanwhile) counts them once.
        One bad event in 2,000 costs about 22 transactions. Anything but a refusal is raised."""
        try:
            return await self.write(events), []
        except Exception as exc:
            reason = refusal(exc)
            if reason is None:
                raise
            if len(events) == 1:
                return 0, [Refused(events[0], reason, error_text(exc))]
        half = len(events) // 2
        first, refused_first = await self.write_what_is_taken(events[:half])
        second, refused_second = await self.write_what_is_taken(events[half:])
        return first + second, refused_first + refused_second

    def set_aside(self, refused: list[Refused]) -> None:
        """Append refused events to the dead-letter file (synced), then log each: its id, tenant and
        the database's error class. Raises if the file cannot take them: the batch is then retried."""
        assert self.dead_letters is not None
        self.dead_letters.add(refused)
        self.stats.set_aside += len(refused)
        for r in refused:
            named = r.error.split(":", 1)[0]
            log.error(
                "usage event %s of tenant %s set aside in %s: the database refused it (%s)",
                r.event.event_id,
                r.event.tenant_id,
                self.dead_letters.path,
                r.reason if named == r.reason else f"{r.reason} {named}",
            )

    def set_aside_unreadable(self, lines: list[Unreadable]) -> None:
        """Append lines that are no event to the dead-letter file as text (synced), then log each
        (its start and why). Raises if the file cannot take them: the batch is then retried. With no
        dead-letter file (no spool) they are only logged."""
        if self.dead_letters is not None:
            self.dead_letters.add_unreadable(lines)
            self.stats.set_aside += len(lines)
            self.stats.unreadable += len(lines)
        where = f"set aside in {self.dead_letters.path}" if self.dead_letters is not None else "dropped"
        for u in lines:
            log.error("unreadable usage event %r %s (%s)", u.line[:200], where, u.error)

    async def write(self, events: list[UsageEvent]) -> int:
        """Insert a batch in one transaction; returns how many were new."""
        if self._unnest and all(_finite(e) for e in events):
            return await self.write_lines([encode(e) for e in events])
        if self._raw_sqlite:
            return await self._write_sqlite(events)
        rows = [event_row(e) for e in events]
        new_ids: set[str] = set()
        async with self.engine.begin() as conn:
            # executemany of one cached statement: SQLAlchemy's "insertmanyvalues" sends it as
            # multi-row INSERTs with RETURNING, without compiling a new statement per batch size.
            if self._unnest:  # only batches with a NaN or infinite time (JSON has neither)
                names = tuple(rows[0])
                columns = {n: [r[n] for r in rows] for n in names}
                columns["prices"] = [_json.encode(p).decode() for p in columns["prices"]]
                new_ids.update((await conn.execute(_unnest_insert(names), columns)).scalars())
                self.stats.statements += 1
            for start in range(0, 0 if self._unnest else len(rows), MAX_ROWS_PER_INSERT):
                chunk = rows[start : start + MAX_ROWS_PER_INSERT]
                new_ids.update((await conn.execute(self._insert_events, chunk)).scalars())
                self.stats.statements += 1
            # One row per new event: a batch may hold an event twice, which the ledger stores once.
            fresh = {r["event_id"]: r for r in rows if r["event_id"] in new_ids}
            await self._add_to_rollups(conn, _rollup_rows(list(fresh.values())))
        self.stats.batches += 1
        self.stats.inserted += len(new_ids)
        self.stats.duplicates += len(rows) - len(new_ids)
        return len(new_ids)

    async def _add_to_rollups(self, conn: Any, rollups: _Rollups) -> None:
        """Add the new events' sums to both rollup tables, in the transaction that inserted them."""
        by_group, by_route = rollups
        if by_group:
            await conn.execute(self._upsert_rollups, by_group)
            await conn.execute(self._upsert_route_rollups, by_route)

    async def _write_sqlite(self, events: list[UsageEvent]) -> int:
        """SQLite: the same multi-row INSERT ... RETURNING that SQLAlchemy would send, run on the
        driver's connection (inside the transaction) with each event's values as its column types
        store them (`_sqlite_params`), and the rollups summed from the new events: SQLAlchemy's
        processing of every value, then row dicts, were most of the writer's CPU."""
        if not events:
            return 0
        new_ids: set[str] = set()
        async with self.engine.begin() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            for start in range(0, len(events), MAX_ROWS_PER_INSERT):
                chunk = events[start : start + MAX_ROWS_PER_INSERT]
                statement = _sqlite_insert(EVENT_COLUMNS, len(chunk))
                async with driver.execute(statement, _sqlite_params(chunk)) as cursor:  # type: ignore[union-attr]
                    new_ids.update([r[0] for r in await cursor.fetchall()])
                self.stats.statements += 1
            if len(new_ids) == len(events):
                fresh = events
            else:  # one per new event: a batch may hold an event twice, which the ledger stores once
                fresh = list({e.event_id: e for e in events if e.event_id in new_ids}.values())
            await self._add_to_rollups(conn, _event_rollups(fresh))
        self.stats.batches += 1
        self.stats.inserted += len(new_ids)
        self.stats.duplicates += len(events) - len(new_ids)
        return len(new_ids)

    async def step(self, block_s: float | None = None) -> int:
        """Write at most one batch: the one that failed last time, else a fresh one from the queue.

        Raises whatever the DB raised; the batch is kept for the next call.
        """
        if not self._pending:
            wait = self.idle_wait_s if block_s is None else block_s
            read = self._read_lines or self.queue.read
            # Lines or events, whichever `read` gives: below, `_read_lines` tells which.
            self._pending = cast("list[tuple[Token, Any]]", await read(self.batch_size, wait))
        if not self._pending:
            return 0
        try:
            if self._read_lines is not None:
                await self._write_lines_or_set_aside([line for _, line in self._pending])
            else:
                await self._write_or_set_aside([event for _, event in self._pending])
        except Exception:
            self.stats.failures += 1
            raise
        written = len(self._pending)
        await self.queue.ack([token for token, _ in self._pending])
        self._pending = []
        return written

    async def run(self) -> None:
        backoff = 0.1
        # Once per outage, not on every retry: a warning per backoff step for as long as the database
        # was away buried the one that said it went. (start, last logged, failed attempts)
        outage: tuple[float, float, int] | None = None
        while True:
            stop_if_cancelled()  # a cancel that library code swallowed last round
            try:
                written = await self.step()  # after an outage, the batch held through it
                backoff = 0.1
                if outage is not None:
                    log.info(
                        "usage batches written again after %.1fs: the batch held meanwhile (%d rows) "
                        "is in, after %d failed attempts",
                        time.monotonic() - outage[0],
                        written,
                        outage[2],
                    )
                    outage = None
                if self.queue.drained:
                    # Nothing more waiting: let events gather instead of waking (and committing)
                    # for every request under light load.
                    await asyncio.sleep(self.linger_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                now = time.monotonic()
                if outage is None:
                    detail = str(exc).splitlines()[0] if str(exc) else ""
                    log.warning(
                        "usage batch not written (%s); holding it and retrying until it is written",
                        f"{exc.__class__.__name__}: {detail}" if detail else exc.__class__.__name__,
                    )
                    outage = (now, now, 1)
                elif now - outage[1] >= OUTAGE_REMINDER_S:
                    log.warning(
                        "usage batch still not written after %.0fs (%s); %d rows held, retrying",
                        now - outage[0],
                        exc.__class__.__name__,
                        len(self._pending),
                    )
                    outage = (outage[0], now, outage[2] + 1)
                else:
                    outage = (outage[0], outage[1], outage[2] + 1)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="usage-batch-writer")

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Write everything queued now (shutdown, tests); gives up quietly after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while await self.step(block_s=0) or self._pending:
                    pass

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self.queue.reachable:
            # Nothing can be read from a Redis that is away (a hanging one would have the drain wait
            # out its timeout): what it holds is written by the next writer it answers.
            return
        with contextlib.suppress(Exception):
            await self.drain(drain_timeout_s)
