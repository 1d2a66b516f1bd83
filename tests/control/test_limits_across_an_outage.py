"""Rate limits across a Redis outage: while Redis is away each replica counts in its own process,
starting from what Redis last said each window held (so the outage's first minute admits the limit
less what was used, per replica: docs/reliability.md), and what they counted meanwhile is added to
Redis once it answers, so the minute after the outage does not admit the limit again. The outage is
logged once, not on every retry."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.accounting.admission import Admission, Quotas, RateLimited
from gateway.accounting.pricing import PriceCatalog
from gateway.state.degradable import DegradableState
from gateway.state.redis import RedisState
from tests.control.events import usage_event
from tests.control.helpers import TcpProxy
from tests.fixtures.db import REDIS_PORT, REDIS_URL

pytestmark = pytest.mark.redis


async def admitted(admission: Admission, quotas: Quotas, n: int, tokens: int = 10) -> list[str]:
    ids = []
    for _ in range(n):
        request_id = uuid.uuid4().hex
        try:
            await admission.admit(request_id, quotas, "b", "m", prompt_tokens=tokens, max_output_tokens=0)
        except RateLimited:
            continue
        ids.append(request_id)
    return ids


async def window_total(client: aioredis.Redis, key: str) -> int:
    return int(await client.hget(key, "t") or 0)


async def test_what_a_replica_counted_while_redis_was_away_counts_in_redis_after(redis_prefix: str) -> None:
    proxy = TcpProxy(REDIS_PORT)  # Redis as replica A sees it: stop() plays an outage
    await proxy.start()
    a = DegradableState(
        RedisState(aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0"), prefix=redis_prefix), retry_s=0.02
    )
    b = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    client = aioredis.from_url(REDIS_URL)
    replicas = [Admission(state, lambda: PriceCatalog([])) for state in (a, b)]
    quotas = Quotas("t", None, tenant_rpm=10, tenant_tpm=10_000)
    try:
        before = await admitted(replicas[0], quotas, 3)
        assert len(before) == 3
        replicas[0].settle(usage_event(before[0], 4))  # estimated 10 tokens, used 4: settled in Redis
        await replicas[0].drain()
        await proxy.stop()
        during = await admitted(replicas[0], quotas, 12)
        # Counted here alone, from the 3 Redis held when A last asked it (it admitted 10 again).
        assert a.degraded and len(during) == 7
        # A request Redis counted before the outage settles during it: its correction is owed too.
        replicas[0].settle(usage_event(before[1], 2))
        replicas[0].settle(usage_event(during[0], 7))
        await replicas[0].drain()
        await proxy.start()
        async with asyncio.timeout(5):
            while a.degraded:  # the prober hands Redis what was counted here, then switches back
                await asyncio.sleep(0.01)
        assert await window_total(client, f"{redis_prefix}rpm:tenant:t") == 10
        assert await window_total(client, f"{redis_prefix}tpm:tenant:t") == 4 + 2 + 10 + 7 + 6 * 10
        # Redis knows the 10 requests of this minute: no replica admits more in it.
        assert await admitted(replicas[1], quotas, 5) == []
        assert await admitted(replicas[0], quotas, 5) == []
    finally:
        for replica in replicas:
            await replica.drain()
        await a.close()
        await b.close()
        await client.aclose()
        await proxy.stop()


async def test_a_replica_starts_an_outage_from_what_redis_last_said_its_windows_held(
    redis_prefix: str,
) -> None:
    """Each replica's fallback started empty: right after Redis went away it admitted a whole limit
    again, whatever every replica had used of it (R replicas: R x the limit on top)."""
    proxy = TcpProxy(REDIS_PORT)  # Redis as replica A sees it: stop() plays an outage
    await proxy.start()
    a = DegradableState(
        RedisState(aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0"), prefix=redis_prefix), retry_s=0.02
    )
    b = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    replica_a, replica_b = (Admission(state, lambda: PriceCatalog([])) for state in (a, b))
    quotas = Quotas("t", None, tenant_rpm=10, tenant_tpm=1_000)
    other = Quotas("u", None, tenant_rpm=10, tenant_tpm=1_000)
    try:
        assert len(await admitted(replica_b, quotas, 4)) == 4  # another replica's use
        assert len(await admitted(replica_a, quotas, 2)) == 2  # A last heard: 6 requests, 60 tokens
        assert len(await admitted(replica_b, other, 10)) == 10  # fills tenant u's minute
        assert await admitted(replica_a, other, 1) == []  # A last heard: u's window is full
        await proxy.stop()
        assert len(await admitted(replica_a, quotas, 12)) == 10 - 6
        assert a.degraded
        assert await admitted(replica_a, other, 3) == []
        # The token limit likewise: 1,000 - 6 x 10 - 4 x 10 tokens are left of tenant t's minute.
        wide = Quotas("t", None, tenant_rpm=100, tenant_tpm=1_000)
        assert len(await admitted(replica_a, wide, 2, tokens=460)) == 1
    finally:
        for replica in (replica_a, replica_b):
            await replica.drain()
        await a.close()
        await b.close()
        await proxy.stop()


async def test_a_lost_revocation_subscription_is_logged_once_and_comes_back(
    redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """It logged a warning with its traceback on every retry, every second per replica while Redis was
    away, where the limits' state says it once (DegradableState.lost)."""
    proxy = TcpProxy(REDIS_PORT)
    await proxy.start()
    state = RedisState(aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0"), prefix=redis_prefix)
    publisher = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    heard: list[str] = []
    caplog.set_level(logging.WARNING, logger="gateway.state.redis")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "revocation subscription" in r.getMessage()]

    try:
        await state.subscribe_revocations(heard.append)
        await proxy.stop()
        await asyncio.sleep(1.2)  # past the first retry (RESUBSCRIBE_S), which is warned of no more
        assert len(warnings()) == 1
        await proxy.start()
        async with asyncio.timeout(5):
            while not heard:  # published before it subscribed again, a revocation reaches no one
                await publisher.publish_revocation("k1")
                await asyncio.sleep(0.05)
        assert set(heard) == {"k1"}
        assert warnings() == [
            "revocation subscription lost; resubscribing until Redis answers",
            "revocation subscription restored",
        ]
    finally:
        await state.close()
        await publisher.close()
        await proxy.stop()
