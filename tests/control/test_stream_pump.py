"""The Redis stream queue's pump: batches a flush window's events into one XADD, sleeps while there
is nothing to send, and keeps forwarding the spool after an outage without new events to wake it;
and buffered events riding in the shared state's script pipelines instead of an XADD of their own."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from gateway.accounting.events import UsageEvent, decode
from gateway.accounting.queue import RedisStreamQueue, SpoolQueue
from gateway.state import Adjustment, Settlement
from gateway.state.redis import RedisState, client_from_url
from tests.control.events import numbered_event
from tests.fixtures.db import REDIS_URL


class FakeRedis:
    """Just the XADD the pump sends; `failures` XADDs raise first, as an unreachable Redis does."""

    def __init__(self, failures: int = 0) -> None:
        self.entries: list[bytes] = []
        self.times: list[float] = []
        self.failures = failures

    async def xadd(self, stream: str, fields: dict[str, bytes]) -> bytes:
        if self.failures > 0:
            self.failures -= 1
            raise RedisConnectionError("Redis is away")
        self.entries.append(fields["e"])
        self.times.append(time.monotonic())
        return b"1-0"

    async def aclose(self) -> None:
        pass

    def events(self) -> list[UsageEvent]:
        return [decode(line) for entry in self.entries for line in entry.split(b"\n")]


def counting_flushes(queue: RedisStreamQueue) -> list[int]:
    calls = [0]
    flush = queue.flush

    async def counted() -> None:
        calls[0] += 1
        await flush()

    queue.flush = counted  # type: ignore[method-assign]
    return calls


async def test_one_window_one_xadd_then_the_pump_sleeps(tmp_path: Path) -> None:
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=0.02, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    flushes = counting_flushes(queue)
    put_at = time.monotonic()
    for n in range(5):
        queue.put(numbered_event(n))
    await asyncio.sleep(0.1)
    assert [e.request_id for e in redis.events()] == [f"r{n}" for n in range(5)]
    assert len(redis.entries) == 1
    # Sent after the window, not at once, and not much later (generous bound for a busy machine).
    assert 0.015 <= redis.times[0] - put_at < 0.09
    after_first = flushes[0]
    # Idle: no more wake-ups (the pump used to flush every interval, with or without events).
    await asyncio.sleep(0.2)
    assert flushes[0] == after_first
    queue.put(numbered_event(9))
    await asyncio.sleep(0.1)
    assert len(redis.entries) == 2 and flushes[0] == after_first + 1
    await queue.close()


async def test_a_full_buffer_goes_without_waiting_for_the_window(tmp_path: Path) -> None:
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=30.0, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    for n in range(RedisStreamQueue.FULL_BUFFER):
        queue.put(numbered_event(n))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(redis.events()) == RedisStreamQueue.FULL_BUFFER
    await queue.close()


@pytest.mark.parametrize("failures", [1, 3])
async def test_spooled_events_are_forwarded_without_new_events(tmp_path: Path, failures: int) -> None:
    redis = FakeRedis(failures=failures)
    spool = SpoolQueue(tmp_path)
    queue = RedisStreamQueue(redis, flush_interval_s=0.01, spool=spool, retry_s=0.02)  # type: ignore[arg-type]
    queue.put(numbered_event(1))
    queue.put(numbered_event(2))
    # Nothing else is put: the pump alone must retry until Redis takes the spooled events.
    deadline = time.monotonic() + 5
    while len(redis.events()) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert [e.request_id for e in redis.events()] == ["r1", "r2"]
    assert not queue.spooling and spool.pending() == 0
    await queue.close()


async def test_close_sends_what_is_buffered(tmp_path: Path) -> None:
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=30.0, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    queue.put(numbered_event(1))
    await asyncio.sleep(0)
    await queue.close()
    assert [e.request_id for e in redis.events()] == ["r1"]


async def test_a_spool_a_previous_process_left_is_forwarded_at_start(tmp_path: Path) -> None:
    """A replica stopped while Redis was away left its events in the spool. The pump started with
    the first new event, so a replica that got no traffic after its restart never forwarded them."""
    left = SpoolQueue(tmp_path)
    left.put(numbered_event(1))
    await left.close()
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=30.0, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    queue.start()
    deadline = time.monotonic() + 5
    while not redis.events() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert [e.request_id for e in redis.events()] == ["r1"]
    await queue.close()


class Outage:
    """The shared state's word on whether Redis answers (gateway.state.base.Outage)."""

    def __init__(self, degraded: bool) -> None:
        self.degraded = degraded

    def lost(self, exc: BaseException) -> None:
        self.degraded = True


@pytest.mark.parametrize("away", [False, True])
async def test_close_keeps_what_rides_in_a_pipeline_that_never_answers(tmp_path: Path, away: bool) -> None:
    """Events taken by a shared-state pipeline that has not answered when the queue closes (a
    hanging Redis) came back after the spool was closed, and were lost. Now the close waits for
    them only while Redis answers (`timeout_s` at most), then sends them itself, or spools them when
    Redis is known to be away, without waiting. The pipeline failing afterwards adds nothing."""
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=30.0, spool=SpoolQueue(tmp_path), timeout_s=0.3)  # type: ignore[arg-type]
    queue.outage = Outage(away)
    queue.put(numbered_event(1))
    taken = queue.take_entry()
    assert taken is not None
    started = time.monotonic()
    await queue.close()
    took = time.monotonic() - started
    queue.entry_failed(taken[1])  # the pipeline fails once the shared state closes its connection
    assert not queue._buffer
    if away:
        assert took < 0.25, took  # not the 0.3 s wait
        assert redis.events() == []
        spool = SpoolQueue(tmp_path)
        assert [e.request_id for _, e in await spool.read(10, 0)] == ["r1"]
        await spool.close()
    else:
        assert 0.3 <= took < 2.0, took
        assert [e.request_id for e in redis.events()] == ["r1"]  # a repeat is harmless (event ids)


async def test_events_wait_until_the_shared_state_has_handed_redis_its_settlements(tmp_path: Path) -> None:
    """While the shared state runs without Redis, it keeps the settlements it makes for Redis, and
    hands them over before it stops being degraded. The queue sent its events to the stream as soon
    as Redis took an XADD: an event could reach the ledger before its settlement reached Redis, and
    a budget seeded from the ledger in between counted the attempt twice. Events now wait in the
    spool until the state is back, and go once it is."""
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=30.0, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    outage = Outage(True)
    queue.outage = outage
    queue.put(numbered_event(1))
    with pytest.raises(RedisConnectionError):
        await queue.flush()
    assert redis.events() == [] and queue.spooling
    outage.degraded = False  # the state handed Redis what it settled meanwhile
    await queue.flush()
    assert [e.request_id for e in redis.events()] == ["r1"]
    await queue.close()


# --- events riding in the shared state's script pipelines -----------------------------------------


async def test_buffered_events_ride_in_the_settlement_pipeline(tmp_path: Path, redis_prefix: str) -> None:
    state = RedisState(client_from_url(REDIS_URL), prefix=redis_prefix)
    queue = RedisStreamQueue(
        client_from_url(REDIS_URL), prefix=redis_prefix, flush_interval_s=30.0, spool=SpoolQueue(tmp_path)
    )
    state.rider = queue
    flushes = counting_flushes(queue)
    for n in range(3):
        queue.put(numbered_event(n))
    # The flush window is 30 s: only the settlement's round trip can have carried them.
    await state.settle_many([Settlement([Adjustment("tpm:key:k", 5)])])
    raw = await queue._redis.xrange(f"{redis_prefix}usage")
    assert [decode(line).request_id for _, f in raw for line in f[b"e"].split(b"\n")] == ["r0", "r1", "r2"]
    assert flushes[0] == 0 and not queue._buffer
    # Nothing buffered: the next pipeline carries no XADD.
    await state.settle_many([Settlement([Adjustment("tpm:key:k", 5)])])
    assert len(await queue._redis.xrange(f"{redis_prefix}usage")) == 1
    await queue.close()
    await state.close()


async def test_a_failed_pipeline_gives_its_events_back_once(tmp_path: Path, redis_prefix: str) -> None:
    with socket.socket() as probe:  # a port nobody listens on: every pipeline fails
        probe.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
    state = RedisState(client_from_url(dead), prefix=redis_prefix)
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=0.02, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    state.rider = queue
    for n in range(4):
        queue.put(numbered_event(n))
    with pytest.raises(RedisConnectionError):
        await state.settle_many([Settlement([Adjustment("tpm:key:k", 5)])])
    await asyncio.sleep(0.15)
    assert sorted(e.request_id for e in redis.events()) == ["r0", "r1", "r2", "r3"]
    await queue.close()
    await state.close()


async def test_no_ride_while_the_pump_flushes_or_spools(tmp_path: Path) -> None:
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=30.0, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    queue.put(numbered_event(1))
    async with queue._flush_lock:
        assert queue.take_entry() is None  # the pump removes its batch from the buffer's front
    queue.spooling = True
    assert queue.take_entry() is None
    queue.spooling = False
    taken = queue.take_entry()
    assert taken is not None and [decode(line).request_id for line in taken[1].split(b"\n")] == ["r1"]
    assert queue.take_entry() is None
    queue.entry_sent(taken[1])
    await queue.close()
    assert redis.events() == []  # taken, so not sent again by the queue


async def test_the_pump_stays_asleep_when_riders_took_the_window(tmp_path: Path) -> None:
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=0.02, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    flushes = counting_flushes(queue)
    for round_no in range(3):
        queue.put(numbered_event(round_no))
        taken = queue.take_entry()  # what a settlement pipeline does within the window
        assert taken is not None
        queue.entry_sent(taken[1])
        await asyncio.sleep(0.05)
    assert flushes[0] == 0 and redis.entries == []
    await queue.close()


async def test_state_pipeline_returns_error_replies_in_place(redis_prefix: str) -> None:
    state = RedisState(client_from_url(REDIS_URL), prefix=redis_prefix)
    key = f"{redis_prefix}p"
    results = await state._pipeline([("SET", key, "a"), ("INCR", key), ("GET", key)])
    assert results[0] in (b"OK", "OK") and isinstance(results[1], ResponseError) and results[2] == b"a"
    # Cancelled while waiting for the replies: that connection is dropped, the next call is clean.
    call = asyncio.ensure_future(state._pipeline([("BLPOP", f"{redis_prefix}none", "1")]))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await state._pipeline([("GET", key)]) == [b"a"]
    await state.close()


async def test_a_window_waits_once_for_settlements_under_way(tmp_path: Path) -> None:
    """While settlements are on their way to Redis the window's events wait one more window for their
    pipeline instead of an XADD of their own; if none took them by then, the pump sends them."""
    redis = FakeRedis()
    queue = RedisStreamQueue(redis, flush_interval_s=0.02, spool=SpoolQueue(tmp_path))  # type: ignore[arg-type]
    settling = [True]
    waits = [0]

    def busy() -> bool:
        waits[0] += settling[0]
        return settling[0]

    queue.rider_busy = busy
    queue.put(numbered_event(1))
    await asyncio.sleep(0.03)  # the first window ended while settlements were under way
    assert redis.entries == []
    taken = queue.take_entry()  # the settlement pipeline takes them
    assert taken is not None
    queue.entry_sent(taken[1])
    await asyncio.sleep(0.03)
    assert redis.entries == []  # nothing left for the pump

    queue.put(numbered_event(2))  # settlements still under way, but nobody takes these
    for _ in range(100):
        if redis.entries:
            break
        await asyncio.sleep(0.01)
    assert [e.request_id for e in redis.events()] == ["r2"]  # sent after the second window
    assert waits[0] == 2  # one wait per window, never two in a row
    settling[0] = False
    queue.put(numbered_event(3))
    for _ in range(100):
        if len(redis.entries) == 2:
            break
        await asyncio.sleep(0.01)
    assert [e.request_id for e in redis.events()] == ["r2", "r3"]  # nothing under way: no wait
    await queue.close()


async def test_reads_after_a_backlog_of_full_entries_stay_near_max_events(redis_prefix: str) -> None:
    """A backlog of full entries (a spool forwarded after an outage) is read in batches of about
    `max_events`, not 20x that; every event comes out once."""
    client = client_from_url(REDIS_URL)
    queue = RedisStreamQueue(client, prefix=redis_prefix)
    try:
        await queue.read_lines(200, 0)  # makes the consumer group
        per_entry = RedisStreamQueue.EVENTS_PER_ENTRY
        for entry in range(30):
            lines = [f"{entry}-{i}".encode() for i in range(per_entry)]
            await client.xadd(f"{redis_prefix}usage", {"e": b"\n".join(lines)})
        sizes, seen = [], []
        while batch := await queue.read_lines(200, 0):
            sizes.append(len(batch))
            seen += [line for _, line in batch]
            await queue.ack([token for token, _ in batch])
        assert sizes[0] <= 20 * per_entry  # the first read knows nothing yet: at most max_events / 10 entries
        assert all(size == per_entry for size in sizes[1:])  # then one full entry (<= max_events) a read
        assert len(sizes) > 10
        assert sorted(seen) == sorted(f"{e}-{i}".encode() for e in range(30) for i in range(per_entry))
    finally:
        await client.delete(f"{redis_prefix}usage")
        await client.aclose()
