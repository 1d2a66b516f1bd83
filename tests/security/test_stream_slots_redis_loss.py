"""Concurrent-stream slots across replicas when Redis goes away, comes back, or loses its data.

`max_concurrent_streams` holds across every replica with Redis, and per replica while Redis is
unreachable (docs/configuration.md). At the edges of an outage: streams still open when Redis returns
count there, a lease Redis forgot (a restart without its data, an eviction, a FLUSHDB) while its
stream still runs is added back by its holder's refresh, and a refresh cannot bring back a lease given
back while it was on its way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.stream_slots import RedisSlots
from tests.control.helpers import TcpProxy
from tests.fixtures.db import REDIS_PORT, REDIS_URL

pytestmark = pytest.mark.redis


async def _until(check: Callable[[], object], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {within:g} s"
        await asyncio.sleep(0.02)


def _count_refreshes(slots: RedisSlots, before: Callable[[], Any] | None = None) -> list[int]:
    """Counts the slots' refreshes as they are answered (one element, the count); `before`, awaited
    ahead of each, can hold one up."""
    answered = [0]
    refresh = slots._refresh

    async def counted(**kw: Any) -> Any:
        if before is not None:
            await before()
        result = await refresh(**kw)
        answered[0] += 1
        return result

    slots._refresh = counted  # type: ignore[assignment]
    return answered


async def test_streams_opened_during_an_outage_still_count_once_redis_returns(
    redis_prefix: str,
) -> None:
    """Limit 2. While Redis is away the replica opens 2 streams, counted in the process. Redis comes
    back while both still stream: they are in Redis before its next grant, so a third is refused
    (it was granted: 4 streams on one replica with limit 2 until the outage's streams ended)."""
    proxy = TcpProxy(REDIS_PORT)
    await proxy.start()
    slots = RedisSlots.from_url(f"redis://127.0.0.1:{proxy.port}/0", prefix=redis_prefix)
    slots.retry_s = slots.timeout_s = 0.2
    try:
        await proxy.stop()
        during = [await slots.acquire("acme", 2) for _ in range(2)]
        assert all(lease is not None and lease.startswith("local:") for lease in during)
        assert await slots.acquire("acme", 2) is None  # per replica meanwhile

        await proxy.start()
        await _until(lambda: not slots.away, 5, "the slots hearing from Redis again")
        assert await slots.acquire("acme", 2) is None, "a third stream admitted with limit 2"
        async with aioredis.from_url(REDIS_URL) as shared:  # the other replicas see them too
            assert await shared.zcard(slots.key("acme")) == 2

            slots.release("acme", during[0])  # one ends: its slot is free for any replica
            await _until(lambda: not slots._tasks, 5, "the lease's removal")
            assert await shared.zcard(slots.key("acme")) == 1
        assert await slots.acquire("acme", 2) is not None
    finally:
        await slots.close()
        await proxy.stop()


async def test_leases_redis_lost_are_put_back_by_the_refresh(redis_prefix: str) -> None:
    """Limit 1, one stream open on replica A. Redis loses the tenant's lease set (here the key is
    deleted). A's next heartbeat adds its lease back, so replica B is still refused (the refresh only
    updated leases Redis had: B was granted a second stream, and more, for as long as A's ran)."""
    a = RedisSlots.from_url(REDIS_URL, prefix=redis_prefix, ttl_s=0.6)  # refreshed every 0.2 s
    b = RedisSlots.from_url(REDIS_URL, prefix=redis_prefix, ttl_s=0.6)
    refreshes = _count_refreshes(a)
    a.start()
    try:
        held = await a.acquire("acme", 1)
        assert held is not None and not held.startswith("local:")
        assert await b.acquire("acme", 1) is None  # shared across replicas

        async with aioredis.from_url(REDIS_URL) as shared:
            await shared.delete(a.key("acme"))  # Redis lost it; A's stream still runs
            seen = refreshes[0]
            await _until(lambda: refreshes[0] > seen, 5, "a heartbeat of A's")
        assert await b.acquire("acme", 1) is None, "B granted a second stream with limit 1"
    finally:
        await a.close()
        await b.close()


async def test_a_lease_given_back_while_a_refresh_carries_it_is_not_added_back(
    redis_prefix: str,
) -> None:
    """The heartbeat has taken the lease into a refresh that is not sent yet when the stream ends, and
    the lease is given back first. The refresh that follows does not add it back: the ended stream
    would hold its slot for `ttl_s` more."""
    sending, go = asyncio.Event(), asyncio.Event()

    async def held_up() -> None:
        sending.set()
        await go.wait()

    slots = RedisSlots.from_url(REDIS_URL, prefix=redis_prefix, ttl_s=0.3)  # refreshed every 0.1 s
    refreshes = _count_refreshes(slots, held_up)
    try:
        lease = await slots.acquire("acme", 1)
        assert lease is not None
        slots.start()
        await asyncio.wait_for(sending.wait(), 5)  # the refresh carrying the lease is on its way
        slots.release("acme", lease)
        await _until(lambda: not slots._tasks, 5, "the lease's removal")
        go.set()
        await _until(lambda: refreshes[0] >= 1, 5, "the refresh")
        async with aioredis.from_url(REDIS_URL) as shared:
            assert await shared.zscore(slots.key("acme"), lease) is None
    finally:
        await slots.close()


async def test_a_refresh_redis_runs_after_the_lease_was_given_back_does_not_add_it_back(
    redis_prefix: str,
) -> None:
    """The heartbeat's refresh timed out here (the client gave up on its reply) while it was still on
    its way to Redis, and the stream then ended: the lease was given back, then Redis ran the refresh.
    Refreshes add back leases Redis lost, so it added this one back, and the ended stream held its
    slot for `ttl_s` more (limit 1: the tenant's next stream refused meanwhile)."""
    slots = RedisSlots.from_url(REDIS_URL, prefix=redis_prefix, ttl_s=0.3)  # refreshed every 0.1 s
    refresh = slots._refresh
    late: list[dict[str, Any]] = []  # the refreshes sent whose replies never came

    async def timed_out(**kw: Any) -> Any:
        late.append(kw)
        raise RedisTimeoutError("Timeout reading from Redis")

    slots._refresh = timed_out  # type: ignore[assignment]
    try:
        lease = await slots.acquire("acme", 1)
        assert lease is not None
        slots.start()
        await _until(lambda: late, 5, "a refresh carrying the lease")
        slots.release("acme", lease)
        await _until(lambda: not slots._tasks, 5, "the lease's removal")
        await refresh(**late[0])  # only now does Redis run the refresh that timed out
        async with aioredis.from_url(REDIS_URL) as shared:
            assert await shared.zscore(slots.key("acme"), lease) is None, "the lease given back is back"
        assert await slots.acquire("acme", 1) is not None
    finally:
        await slots.close()
