"""Token limits settle where they counted: a request's TPM estimate is counted in the bucket it was
admitted in, and what it was over by is given back in that bucket (not at all once it has left the
window); tokens beyond the estimate count when they are known. So a request that ran longer than the
window cannot free room it never held, in process or in Redis, admitted there or from a lease."""

from __future__ import annotations

import asyncio
import functools
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.accounting import admission as admission_module
from gateway.accounting.admission import Admission, Quotas, RateLimited
from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import PriceCatalog
from gateway.state import Adjustment, Limit, MemoryState
from gateway.state.base import BUCKETS
from gateway.state.redis import RedisState
from tests.control.events import usage_event
from tests.fixtures.db import REDIS_URL

QUOTAS = Quotas("t", None, tenant_tpm=10_000)
WINDOW_S = 1.2  # the Redis tests' limit window: 20 ms buckets, so they wait seconds, not minutes


def event(request_id: str, tokens: int, status: int = 200) -> UsageEvent:
    return usage_event(request_id, tokens, status=status)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(MemoryState, "_now", staticmethod(clock))
    return clock


async def admit_9000(admission: Admission, request_id: str) -> None:
    await admission.admit(request_id, QUOTAS, "b", "m", prompt_tokens=100, max_output_tokens=8_900)


async def test_a_request_longer_than_the_window_frees_no_room_it_never_took(clock: Clock) -> None:
    """docs/accounting.md: "no minute ever admits more than the limit". A 70 s request estimated at
    9,000 tokens that used 100: its estimate left the window before its usage arrived, so its
    correction (-8,900) must go nowhere. Taken from the bucket current at settlement, it let the
    next minute admit two more such requests, 18,000 tokens against a limit of 10,000."""
    admission = Admission(MemoryState(), PriceCatalog)
    await admit_9000(admission, "long")
    clock.now += 70
    admission.settle(event("long", 100))
    admission.finish("long")

    clock.now += 1
    await admit_9000(admission, "a")
    with pytest.raises(RateLimited):
        await admit_9000(admission, "b")


async def test_a_correction_within_the_window_leaves_with_the_estimate(clock: Clock) -> None:
    """A 30 s request (estimated at 9,000, used 100) gives back 8,900 in the bucket its estimate was
    counted in, so both leave the window together 60 s after admission. Given back in the bucket of
    its settlement, the -8,900 stayed 30 s longer than the 9,000 it corrected, and from 60 s the
    window counted 8,900 fewer tokens than it held: at 61 s it admitted 9,000 more beside the 9,900
    admitted 31 s before."""
    admission = Admission(MemoryState(), PriceCatalog)
    await admit_9000(admission, "slow")
    clock.now += 30
    admission.settle(event("slow", 100))
    admission.finish("slow")
    await admission.admit("small", QUOTAS, "b", "m", prompt_tokens=100, max_output_tokens=9_800)
    with pytest.raises(RateLimited):  # 100 + 9,900 counted: the limit, exactly
        await admission.admit("one", QUOTAS, "b", "m", prompt_tokens=1, max_output_tokens=0)

    clock.now += 31  # "slow"'s bucket has left the window; "small"'s (30 s old) has not
    with pytest.raises(RateLimited):
        await admit_9000(admission, "a")
    clock.now += 30  # "small"'s has left too
    await admit_9000(admission, "a")
    with pytest.raises(RateLimited):
        await admit_9000(admission, "b")


async def test_tokens_beyond_the_estimate_count_when_they_are_known(clock: Clock) -> None:
    """A 70 s request estimated at 1,000 tokens that used 5,000 (a prompt longer than its estimate):
    its estimate's bucket has left the window, and the 4,000 beyond it count in the current bucket,
    for a full window from now (dropped with the estimate's bucket, they would not count at all)."""
    admission = Admission(MemoryState(), PriceCatalog)
    await admission.admit("long", QUOTAS, "b", "m", prompt_tokens=500, max_output_tokens=500)
    clock.now += 70
    admission.settle(event("long", 5_000))
    admission.finish("long")
    clock.now += 59
    await admission.admit("a", QUOTAS, "b", "m", prompt_tokens=100, max_output_tokens=5_900)  # 10,000
    with pytest.raises(RateLimited):
        await admission.admit("b", QUOTAS, "b", "m", prompt_tokens=1, max_output_tokens=0)
    clock.now += 2  # the 4,000 have left
    await admission.admit("b", QUOTAS, "b", "m", prompt_tokens=100, max_output_tokens=3_900)


async def test_an_exchange_that_ends_failed_gives_its_estimate_back_where_it_counted(clock: Clock) -> None:
    """A request whose only attempt failed after 70 s (200 tokens used) holds its estimate until the
    exchange ends; `finish` then gives the estimate back, to its own bucket, long gone: nothing.
    Given back to the current bucket, -9,000 made room for 18,000 tokens in the next minute."""
    admission = Admission(MemoryState(), PriceCatalog)
    await admit_9000(admission, "failed")
    clock.now += 70
    admission.settle(event("failed", 200, status=502))
    admission.finish("failed")
    await admission.admit("a", QUOTAS, "b", "m", prompt_tokens=100, max_output_tokens=9_700)  # + 200
    with pytest.raises(RateLimited):
        await admission.admit("b", QUOTAS, "b", "m", prompt_tokens=1, max_output_tokens=0)


def short_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission's limits and corrections on WINDOW_S windows (as `functools.partial`, except that a
    lease handed back passes its window positionally)."""

    def adjustment(key: str, delta: int, window_s: float = WINDOW_S, bucket: int | None = None) -> Adjustment:
        return Adjustment(key, delta, window_s, bucket)

    monkeypatch.setattr(admission_module, "Limit", functools.partial(Limit, window_s=WINDOW_S))
    monkeypatch.setattr(admission_module, "Adjustment", adjustment)


async def live_total(client: aioredis.Redis, key: str) -> int:
    """What a limit's Redis window counts now: its buckets still in the window, by Redis's clock."""
    seconds, micros = await client.time()
    current = (seconds * 1000 + micros // 1000) // int(WINDOW_S * 1000 / BUCKETS)
    fields = {k.decode(): int(v) for k, v in (await client.hgetall(key)).items()}
    return sum(v for k, v in fields.items() if k not in ("t", "lo") and int(k) > current - BUCKETS)


@pytest.mark.redis
async def test_across_replicas_a_long_request_frees_no_room_it_never_took(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with Redis: replica A's request settles after its estimate left the window; replica
    B then admits no more than the limit (the SETTLE script added the correction to Redis's current
    bucket)."""
    short_windows(monkeypatch)
    states = [RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix) for _ in range(2)]
    a, b = (Admission(s, PriceCatalog) for s in states)
    try:
        await admit_9000(a, "long")
        await asyncio.sleep(WINDOW_S + 0.1)  # the request runs longer than the window
        a.settle(event("long", 100))
        await a.drain()
        await admit_9000(b, "x")
        with pytest.raises(RateLimited):
            await admit_9000(b, "y")
    finally:
        for state in states:
            await state.close()


@pytest.mark.redis
async def test_requests_admitted_from_a_lease_settle_where_the_lease_counted(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With leases, a request admitted from one was counted in the lease's bucket; settled after
    that left the window, its correction goes nowhere, as a request's that Redis admitted itself.
    In the end the window counts nothing, not less than nothing."""
    short_windows(monkeypatch)
    state = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    admission = Admission(state, PriceCatalog, leasing=True)
    client = aioredis.from_url(REDIS_URL)
    quotas = Quotas("t", None, tenant_tpm=10**6)  # leases of 32 requests of 100 tokens
    admitted: list[str] = []
    try:
        for _ in range(20):  # until a wave is admitted from a lease (a bucket may end mid-wave)
            ids = [uuid.uuid4().hex for _ in range(8)]
            await asyncio.gather(
                *(
                    admission.admit(rid, quotas, "b", "m", prompt_tokens=50, max_output_tokens=50)
                    for rid in ids
                )
            )
            admitted += ids
            if admission.local_admissions:
                break
        assert admission.local_admissions
        await asyncio.sleep(WINDOW_S + 0.1)
        for rid in admitted:
            admission.settle(event(rid, 10))  # 90 fewer than the estimate each
        admission.release_leases()
        await admission.drain()
        assert await live_total(client, f"{redis_prefix}tpm:tenant:t") == 0
    finally:
        admission.release_leases()
        await admission.drain()
        await state.close()
        await client.aclose()
