"""The usage pipeline: events queue durably (spool file or Redis stream), the batch writer lands them
in batches, a DB outage loses nothing, and redelivery never writes an event twice."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.accounting.deadletter import DeadLetters, Refused, read_dead_letters, replay
from gateway.accounting.events import Unreadable, UsageEvent, decode, encode
from gateway.accounting.queue import RedisStreamQueue, SpoolQueue, UsageQueue
from gateway.accounting.writer import ROLLUP_GROUP, ROUTE_ROLLUP_GROUP, BatchWriter, _rollup_rows, event_row
from gateway.db import migrate
from gateway.db.models import UsageEventRow, UsageRollup, UsageRouteRollup
from gateway.db.session import create_engine
from gateway.metrics import Metrics
from gateway.usage import normalise_usage
from tests.control.events import random_events
from tests.control.helpers import TcpProxy
from tests.fixtures.db import REDIS_URL, migrated_sqlite, premigrated, sync_exec
from weir.cli import main

CANCELLED = 499  # a hedge that lost, an attempt whose client left


@pytest.fixture(params=["spool", pytest.param("redis", marks=pytest.mark.redis)])
async def queue(
    request: pytest.FixtureRequest, tmp_path: Path, redis_prefix: str
) -> AsyncIterator[UsageQueue]:
    if request.param == "spool":
        q: UsageQueue = SpoolQueue(tmp_path / "spool")
    else:
        q = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    yield q
    await q.close()


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate.upgrade_async(premigrated(db_url))
    e = create_engine(db_url)
    yield e
    await e.dispose()


async def ledger(engine: AsyncEngine) -> tuple[int, int, int]:
    async with engine.connect() as conn:
        count, cost = (await conn.execute(select(func.count(), func.sum(UsageEventRow.cost_pico_usd)))).one()
        rollup_cost = (await conn.execute(select(func.sum(UsageRollup.cost_pico_usd)))).scalar()
    return count, int(cost or 0), int(rollup_cost or 0)


async def put_all(queue: UsageQueue, batch: list) -> None:
    for event in batch:
        queue.put(event)
    if isinstance(queue, RedisStreamQueue):
        await queue.flush()


async def test_events_land_in_batches_with_rollups(queue: UsageQueue, engine: AsyncEngine) -> None:
    batch = random_events(1200)
    await put_all(queue, batch)
    writer = BatchWriter(queue, engine, batch_size=500)
    await writer.drain()
    count, cost, rollup_cost = await ledger(engine)
    assert count == 1200
    assert cost == rollup_cost == sum(e.cost_pico_usd for e in batch)
    # 1200 events in at most 3 transactions (the stream reads whole entries of up to 200 events, so
    # its batches can be larger): never one write per request.
    assert 1 <= writer.stats.batches <= 3 and writer.stats.statements >= writer.stats.batches
    async with engine.connect() as conn:
        requests, errors = (
            await conn.execute(select(func.sum(UsageRollup.requests), func.sum(UsageRollup.errors)))
        ).one()
    assert int(requests) == 1200 and int(errors) == sum(e.status == 502 for e in batch)


@pytest.mark.postgres
async def test_db_outage_loses_nothing_and_writes_once(queue: UsageQueue, pg_url: str) -> None:
    await migrate.upgrade_async(pg_url)
    real_port = make_url(pg_url).port or 5432
    proxy = TcpProxy(real_port)
    await proxy.start()
    engine = create_engine(make_url(pg_url).set(port=proxy.port).render_as_string(hide_password=False))
    writer = BatchWriter(queue, engine, batch_size=100)
    first = random_events(150, seed=2)
    await put_all(queue, first)
    await writer.drain()
    assert (await ledger(engine))[0] == 150

    await proxy.stop()  # the database goes away
    second = random_events(250, seed=3)
    await put_all(queue, second)  # the request path keeps queueing: no DB involved
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises for a dead server
        await writer.step(block_s=0)
    with pytest.raises(Exception):  # noqa: B017
        await writer.step(block_s=0)
    assert writer.stats.failures == 2
    assert writer.stats.set_aside == 0  # the database away refuses nothing: the batch is held

    await proxy.start()  # and comes back
    await writer.drain()
    count, cost, rollup_cost = await ledger(engine)
    assert count == 400
    assert cost == rollup_cost == sum(e.cost_pico_usd for e in first + second)
    await engine.dispose()
    await proxy.stop()


async def test_redelivery_after_a_crash_is_written_once(tmp_path: Path, engine: AsyncEngine) -> None:
    spool = tmp_path / "spool"
    queue = SpoolQueue(spool)
    batch = random_events(300, seed=4)
    await put_all(queue, batch)
    writer = BatchWriter(queue, engine, batch_size=1000)
    items = await queue.read(1000, 0)
    await writer.write([e for _, e in items])  # committed, then the process dies before the ack
    await queue.close()

    queue = SpoolQueue(spool)  # the restarted gateway reads the spool from the last ack
    writer = BatchWriter(queue, engine, batch_size=1000)
    await writer.drain()
    assert writer.stats.duplicates == 300 and writer.stats.inserted == 0
    count, cost, rollup_cost = await ledger(engine)
    assert count == 300 and cost == rollup_cost == sum(e.cost_pico_usd for e in batch)
    assert queue.pending() == 0
    await queue.close()


@pytest.mark.redis
async def test_stream_entries_of_a_dead_writer_are_taken_over(redis_prefix: str, engine: AsyncEngine) -> None:
    producer = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    await put_all(producer, random_events(50, seed=5))
    dead = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    assert len(await dead.read(100, 0)) == 50  # read, never acknowledged: this replica crashed
    survivor = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix, claim_idle_s=0.05)
    await asyncio.sleep(0.1)
    writer = BatchWriter(survivor, engine)
    await writer.drain()
    assert (await ledger(engine))[0] == 50
    for q in (producer, dead, survivor):
        await q.close()


@pytest.mark.redis
async def test_a_writer_that_stops_leaves_the_group_unless_entries_wait_for_it(redis_prefix: str) -> None:
    """Each process reads as a consumer of its own (`<host>-<pid>-<random>`). One that stops with
    nothing pending takes its consumer out of the group (they stayed: each restart, rollout or
    scaled-out replica added one for ever); one that stops with entries unacknowledged keeps it, with
    them, for another writer to claim."""
    stream = f"{redis_prefix}usage"
    for life in range(3):  # three replica lifetimes, one after the other
        queue = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
        await put_all(queue, random_events(5, seed=life))
        read = await queue.read_lines(100, block_s=0)
        assert len(read) == 5
        await queue.ack([token for token, _ in read])  # all written: nothing pending
        await queue.close()
    async with aioredis.from_url(REDIS_URL) as shared:
        assert await shared.xinfo_consumers(stream, RedisStreamQueue.GROUP) == []

        stopped = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
        await put_all(stopped, random_events(5, seed=3))
        assert len(await stopped.read_lines(100, block_s=0)) == 5  # stopped before writing them
        await stopped.close()
        consumers = await shared.xinfo_consumers(stream, RedisStreamQueue.GROUP)
        assert [c["pending"] for c in consumers] == [1]  # one entry of 5 events
    survivor = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix, claim_idle_s=0)
    assert len(await survivor.read_lines(100, block_s=0)) == 5  # claimed
    await survivor.close()


@pytest.mark.redis
async def test_live_writers_remove_the_consumers_of_crashed_replicas(redis_prefix: str) -> None:
    """A crashed replica never runs `close`, so its consumer stayed in the group for ever (empty once
    its entries were claimed): one more per crash. Live writers delete every consumer with nothing
    pending that has been idle for `forget_idle_s`; never one with entries pending (they would be
    dropped from the group), nor a live writer's, idle as it may look while nothing new arrives."""
    stream, group = f"{redis_prefix}usage", RedisStreamQueue.GROUP
    writers = [
        RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix, forget_idle_s=0.5)
        for _ in range(2)
    ]
    async with aioredis.from_url(REDIS_URL) as shared:
        await shared.xgroup_create(stream, group, id="0", mkstream=True)
        for event in random_events(3, seed=9):
            await shared.xadd(stream, {"e": encode(event)})

        async def read_one(consumer: str) -> Any:
            reply: Any = await shared.xreadgroup(group, consumer, {stream: ">"}, count=1)
            [[_, [(entry_id, _)]]] = reply
            return entry_id

        crashed_entry = await read_one("crashed")  # read, then the replica crashed
        await read_one("stalled")  # read, not written yet: pending
        [(token, _)] = await writers[1].read_lines(1, block_s=0)
        await writers[1].ack([token])
        # A live writer claims the crashed replica's entry and writes it.
        await shared.xclaim(stream, group, writers[0]._consumer, 0, [crashed_entry])
        await writers[0].ack([crashed_entry])

        async def least_idle_ms(*names: str) -> int:
            consumers = await shared.xinfo_consumers(stream, group)
            return min(c["idle"] for c in consumers if c["name"].decode() in names)

        deadline = asyncio.get_running_loop().time() + 5
        while await least_idle_ms("crashed", "stalled") <= 500:
            assert asyncio.get_running_loop().time() < deadline, "consumers never idle for 0.5 s"
            assert await writers[1].read_lines(1, block_s=0) == []  # a live writer, nothing new
            await asyncio.sleep(0.02)

        assert await writers[0].read_lines(100, block_s=0) == []
        consumers = {c["name"].decode(): c["pending"] for c in await shared.xinfo_consumers(stream, group)}
        assert consumers == {"stalled": 1, writers[0]._consumer: 0, writers[1]._consumer: 0}
    for writer in writers:
        await writer.close()


@pytest.mark.redis
async def test_entries_a_lost_read_had_delivered_are_read_again_at_once(
    redis_prefix: str, engine: AsyncEngine
) -> None:
    """Redis gave a read entries but its reply never came (a timeout): they stayed this consumer's,
    unacknowledged, and waited claim_idle_s (30 s) to be claimed. The next read takes them again at
    once, page by page, then the new ones; the ledger holds each event once."""
    queue = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    batch = random_events(30, seed=8)
    for event in batch:  # an entry each: the lost reads below take ten entries each
        await put_all(queue, [event])
    deliver = queue._redis.xreadgroup

    async def lost(*args: Any, **kwargs: Any) -> Any:
        await deliver(*args, **kwargs)  # Redis delivers the entries to this consumer...
        raise RedisTimeoutError("Timeout reading from Redis")  # ...and its reply never arrives

    writer = BatchWriter(queue, engine, batch_size=100)
    queue._redis.xreadgroup = lost  # type: ignore[method-assign]
    for _ in range(2):
        with pytest.raises(RedisTimeoutError):
            await writer.step(block_s=0)
    queue._redis.xreadgroup = deliver  # type: ignore[method-assign]
    await writer.drain()
    count, cost, rollup_cost = await ledger(engine)
    assert count == 30 and cost == rollup_cost == sum(e.cost_pico_usd for e in batch)
    assert writer.stats.duplicates == 0  # nothing was read twice
    assert (await queue._redis.xpending(f"{redis_prefix}usage", RedisStreamQueue.GROUP))["pending"] == 0
    await queue.close()


async def test_spool_is_one_process_and_skips_torn_lines(tmp_path: Path) -> None:
    queue = SpoolQueue(tmp_path / "spool")
    with pytest.raises(RuntimeError, match="in use"):
        SpoolQueue(tmp_path / "spool")
    await put_all(queue, random_events(3, seed=6))
    await asyncio.sleep(0)  # one event-loop turn: the spool hands its lines to the OS
    segment = next((tmp_path / "spool").glob("*.jsonl"))
    with open(segment, "ab") as f:
        f.write(b'{"request_id": "half-writ')  # a line still being written
    assert len(await queue.read(10, 0)) == 3
    await queue.close()


async def test_spool_pending_counts_lines_without_decoding_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pending()` decoded every spooled line, and held them all at once, only to count them: a spool
    that grew through a long database outage cost a decode per event per call. It counts the whole
    lines past the cursor, over every segment, a torn last line not among them."""
    queue = SpoolQueue(tmp_path / "spool")
    queue.SEGMENT_BYTES = 2000  # a few events per segment
    for event in random_events(30, seed=9):
        queue.put(event)
        await asyncio.sleep(0)  # one event-loop turn: the spool hands the line to the OS
    await queue.ack([token for token, _ in await queue.read(5, 0)])
    segments = sorted((tmp_path / "spool").glob("*.jsonl"))
    assert len(segments) > 3
    with open(segments[-1], "ab") as f:
        f.write(b'{"request_id": "half-writ')  # a line still being written

    def decoded(line: bytes) -> Any:
        raise AssertionError("pending() decoded a line")

    monkeypatch.setattr("gateway.accounting.queue.decode_or_unreadable", decoded)
    assert queue.pending() == 25
    await queue.close()


async def test_a_spool_reopened_after_a_torn_line_keeps_the_next_event_whole(tmp_path: Path) -> None:
    """A crash mid-write leaves a segment ending inside a line. The next process appending to it must
    start on a line of its own: glued to the torn start, its first event read as one line that is no
    event, and went to the dead-letter file with it instead of the ledger."""
    first, second = random_events(2, seed=8)
    queue = SpoolQueue(tmp_path / "spool")
    await put_all(queue, [first])
    await asyncio.sleep(0)
    await queue.close()
    segment = next((tmp_path / "spool").glob("*.jsonl"))
    with open(segment, "ab") as f:
        f.write(b'{"request_id": "half-writ')  # the crash
    queue = SpoolQueue(tmp_path / "spool")  # the restarted process
    await put_all(queue, [second])
    await asyncio.sleep(0)
    read = [item for _, item in await queue.read(10, 0)]
    assert read[0] == first and read[2] == second and len(read) == 3
    assert isinstance(read[1], Unreadable) and read[1].line == b'{"request_id": "half-writ'
    await queue.close()


async def test_every_column_lands_as_sent(engine: AsyncEngine, tmp_path: Path) -> None:
    """PostgreSQL takes batches as arrays unnested by the server, SQLite as multi-row VALUES: both
    must store each event exactly as `event_row` describes it (JSON prices, UTC times, NULLs)."""
    batch = random_events(30, seed=21)
    batch[0] = msgspec.structs.replace(
        batch[0], ttft_ms=None, key_id=None, routing="policy=fixed", estimated=True, exchange_id="e" * 32
    )
    # PostgreSQL gets a batch as JSON: integers past 2**53, floats that print long, text beyond ASCII
    # and a time with another offset must still land exactly.
    batch[1] = msgspec.structs.replace(
        batch[1],
        cost_pico_usd=2**62 + 1,
        latency_ms=0.1 + 0.2,
        ttft_ms=1e-7,
        route='modèle "ü" \\ ✓',
        ts=batch[1].ts.astimezone(dt.timezone(dt.timedelta(hours=-5, minutes=-30))),
    )
    writer = BatchWriter(SpoolQueue(tmp_path / "unused"), engine)
    assert await writer.write(batch) == 30
    assert await writer.write(batch[:5]) == 0  # a redelivery is skipped
    async with engine.connect() as conn:
        stored = {r.event_id: dict(r._mapping) for r in await conn.execute(select(UsageEventRow.__table__))}
    for event in batch:
        assert stored[event.event_id] == event_row(event)
    assert writer.stats.statements == 2 and writer.stats.duplicates == 5


async def test_rollups_hold_every_sum_of_the_events_they_count(engine: AsyncEngine) -> None:
    """PostgreSQL sums the rollups itself (from the encoded events), SQLite in the writer: both must
    match a sum of the events' rows, errors, retries and anonymous keys included, and skip
    redelivered ones."""
    batch = random_events(120, seed=31)
    batch[:10] = [msgspec.structs.replace(e, key_id=None, tenant_id=None) for e in batch[:10]]
    batch[5:25] = [msgspec.structs.replace(e, status=CANCELLED) for e in batch[5:25]]
    # Retries, failovers and hedges: attempts of a request, not requests of their own.
    batch[20:50] = [msgspec.structs.replace(e, attempt=2 + i % 2) for i, e in enumerate(batch[20:50])]
    # Requests by several public names (routes) of one model: the route rollups keep them apart.
    batch = [msgspec.structs.replace(e, route=("auto", "m1", "cheap")[i % 3]) for i, e in enumerate(batch)]
    writer = BatchWriter(SpoolQueue(Path(f"/tmp/unused-{id(engine)}")), engine)
    assert await writer.write(batch[:80]) == 80
    assert await writer.write(batch[40:]) == 40  # half of it a redelivery
    by_group, by_route = _rollup_rows([event_row(e) for e in batch])
    for table, rows, group in (
        (UsageRollup.__table__, by_group, ROLLUP_GROUP),
        (UsageRouteRollup.__table__, by_route, ROUTE_ROLLUP_GROUP),
    ):
        expected = {tuple(r[k] for k in group): r for r in rows}
        async with engine.connect() as conn:
            stored = [dict(r._mapping) for r in await conn.execute(select(table))]
        assert len(stored) == len(expected) > 1
        for row in stored:
            assert {k: row[k] for k in expected[tuple(row[k] for k in group)]} == expected[
                tuple(row[k] for k in group)
            ]
        assert_counts(stored, batch)
    assert {r["route"] for r in by_route} == {"auto", "m1", "cheap"} and len(by_route) > len(by_group)


def assert_counts(stored: list[dict[str, Any]], batch: list) -> None:
    """The rollups' counts: every attempt, the failed ones, and the cancelled ones (499s) apart; and
    the client requests, counted by their first attempts."""
    assert sum(r["requests"] for r in stored) == len(batch)
    assert 0 < sum(r["client_requests"] for r in stored) == sum(e.attempt == 1 for e in batch) < len(batch)
    assert sum(r["cancelled"] for r in stored) == sum(e.status == CANCELLED for e in batch) > 0
    assert sum(r["errors"] for r in stored) == sum(not e.ok and e.status != CANCELLED for e in batch) > 0


@pytest.mark.postgres
async def test_rollups_count_cancelled_attempts_apart_on_postgres_array_path(pg_url: str) -> None:
    """PostgreSQL's other path (a time JSON cannot carry, NaN): the rollups are summed in Weir."""
    await migrate.upgrade_async(pg_url)
    engine = create_engine(pg_url)
    try:
        statuses = [200, 502, CANCELLED, CANCELLED, 0, 200]
        attempts = [1, 1, 2, 1, 1, 3]
        batch = [
            msgspec.structs.replace(e, latency_ms=float("nan"), status=status, attempt=attempt)
            for e, status, attempt in zip(random_events(6, seed=43), statuses, attempts, strict=True)
        ]
        writer = BatchWriter(SpoolQueue(Path(f"/tmp/unused-{id(engine)}")), engine)
        assert await writer.write(batch) == 6
        async with engine.connect() as conn:
            stored = [dict(r._mapping) for r in await conn.execute(select(UsageRollup.__table__))]
        assert_counts(stored, batch)
    finally:
        await engine.dispose()


async def test_weirs_own_calls_are_attempts_not_client_requests(engine: AsyncEngine) -> None:
    """A comparison's calls (routing/compare.py: the other candidate's answer, the judge's verdict) are
    first attempts of requests of their own, which no client made: the rollups counted each as a
    client request. They count as attempts, with their cost; the ledger keeps their `purpose`."""
    await _write_weirs_own_calls(engine, latency_ms=12.5)


@pytest.mark.postgres
async def test_weirs_own_calls_are_attempts_not_client_requests_on_postgres_array_path(pg_url: str) -> None:
    """The same on PostgreSQL's other path (a time JSON cannot carry, NaN: summed in Weir)."""
    await migrate.upgrade_async(pg_url)
    engine = create_engine(pg_url)
    try:
        await _write_weirs_own_calls(engine, latency_ms=float("nan"))
    finally:
        await engine.dispose()


async def _write_weirs_own_calls(engine: AsyncEngine, latency_ms: float) -> None:
    batch = [msgspec.structs.replace(e, latency_ms=latency_ms) for e in random_events(12, seed=51)]
    batch[:4] = [msgspec.structs.replace(e, purpose="compare") for e in batch[:4]]
    batch[4:6] = [msgspec.structs.replace(e, purpose="judge") for e in batch[4:6]]
    batch[6:8] = [msgspec.structs.replace(e, attempt=2) for e in batch[6:8]]  # a client request's retries
    writer = BatchWriter(SpoolQueue(Path(f"/tmp/unused-{id(engine)}")), engine)
    assert await writer.write(batch) == 12
    async with engine.connect() as conn:
        stored = [dict(r._mapping) for r in await conn.execute(select(UsageRollup.__table__))]
        purposes = (
            await conn.execute(select(UsageEventRow.purpose, func.count()).group_by(UsageEventRow.purpose))
        ).tuples()
        assert dict(purposes.all()) == {None: 6, "compare": 4, "judge": 2}
    assert sum(r["requests"] for r in stored) == 12
    assert sum(r["client_requests"] for r in stored) == 4  # the 12 less Weir's 6 calls and 2 retries
    assert sum(r["cost_pico_usd"] for r in stored) == sum(e.cost_pico_usd for e in batch)


async def test_an_event_twice_in_one_batch_is_counted_once(engine: AsyncEngine) -> None:
    """One batch can hold an event twice (a ride re-sent after its pipeline's answer was lost, a spool
    forwarded twice, read together). The ledger stores it once; the rollups must count it once too."""
    await _write_twice_in_one_batch(engine, latency_ms=12.5)


@pytest.mark.postgres
async def test_an_event_twice_in_one_batch_is_counted_once_on_postgres_array_path(pg_url: str) -> None:
    """The same on PostgreSQL's other path (a time JSON cannot carry, NaN: the rollups are summed in
    Weir, not by the server)."""
    await migrate.upgrade_async(pg_url)
    engine = create_engine(pg_url)
    try:
        await _write_twice_in_one_batch(engine, latency_ms=float("nan"))
    finally:
        await engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("latency_ms", [12.5, float("nan")], ids=["lines", "arrays"])
async def test_rollup_upserts_do_not_run_out_of_row_ids_on_postgres(
    migrated_pg_url: str, tmp_path: Path, latency_ms: float
) -> None:
    """PostgreSQL's INSERT ... ON CONFLICT DO UPDATE takes a number from the id sequence for every row
    it proposes, even one that only adds to an existing rollup: each batch takes one per group from
    each rollup table's sequence. An `integer` id ran out after 2^31 of them (weeks of busy batches),
    and from then on every batch failed with 2200H, a data exception, so every event went to the
    dead-letter file. Both paths (the server's from JSON lines, Weir's with NaN) upsert the rollups."""
    engine = create_engine(migrated_pg_url)
    try:
        async with engine.begin() as conn:
            for table in ("usage_rollups", "usage_route_rollups"):
                await conn.execute(
                    text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), {2**31 - 3})")
                )
        writer = BatchWriter(SpoolQueue(tmp_path / "spool"), engine)
        batches = [random_events(20, seed=70 + i) for i in range(3)]  # 6 groups each, the same ones
        for batch in batches:
            assert (
                await writer.write([msgspec.structs.replace(e, latency_ms=latency_ms) for e in batch]) == 20
            )
        count, cost, rollup_cost = await ledger(engine)
        assert count == 60 and cost == rollup_cost == sum(e.cost_pico_usd for b in batches for e in b)
    finally:
        await engine.dispose()


async def _write_twice_in_one_batch(engine: AsyncEngine, latency_ms: float) -> None:
    batch = [msgspec.structs.replace(e, latency_ms=latency_ms) for e in random_events(6, seed=41)]
    writer = BatchWriter(SpoolQueue(Path(f"/tmp/unused-{id(engine)}")), engine)
    assert await writer.write(batch + batch[:2]) == 6
    assert writer.stats.duplicates == 2
    count, cost, rollup_cost = await ledger(engine)
    assert count == 6 and cost == rollup_cost == sum(e.cost_pico_usd for e in batch)
    async with engine.connect() as conn:
        assert (await conn.execute(select(func.sum(UsageRollup.requests)))).scalar() == 6


@pytest.mark.redis
@pytest.mark.postgres
async def test_stream_lines_go_to_postgres_as_sent_and_unreadable_ones_are_skipped(
    redis_prefix: str, pg_url: str
) -> None:
    """From the Redis stream the writer hands PostgreSQL the encoded lines undecoded. A line from an
    older encoding (fields with defaults left out) lands with those defaults; a torn line is not
    retried forever with its batch (with no dead-letter file, as here, it is logged; with one it is
    set aside: `test_lines_that_are_no_event_are_set_aside_not_dropped`)."""
    await migrate.upgrade_async(pg_url)
    engine = create_engine(pg_url)
    queue = RedisStreamQueue(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    batch = random_events(20, seed=32)
    old = msgspec.json.decode(encode(batch[0]))
    for name in (
        "savings_pico_usd",
        "latency_ms",
        "ttft_ms",
        "status",
        "fallback",
        "routing",
        "estimated",
        "exchange_id",
    ):
        old.pop(name)
    queue._buffer = [encode(e) for e in batch[1:]] + [msgspec.json.encode(old), b'{"request_id": "half-wr']
    await queue.flush()
    writer = BatchWriter(queue, engine)
    await writer.drain()
    assert writer.stats.inserted == 20
    async with engine.connect() as conn:
        stored = {r.event_id: dict(r._mapping) for r in await conn.execute(select(UsageEventRow.__table__))}
    for event in batch[1:]:
        assert stored[event.event_id] == event_row(event)
    defaults = msgspec.structs.replace(
        batch[0], savings_pico_usd=0, latency_ms=0.0, ttft_ms=None, status=200, fallback=False, routing=None
    )
    assert stored[batch[0].event_id] == event_row(defaults)
    assert len(await queue.read(100, 0)) == 0  # all acknowledged, the torn line too
    await queue.close()
    await engine.dispose()


async def test_lines_that_are_no_event_are_set_aside_not_dropped(
    queue: UsageQueue, engine: AsyncEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A line torn by a crash (forwarded from a spool to the stream as it was) and an event in a shape
    this version cannot read were logged and acknowledged with their batch: gone (from the Redis
    stream without PostgreSQL, they failed every read instead). Now the writer writes the events
    around them and sets each aside as its raw text in the dead-letter file before acknowledging
    it; `replay` reports them as unreadable, and writes one a later version can read."""
    batch = random_events(20, seed=33)
    odd_shape = msgspec.json.decode(encode(random_events(1, seed=34)[0]))
    odd_shape["attempt"] = "first"
    torn, odd = b'{"request_id": "half-wr', msgspec.json.encode(odd_shape)
    lines = [encode(e) for e in batch[:10]] + [torn, odd] + [encode(e) for e in batch[10:]]
    if isinstance(queue, RedisStreamQueue):
        queue._buffer = lines
        await queue.flush()
    else:
        assert isinstance(queue, SpoolQueue)
        for line in lines:
            queue.put_line(line)
    dead_letter = tmp_path / "dead-letter.jsonl"
    writer = BatchWriter(queue, engine, dead_letter=dead_letter)
    with caplog.at_level(logging.ERROR, logger="gateway.accounting.writer"):
        await writer.drain()
    count, cost, rollup_cost = await ledger(engine)
    assert count == 20 and cost == rollup_cost == sum(e.cost_pico_usd for e in batch)
    assert len(await queue.read(100, 0)) == 0  # all acknowledged, the two lines too
    records = [record for _, record in read_dead_letters(dead_letter)]
    assert all(r is not None and r.reason == "unreadable" for r in records)
    assert sorted(r.raw for r in records if r is not None) == sorted([torn.decode(), odd.decode()])
    assert writer.stats.set_aside == writer.stats.unreadable == 2
    assert caplog.text.count(f"set aside in {dead_letter}") == 2
    # One a later version reads (as this one reads an event) is written by the replay.
    later = random_events(1, seed=35)[0]
    with dead_letter.open("ab") as f:
        record = {"set_aside_at": "2026-12-05T00:00:00Z", "reason": "unreadable", "error": "x"}
        f.write(msgspec.json.encode({**record, "raw": encode(later).decode()}) + b"\n")
    replayed = await replay(dead_letter, engine)
    assert replayed.unreadable == [1, 2] and replayed.events == replayed.written == 1
    assert (await ledger(engine))[0] == 21


async def test_a_db_outage_is_logged_once_and_its_end_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer logged "usage batch not written ...; retrying in Xs" on every retry for as long as
    the database was away. Now: the failure once, a reminder every OUTAGE_REMINDER_S, and the recovery
    once, saying how long it lasted and what was held."""
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'unused.db'}")
    queue = SpoolQueue(tmp_path / "spool")
    writer = BatchWriter(queue, engine, batch_size=40, max_backoff_s=0.01, linger_s=0.01)
    attempts: list[int] = []
    landed: list[int] = []

    async def write(events: list[Any]) -> int:
        attempts.append(len(events))
        if len(attempts) <= 8:  # the database is away for eight tries
            raise ConnectionRefusedError("Connect call failed ('127.0.0.1', 5432)")
        landed.append(len(events))
        return len(events)

    monkeypatch.setattr(writer, "write", write)
    # The writer's clock moves 30 s at each look: failures at 0-210 s, the recovery at 240 s.
    clock = itertools.count(0.0, 30.0)
    monkeypatch.setattr("gateway.accounting.writer.time", SimpleNamespace(monotonic=lambda: next(clock)))
    caplog.set_level(logging.INFO, logger="gateway.accounting.writer")
    await put_all(queue, random_events(30, seed=41))
    writer.start()
    try:
        async with asyncio.timeout(5):
            while not landed:
                await asyncio.sleep(0.01)
    finally:
        await writer.stop(drain_timeout_s=0)
        await queue.close()
        await engine.dispose()
    records = [(r.levelname, r.getMessage()) for r in caplog.records if "usage batch" in r.getMessage()]
    assert records[0] == (
        "WARNING",
        "usage batch not written (ConnectionRefusedError: Connect call failed ('127.0.0.1', 5432)); "
        "holding it and retrying until it is written",
    )
    assert records[1:] == [  # not one per retry: a reminder once a minute (OUTAGE_REMINDER_S)
        (
            "WARNING",
            "usage batch still not written after 60s (ConnectionRefusedError); 30 rows held, retrying",
        ),
        (
            "WARNING",
            "usage batch still not written after 120s (ConnectionRefusedError); 30 rows held, retrying",
        ),
        (
            "WARNING",
            "usage batch still not written after 180s (ConnectionRefusedError); 30 rows held, retrying",
        ),
        (
            "INFO",
            "usage batches written again after 240.0s: the batch held meanwhile (30 rows) is in, "
            "after 8 failed attempts",
        ),
    ]
    assert landed == [30]


async def test_a_client_request_id_of_any_accepted_length_lands_in_the_ledger(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    """The gateway keeps a client's `x-request-id` of up to 128 characters (gateway.ids) and logs,
    echoes and joins feedback by it: the ledger must hold it too. A column of 64 made PostgreSQL
    refuse the batch (a data exception, retried for ever), so no event of any tenant was written."""
    longest = "r" * 128
    batch = random_events(5, seed=51)
    batch[2] = msgspec.structs.replace(batch[2], request_id=longest)
    writer = BatchWriter(SpoolQueue(tmp_path / "unused"), engine)
    assert await writer.write(batch) == 5
    async with engine.connect() as conn:
        stored = (await conn.execute(select(UsageEventRow.request_id))).scalars().all()
    assert sorted(stored) == sorted(e.request_id for e in batch)


async def test_a_config_tenant_of_any_name_lands_in_the_ledger(engine: AsyncEngine, tmp_path: Path) -> None:
    """A config file's tenant is its name in the ledger (gateway.auth.tenant_principal), and a name
    may be as long as an admin-DB tenant's (200): PostgreSQL refused the batch at 32, for ever."""
    name = "customer-support-production-eu-west-1"  # 37 characters
    batch = random_events(4, seed=52)
    batch[1] = msgspec.structs.replace(batch[1], tenant_id=name)
    writer = BatchWriter(SpoolQueue(tmp_path / "unused"), engine)
    assert await writer.write(batch) == 4
    async with engine.connect() as conn:
        tenants = (await conn.execute(select(UsageRollup.tenant_id))).scalars().all()
    assert name in tenants


async def test_a_service_tier_no_price_can_name_lands_in_the_ledger_as_none(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    """A backend says which tier served it in its own words (an OpenAI-compatible server may send any
    string): one longer than any tier a price can name (32 characters) bills the base price anyway,
    and PostgreSQL refused it in `usage_events.service_tier`, the batch retried for ever."""
    said = "enterprise-reserved-capacity-us-east"  # 36 characters
    usage = normalise_usage("openai", {"prompt_tokens": 3, "completion_tokens": 2}, said)
    batch = random_events(3, seed=53)
    batch[0] = msgspec.structs.replace(batch[0], usage=usage)
    writer = BatchWriter(SpoolQueue(tmp_path / "unused"), engine)
    assert await writer.write(batch) == 3
    async with engine.connect() as conn:
        rows = await conn.execute(select(UsageEventRow.event_id, UsageEventRow.service_tier))
        tiers = {event_id: tier for event_id, tier in rows}
    assert tiers[batch[0].event_id] is None
    assert normalise_usage("openai", {"prompt_tokens": 3}, "flex").service_tier == "flex"


async def refused_by_the_ledger(engine: AsyncEngine) -> Callable[[UsageEvent], UsageEvent]:
    """How to make an event the database refuses for its data: on PostgreSQL a model name over its
    column (22001, value too long), on SQLite, which checks no lengths, a trigger refusing a model name
    (a constraint violation, as a CHECK would be)."""
    if engine.dialect.name == "sqlite":
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "CREATE TRIGGER refuse_model BEFORE INSERT ON usage_events WHEN NEW.model = 'refused' "
                    "BEGIN SELECT RAISE(ABORT, 'model refused'); END"
                )
            )
        return lambda e: msgspec.structs.replace(e, model="refused")
    return lambda e: msgspec.structs.replace(e, model="m" * 201)


async def test_an_event_the_database_refuses_is_set_aside_and_the_rest_written(
    queue: UsageQueue, engine: AsyncEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The database refused a batch for one event's data (a value over its column, a constraint) and
    the writer retried the whole batch for ever: nothing after it reached the ledger, for any tenant.
    Now the others are written (rollups counting exactly them), the refused one is set aside in the
    dead-letter file with a log line, and later batches keep landing. (On PostgreSQL from the Redis
    stream this is the path that sends the lines undecoded.)"""
    refuse = await refused_by_the_ledger(engine)
    batch = random_events(600, seed=61)
    batch[137] = poison = refuse(batch[137])
    await put_all(queue, batch)
    dead_letter = tmp_path / "dead-letter.jsonl"
    writer = BatchWriter(queue, engine, batch_size=250, dead_letter=dead_letter)
    caplog.set_level(logging.ERROR, logger="gateway.accounting.writer")
    await writer.drain()

    written = [e for e in batch if e is not poison]
    count, cost, rollup_cost = await ledger(engine)
    assert count == 599 and writer.stats.inserted == 599
    assert cost == rollup_cost == sum(e.cost_pico_usd for e in written)
    async with engine.connect() as conn:
        requests = (await conn.execute(select(func.sum(UsageRollup.requests)))).scalar()
        stored = set((await conn.execute(select(UsageEventRow.event_id))).scalars())
    assert int(requests) == 599 and poison.event_id not in stored
    [(_, record)] = list(read_dead_letters(dead_letter))
    assert record is not None and decode(bytes(record.event)) == poison
    reason = "SQLITE_CONSTRAINT_TRIGGER" if engine.dialect.name == "sqlite" else "22001"
    assert record.reason == reason and writer.stats.set_aside == 1
    [logged] = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert poison.event_id in logged and f"tenant {poison.tenant_id}" in logged and reason in logged

    later = random_events(50, seed=62)  # the writer keeps going
    await put_all(queue, later)
    await writer.drain()
    count, cost, rollup_cost = await ledger(engine)
    assert count == 649 and cost == rollup_cost == sum(e.cost_pico_usd for e in written + later)
    assert len(await queue.read(1000, 0)) == 0  # every event acknowledged, the refused one too
    assert len(list(read_dead_letters(dead_letter))) == 1


async def test_a_number_no_column_holds_is_set_aside(engine: AsyncEngine, tmp_path: Path) -> None:
    """A cost over 64 bits: PostgreSQL refuses it (22003, numeric out of range), SQLite's driver will
    not bind it. The batch's other events land; the spool's dead-letter file holds that one."""
    queue = SpoolQueue(tmp_path / "spool" / "0")
    batch = random_events(40, seed=63)
    batch[7] = huge = msgspec.structs.replace(batch[7], cost_pico_usd=2**63)
    await put_all(queue, batch)
    writer = BatchWriter(queue, engine)  # the dead-letter file: beside the spool's slots
    await writer.drain()
    count, cost, rollup_cost = await ledger(engine)
    assert count == 39 and cost == rollup_cost == sum(e.cost_pico_usd for e in batch if e is not huge)
    [(_, record)] = list(read_dead_letters(tmp_path / "spool" / "dead-letter.jsonl"))
    assert record is not None and decode(bytes(record.event)) == huge
    assert record.reason == ("OverflowError" if engine.dialect.name == "sqlite" else "22003")
    assert queue.pending() == 0
    await queue.close()


async def test_a_batch_written_in_parts_and_retried_counts_each_event_once(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    """The database goes away while a refused batch is being written in halves: the batch is kept,
    the halves already committed are skipped when it is written again, and the rollups count every
    event once."""
    refuse = await refused_by_the_ledger(engine)
    queue = SpoolQueue(tmp_path / "spool" / "0")
    batch = random_events(300, seed=64)
    batch[250] = poison = refuse(batch[250])
    await put_all(queue, batch)
    writer = BatchWriter(queue, engine)
    write = writer.write
    calls = 0

    async def write_until_the_database_goes(events: list[UsageEvent]) -> int:
        nonlocal calls
        calls += 1
        if calls == 4:  # the whole batch, its first half (committed), its second, then...
            raise ConnectionRefusedError("Connect call failed ('127.0.0.1', 5432)")
        return await write(events)

    writer.write = write_until_the_database_goes  # type: ignore[method-assign]
    with pytest.raises(ConnectionRefusedError):
        await writer.step(block_s=0)
    assert (await ledger(engine))[0] == 150 and writer.stats.set_aside == 0  # nothing set aside yet
    await writer.drain()
    written = [e for e in batch if e is not poison]
    count, cost, rollup_cost = await ledger(engine)
    assert count == 299 and cost == rollup_cost == sum(e.cost_pico_usd for e in written)
    async with engine.connect() as conn:
        requests = (await conn.execute(select(func.sum(UsageRollup.requests)))).scalar()
    assert int(requests) == 299 and writer.stats.set_aside == 1
    assert queue.pending() == 0
    await queue.close()


async def test_a_batch_set_aside_again_after_a_crash_is_in_the_dead_letter_file_once(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    """The gateway dies between setting a batch's refused event and torn line aside and acknowledging
    the batch: the restarted one reads the batch again and sets them aside again. The file held both
    twice (and a replay listed the torn line twice); now each record is in it once."""
    refuse = await refused_by_the_ledger(engine)
    spool, dead_letter = tmp_path / "spool", tmp_path / "dead-letter.jsonl"
    batch = random_events(10, seed=66)
    batch[3] = poison = refuse(batch[3])
    queue = SpoolQueue(spool)
    for line in [encode(e) for e in batch] + [b'{"request_id": "half-wr']:
        queue.put_line(line)
    writer = BatchWriter(queue, engine, dead_letter=dead_letter)

    async def killed(tokens: list[Any]) -> None:
        raise RuntimeError("killed before the acknowledgement")

    queue.ack = killed  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="killed"):
        await writer.step(block_s=0)
    await queue.close()

    queue = SpoolQueue(spool)  # the restarted process, with a dead-letter writer of its own
    writer = BatchWriter(queue, engine, dead_letter=dead_letter)
    await writer.drain()
    assert queue.pending() == 0 and writer.stats.duplicates == 9
    records = [record for _, record in read_dead_letters(dead_letter)]
    assert len(records) == 2 and all(r is not None for r in records)
    assert [decode(bytes(r.event)) for r in records if r is not None and r.raw is None] == [poison]
    assert [r.raw for r in records if r is not None and r.raw is not None] == ['{"request_id": "half-wr']
    await queue.close()


def test_a_record_after_a_torn_dead_letter_line_stays_whole(tmp_path: Path) -> None:
    """A full disk stops an append part way: the batch is held and set aside again later. The record
    after the torn start must begin a line of its own (glued to it, both read as one line that is no
    record: the event lost), and the records the failed append did not write are appended then, not
    taken for written."""
    path = tmp_path / "dead-letter.jsonl"
    letters = DeadLetters(path)
    events = random_events(3, seed=67)
    refused = [Refused(e, "22001", "StringDataRightTruncationError: too long") for e in events]
    letters.add(refused[:1])

    def disk_full_after(budget: int) -> Callable[[int, Any], int]:
        def write(fd: int, data: Any) -> int:
            nonlocal budget
            if budget <= 0:
                raise OSError(28, "No space left on device")
            written = os.write(fd, bytes(data[:budget]))
            budget -= written
            return written

        return write

    letters._write = disk_full_after(40)
    with pytest.raises(OSError, match="No space"):
        letters.add(refused[1:])
    letters._write = os.write  # space again: the held batch is set aside again
    letters.add(refused[1:])
    lines = list(read_dead_letters(path))
    assert [number for number, record in lines if record is None] == [2]  # the torn start alone
    written = [decode(bytes(r.event)) for _, r in lines if r is not None]
    assert written == events


def test_set_aside_events_are_replayed_into_the_ledger_once(tmp_path: Path) -> None:
    """Once the cause is fixed, `weir db replay-usage` writes the set-aside events with their rollups;
    running it again writes nothing twice. One still refused is named, with exit status 1."""
    url = migrated_sqlite(f"sqlite+aiosqlite:///{tmp_path / 'weir.db'}")
    batch = random_events(30, seed=65)
    refused_model = [msgspec.structs.replace(e, model="refused") for e in batch[:3]]
    dead_letter = tmp_path / "dead-letter.jsonl"

    async def set_aside() -> None:
        engine = create_engine(url)
        await refused_by_the_ledger(engine)
        queue = SpoolQueue(tmp_path / "spool")
        await put_all(queue, refused_model + batch[3:])
        writer = BatchWriter(queue, engine, dead_letter=dead_letter)
        await writer.drain()
        assert writer.stats.set_aside == 3 and (await ledger(engine))[0] == 27
        await queue.close()
        await engine.dispose()

    asyncio.run(set_aside())
    sync_exec(url, "DROP TRIGGER refuse_model")  # the cause fixed
    sync_exec(
        url,
        "CREATE TRIGGER refuse_one BEFORE INSERT ON usage_events WHEN NEW.attempt = 99 "
        "BEGIN SELECT RAISE(ABORT, 'still refused'); END",
    )
    with dead_letter.open("ab") as f:  # one more, still refused, and a line torn by a crash
        still = msgspec.structs.replace(batch[0], event_id="still-refused", attempt=99)
        f.write(
            msgspec.json.encode(
                {
                    "set_aside_at": "2026-12-05T00:00:00Z",
                    "reason": "x",
                    "error": "x",
                    "event": msgspec.json.decode(encode(still)),
                }
            )
            + b"\n"
        )
        f.write(b'{"set_aside_at": "2026-12')
    runner = CliRunner()
    first = runner.invoke(main, ["db", "replay-usage", str(dead_letter), "--database-url", url])
    assert first.exit_code == 1, first.output
    assert first.output.splitlines()[0] == (
        f"4 events in {dead_letter}: 3 written to the ledger, 0 there already, 1 refused again"
    )
    assert "refused: event still-refused of tenant" in first.output and "unreadable lines: 5" in first.output
    again = runner.invoke(main, ["db", "replay-usage", str(dead_letter), "--database-url", url])
    assert "0 written to the ledger, 3 there already, 1 refused again" in again.output
    [(count, cost, rollup_cost)] = sync_exec(
        url,
        "SELECT (SELECT count(*) FROM usage_events), (SELECT sum(cost_pico_usd) FROM usage_events), "
        "(SELECT sum(cost_pico_usd) FROM usage_rollups)",
    )
    assert count == 30 and cost == rollup_cost == sum(e.cost_pico_usd for e in batch)


async def _rollups_match_the_ledger(engine: AsyncEngine) -> None:
    """Both rollup tables hold exactly the ledger's attempts and cost, per tenant."""
    per_tenant = "SELECT tenant_id, count(*), sum(cost_pico_usd) FROM usage_events GROUP BY 1 ORDER BY 1"
    async with engine.connect() as conn:
        ledger_sums = [tuple(r) for r in await conn.execute(text(per_tenant))]
        for table in ("usage_rollups", "usage_route_rollups"):
            sums = await conn.execute(
                text(
                    f"SELECT tenant_id, sum(requests), sum(cost_pico_usd) FROM {table} GROUP BY 1 ORDER BY 1"
                )
            )
            assert [(t, int(n), int(c)) for t, n, c in sums] == [(t, n, int(c)) for t, n, c in ledger_sums]


async def _written_whatever_the_contention(writer: BatchWriter, events: list[UsageEvent]) -> None:
    """`write`, retried as the writer's run loop retries it: two writers' transactions may deadlock
    on the same rows (PostgreSQL aborts one, 40P01) or find the SQLite file locked."""
    for _ in range(50):
        try:
            await writer.write(events)
            return
        except DBAPIError:
            await asyncio.sleep(0.01)
    raise AssertionError("a batch was never written")


async def test_two_replicas_writing_the_same_events_at_once_count_each_once(
    db_url: str, tmp_path: Path
) -> None:
    """Two gateway replicas on one database, each with its engine and writer, write overlapping
    batches at the same time (a stream entry claimed from a writer that was only slow, a spool
    forwarded twice): every event is in the ledger once and both rollup tables count exactly those."""
    await migrate.upgrade_async(premigrated(db_url))
    engines = [create_engine(db_url), create_engine(db_url)]
    try:
        events = random_events(400, seed=68)
        writers = [BatchWriter(SpoolQueue(tmp_path / f"spool{i}"), e) for i, e in enumerate(engines)]
        # Each replica writes every event, in batches of its own sizes, one in the reverse order.
        plans = [
            [events[i : i + 50] for i in range(0, 400, 50)],
            [list(reversed(events[i : i + 70])) for i in range(0, 400, 70)][::-1],
        ]
        await asyncio.gather(
            *(
                _written_whatever_the_contention(writer, batch)
                for writer, plan in zip(writers, plans, strict=True)
                for batch in plan
            )
        )
        count, cost, rollup_cost = await ledger(engines[0])
        assert count == 400 and cost == rollup_cost == sum(e.cost_pico_usd for e in events)
        assert sum(w.stats.inserted for w in writers) == 400
        await _rollups_match_the_ledger(engines[0])
    finally:
        for engine in engines:
            await engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("latency_ms", [12.5, float("nan")], ids=["lines", "arrays"])
async def test_two_replicas_adding_to_the_same_rollups_at_once_do_not_deadlock(
    migrated_pg_url: str, tmp_path: Path, latency_ms: float
) -> None:
    """Two replicas' batches add to the same rollup rows (one tenant's day, another's) in one
    transaction each. Taken in the batches' own event order, the rows were locked in opposite orders
    and PostgreSQL aborted one transaction as a deadlock (40P01) after a second's wait: the writer
    logged a database outage and wrote the batch again. In the rollup key's order, one waits for the
    other instead. (A trigger holds each rollup row's update a moment, so the two always overlap.)"""
    engines = [create_engine(migrated_pg_url), create_engine(migrated_pg_url)]
    try:
        async with engines[0].begin() as conn:
            await conn.execute(
                text(
                    "CREATE FUNCTION slow() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$ "
                    "LANGUAGE plpgsql"
                )
            )
            for table in ("usage_rollups", "usage_route_rollups"):
                await conn.execute(
                    text(f"CREATE TRIGGER slow BEFORE UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION slow()")
                )
        day = dt.datetime(2026, 12, 1, 12, tzinfo=dt.UTC)
        writers = [BatchWriter(SpoolQueue(tmp_path / f"spool{i}"), e) for i, e in enumerate(engines)]
        events = [
            msgspec.structs.replace(e, tenant_id=tenant, ts=day, latency_ms=latency_ms)
            for tenant, e in zip(["a", "b"] * 3, random_events(6, seed=71), strict=True)
        ]
        await writers[0].write(events[:2])  # both rollup rows there: the batches below update them
        a_then_b, b_then_a = events[2:4], events[4:6][::-1]
        await asyncio.gather(writers[0].write(a_then_b), writers[1].write(b_then_a))
        count, cost, rollup_cost = await ledger(engines[0])
        assert count == 6 and cost == rollup_cost == sum(e.cost_pico_usd for e in events)
    finally:
        for engine in engines:
            await engine.dispose()


async def test_replaying_a_dead_letter_file_twice_and_at_once_writes_each_event_once(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    """`weir db replay-usage` run twice, and by two operators at the same time, on SQLite and on
    PostgreSQL: each event lands once, with its rollups once."""
    events = random_events(120, seed=69)
    dead_letter = tmp_path / "dead-letter.jsonl"
    DeadLetters(dead_letter).add([Refused(e, "22001", "x") for e in events])
    with dead_letter.open("ab") as f:  # an older file may hold a record twice
        f.write(dead_letter.read_bytes().splitlines(keepends=True)[0])
    first, second = await asyncio.gather(
        replay(dead_letter, engine, batch=25), replay(dead_letter, engine, batch=40)
    )
    assert first.events == second.events == 120 and first.written + second.written == 120
    again = await replay(dead_letter, engine)
    assert again.written == 0 and again.duplicates == 120 and not again.refused
    count, cost, rollup_cost = await ledger(engine)
    assert count == 120 and cost == rollup_cost == sum(e.cost_pico_usd for e in events)
    await _rollups_match_the_ledger(engine)


def test_set_aside_events_are_a_prometheus_counter() -> None:
    metrics = Metrics()
    stats = SimpleNamespace(set_aside=0)
    metrics.watch_set_aside(lambda: stats.set_aside)
    stats.set_aside = 2
    assert b"\nweir_usage_events_set_aside_total 2.0\n" in metrics.render()
