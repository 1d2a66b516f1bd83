"""Admission leases: with large limits, replicas admit most requests from leases and pools counted in
Redis beforehand, without a round trip each; never more than a limit is admitted, and everything
leased but unused goes back, so the books end exactly as without leases."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.accounting.admission import Admission, Quotas, RateLimited, budget_key, month_of
from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.state.redis import RedisState
from tests.control.events import usage_event
from tests.fixtures.db import REDIS_URL

pytestmark = pytest.mark.redis

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
CATALOG = PriceCatalog(
    [
        PriceRow("*", "m", TokenClass.INPUT, 1_000_000, T0),  # 1 USD per 1M tokens
        PriceRow("*", "m", TokenClass.OUTPUT, 1_000_000, T0),
    ]
)


@pytest.fixture
async def replicas(redis_prefix: str) -> AsyncIterator[tuple[list[Admission], aioredis.Redis]]:
    """Two replicas: their own Redis connection and Admission each, one shared Redis namespace."""
    states = [RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix) for _ in range(2)]
    admissions = [Admission(s, lambda: CATALOG, leasing=True) for s in states]
    client = aioredis.from_url(REDIS_URL)
    yield admissions, client
    for admission in admissions:
        admission.release_leases()
        await admission.drain()
    for state in states:
        await state.close()
    await client.aclose()


def event(request_id: str, total_tokens: int) -> UsageEvent:
    return usage_event(request_id, total_tokens, total_tokens * 1_000_000)  # 1 micro-USD per token


async def admit(admission: Admission, quotas: Quotas) -> str | None:
    request_id = uuid.uuid4().hex
    try:
        await admission.admit(request_id, quotas, "b", "m", prompt_tokens=50, max_output_tokens=50)
    except RateLimited:
        return None
    return request_id


async def window_total(client: aioredis.Redis, key: str) -> int:
    fields = {k.decode(): int(v) for k, v in (await client.hgetall(key)).items()}
    fields.pop("lo", None)
    total = fields.pop("t", 0)
    assert total == sum(fields.values())
    return total


async def test_leases_admit_locally_and_the_books_end_exact(
    replicas: tuple[list[Admission], aioredis.Redis], redis_prefix: str
) -> None:
    admissions, client = replicas
    quotas = Quotas(
        "t", "k", tenant_rpm=100_000, tenant_tpm=10**8, tenant_budget_micro_usd=10**9, key_rpm=100_000
    )
    admitted: list[tuple[Admission, str]] = []
    for _ in range(10):  # waves of concurrent requests on both replicas
        ids = await asyncio.gather(*(admit(admissions[i % 2], quotas) for i in range(60)))
        admitted += [(admissions[i % 2], rid) for i, rid in enumerate(ids) if rid]
    assert len(admitted) == 600
    local = sum(a.local_admissions for a in admissions)
    assert local > 150  # a good share never waited for Redis (one lease per key and replica)
    # Leased units are counted in Redis already: the window holds at least what was admitted.
    assert await window_total(client, f"{redis_prefix}rpm:tenant:t") >= 600

    for admission, rid in admitted:  # every request used 40 tokens, i.e. 40 micro-USD
        admission.settle(event(rid, 40))
    for admission in admissions:
        admission.release_leases()
        await admission.drain()
    assert await window_total(client, f"{redis_prefix}rpm:tenant:t") == 600
    assert await window_total(client, f"{redis_prefix}rpm:key:k") == 600
    assert await window_total(client, f"{redis_prefix}tpm:tenant:t") == 600 * 40
    budget = redis_prefix + budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    spent, reserved = await client.hmget(budget, "spent", "reserved")
    assert int(spent) == 600 * 40 * 10**6 and int(reserved) == 0  # pico-USD
    assert await client.hlen(f"{budget}:res") == 0


async def test_never_more_than_the_limit_and_unused_leases_come_back(
    replicas: tuple[list[Admission], aioredis.Redis], redis_prefix: str
) -> None:
    admissions, client = replicas
    quotas = Quotas("t", None, tenant_rpm=1000)  # leases of up to 10 requests, only below 500 used
    first = []
    for _ in range(20):
        first += await asyncio.gather(*(admit(admissions[i % 2], quotas) for i in range(20)))
    assert all(first) and sum(a.local_admissions for a in admissions) > 100
    # A burst past the limit on one replica only; the other may hold a few unused leased units.
    burst = await asyncio.gather(*(admit(admissions[0], quotas) for _ in range(800)))
    admitted = 400 + sum(1 for rid in burst if rid)
    assert 1000 - 2 * 10 <= admitted <= 1000
    await asyncio.sleep(1.1)  # the leases' second is over: their unused units are handed back
    await admissions[1].drain()
    more = await asyncio.gather(*(admit(admissions[i % 2], quotas) for i in range(100)))
    assert admitted + sum(1 for rid in more if rid) == 1000  # exactly the limit, none lost
    assert await window_total(client, f"{redis_prefix}rpm:tenant:t") == 1000


async def test_small_limits_never_lease(replicas: tuple[list[Admission], aioredis.Redis]) -> None:
    admissions, _ = replicas
    quotas = Quotas("t", "k", tenant_rpm=60, key_rpm=90)
    ids = await asyncio.gather(*(admit(admissions[i % 2], quotas) for i in range(100)))
    assert sum(1 for rid in ids if rid) == 60
    assert all(a.local_admissions == 0 for a in admissions)
