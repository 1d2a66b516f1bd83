"""Shared state: the in-process and the Redis implementation pass the same tests; with Redis, limits
are exact across processes."""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
import sys
import textwrap

import pytest
import redis.asyncio as aioredis

from gateway.state import Adjustment, Budget, Limit, Settlement, SharedState
from gateway.state.redis import RedisState
from tests.fixtures.db import REDIS_URL


async def test_rpm_admits_exactly_the_limit_under_concurrency(state: SharedState) -> None:
    results = await asyncio.gather(*(state.acquire([Limit("rpm:tenant:t", 60)]) for _ in range(100)))
    admitted = [r for r in results if r.allowed]
    refused = [r for r in results if not r.allowed]
    assert len(admitted) == 60
    assert all(r.blocked_by == "rpm:tenant:t" and 0 < r.retry_after_s <= 60 for r in refused)


async def test_limits_count_all_or_none(state: SharedState) -> None:
    tenant, key = Limit("rpm:tenant:t", 10), Limit("rpm:key:k", 4)
    results = [await state.acquire([tenant, key]) for _ in range(6)]
    assert [r.allowed for r in results] == [True] * 4 + [False] * 2
    assert results[-1].blocked_by == "rpm:key:k"
    # The refused attempts did not use up the tenant's allowance: another key still gets 6.
    other = [await state.acquire([tenant, Limit("rpm:key:other", 100)]) for _ in range(7)]
    assert sum(r.allowed for r in other) == 6


async def test_window_slides_and_retry_after_is_honest(state: SharedState) -> None:
    limit = Limit("rpm:tenant:slide", 3, window_s=1.2)  # 20 ms buckets
    assert all([(await state.acquire([limit])).allowed for _ in range(3)])
    refused = await state.acquire([limit])
    assert not refused.allowed and 0 < refused.retry_after_s <= 1.2
    await asyncio.sleep(refused.retry_after_s + 0.05)
    assert (await state.acquire([limit])).allowed


async def test_token_limit_settles_estimate_to_actual(state: SharedState) -> None:
    tpm = Limit("tpm:tenant:t", 1000, cost=600)
    assert (await state.acquire([tpm])).allowed
    assert not (await state.acquire([tpm])).allowed  # 600 + 600 > 1000
    await state.adjust("tpm:tenant:t", 100 - 600)  # the request really used 100 tokens
    assert (await state.acquire([tpm])).allowed  # 100 + 600 <= 1000
    # A request bigger than the whole limit can never fit: told to wait a full window.
    huge = await state.acquire([Limit("tpm:tenant:t", 1000, cost=5000)])
    assert not huge.allowed and huge.retry_after_s == 60


async def test_a_correction_lands_in_the_bucket_it_names_or_nowhere(state: SharedState) -> None:
    """An admission says which bucket each limit was counted in; a correction sent there
    (`Adjustment.bucket`) changes that bucket while it is in the window, and nothing once it has
    left: the window never counts less than it holds."""
    window = 1.2  # 20 ms buckets
    first = await state.admit([Limit("tpm:tenant:b", 1000, 600, window_s=window)])
    assert first.allowed and len(first.buckets) == 1
    await state.settle([Adjustment("tpm:tenant:b", 100 - 600, window, first.buckets[0])])
    assert (await state.acquire([Limit("tpm:tenant:b", 1000, 900, window_s=window)])).allowed
    assert not (await state.acquire([Limit("tpm:tenant:b", 1000, 1, window_s=window)])).allowed
    await asyncio.sleep(window + 0.05)  # both buckets have left the window
    await state.settle([Adjustment("tpm:tenant:b", -100, window, first.buckets[0])])
    assert (await state.acquire([Limit("tpm:tenant:b", 1000, 1000, window_s=window)])).allowed
    assert not (await state.acquire([Limit("tpm:tenant:b", 1000, 1, window_s=window)])).allowed


async def test_budget_reservations_cap_concurrent_spend(state: SharedState) -> None:
    budget = Budget("budget:tenant:t:2026-11", limit_pico_usd=100)
    decisions = await asyncio.gather(*(state.budget_reserve([budget], 10) for _ in range(50)))
    granted = [d for d in decisions if d.allowed]
    assert len(granted) == 10  # in flight can never exceed the budget
    assert await state.budget_usage(budget.key) == (0, 100)
    for d in granted:  # each request really cost 5
        await state.budget_settle([budget.key], d.reservation_id, 5)
    assert await state.budget_usage(budget.key) == (50, 0)
    again = await asyncio.gather(*(state.budget_reserve([budget], 10) for _ in range(20)))
    assert sum(d.allowed for d in again) == 5
    refused = next(d for d in again if not d.allowed)
    assert refused.blocked_by == budget.key


async def test_settling_many_at_once_sums_per_key_and_reports_budgets(state: SharedState) -> None:
    tenant, key = Budget("budget:tenant:m:2026-11", 1_000), Budget("budget:key:m:2026-11", 1_000)
    tpm = Limit("tpm:tenant:m", 1_000, cost=100)
    held = [await state.admit([tpm], [tenant, key], 40) for _ in range(5)]
    assert all(d.allowed for d in held)
    settlements = [
        Settlement([Adjustment(tpm.key, -60)], [tenant.key, key.key], d.reservation_id or "", 7)
        for d in held[:4]
    ]
    settlements.append(Settlement([Adjustment(tpm.key, 25)], [tenant.key], "", 3))  # a later attempt
    usage = await state.settle_many(settlements)
    # Four of five reservations released, 4 x 7 + 3 spent; the key's budget did not get the 3.
    assert usage == {tenant.key: (31, 40), key.key: (28, 40)}
    assert await state.budget_usage(tenant.key) == (31, 40)
    # 500 counted, corrected by 4 x -60 + 25: 285 used, so 715 more fit and 716 do not.
    assert not (await state.admit([Limit(tpm.key, 1_000, cost=716)])).allowed
    assert (await state.admit([Limit(tpm.key, 1_000, cost=715)])).allowed
    assert await state.settle_many([]) == {}


async def test_budget_all_or_none_seed_and_expiry(state: SharedState) -> None:
    tenant = Budget("budget:tenant:t", 1_000)
    key = Budget("budget:key:k", 300)
    await state.budget_seed(tenant.key, 600)
    await state.budget_seed(tenant.key, 0)  # a second replica's seed does not reset it
    assert await state.budget_usage(tenant.key) == (600, 0)
    assert (await state.budget_reserve([tenant, key], 300)).allowed
    refused = await state.budget_reserve([tenant, key], 200)
    assert not refused.allowed and refused.blocked_by == tenant.key
    assert (await state.budget_usage(key.key))[1] == 300  # the refused one reserved nothing
    # A reservation that is never settled (a crashed replica) expires.
    await state.budget_reserve([Budget("budget:tenant:e", 100)], 100, ttl_s=0.2)
    assert not (await state.budget_reserve([Budget("budget:tenant:e", 100)], 1)).allowed
    await asyncio.sleep(0.3)
    assert (await state.budget_reserve([Budget("budget:tenant:e", 100)], 100)).allowed


async def test_a_budget_its_caller_seeded_but_the_state_does_not_hold_is_refused_as_unseeded(
    state: SharedState,
) -> None:
    """A state that holds no seed for a budget its caller seeded has lost it (Redis restarted empty,
    failed over, evicted the key): it says which, counts nothing, and a seed then adds the ledger's
    spend to what was settled meanwhile."""
    rpm = Limit("rpm:tenant:u", 10)
    tenant, key = Budget("budget:tenant:u", 1_000, seeded=True), Budget("budget:key:u", 1_000, seeded=True)
    await state.budget_seed(key.key, 100)
    await state.budget_settle([tenant.key], "", 7)  # an attempt admitted before the loss settles after it
    refused = await state.admit([rpm], [tenant, key], 50)
    assert not refused.allowed and refused.unseeded == (tenant.key,)
    assert await state.budget_usage(tenant.key) == (7, 0)  # nothing reserved
    assert (await state.admit([Limit(rpm.key, 10, cost=10)])).allowed  # nor counted: 10 of 10 fit
    await state.budget_seed(tenant.key, 600)
    await state.budget_seed(tenant.key, 0)  # another replica's seed after it changes nothing
    assert await state.budget_usage(tenant.key) == (607, 0)
    assert (await state.admit([], [tenant, key], 50)).allowed
    assert await state.budget_usage(tenant.key) == (607, 50)


async def test_a_seed_counts_once_the_attempts_settled_before_it_that_the_ledger_holds_too(
    state: SharedState,
) -> None:
    """Attempts settled on a budget that holds no seed (lost, or not seeded yet) stay counted by the
    seed; those whose usage events reached the ledger by then are in the ledger's spend as well, and
    count once. One settled between reading them and seeding (another replica's) may be in the
    ledger's spend too, unchecked: the seed changes nothing and says to read both again."""
    budget = "budget:tenant:s"
    await state.settle_many([Settlement((), [budget], actual_pico_usd=7, event_id="e1")])
    await state.settle_many([Settlement((), [budget], actual_pico_usd=5, event_id="e2")])
    assert sorted(await state.budget_unseeded(budget)) == ["e1", "e2"]
    await state.settle_many([Settlement((), [budget], actual_pico_usd=3, event_id="e3")])  # meanwhile
    assert not await state.budget_seed(budget, 600, ["e1", "e2"], ["e1"])
    assert await state.budget_usage(budget) == (15, 0)
    unseeded = await state.budget_unseeded(budget)
    assert sorted(unseeded) == ["e1", "e2", "e3"]
    # The ledger's USD 600 holds e1 and e3: e2 alone is added to it.
    assert await state.budget_seed(budget, 600, unseeded, ["e1", "e3"])
    assert await state.budget_usage(budget) == (605, 0)
    assert await state.budget_seed(budget, 0)  # another replica's seed after it changes nothing
    # Seeded: attempts count as before, and are no longer remembered.
    await state.settle_many([Settlement((), [budget], actual_pico_usd=4, event_id="e4")])
    assert await state.budget_usage(budget) == (609, 0)
    assert await state.budget_unseeded(budget) == []


@pytest.mark.redis
async def test_budget_counters_in_redis_stay_exact_past_what_a_lua_number_holds(redis_prefix: str) -> None:
    """Budgets count pico-dollars: a large month passes 2^53 (about USD 9,007), beyond which a Lua
    number (a double) is no longer exact. Redis adds every amount as an integer, and `spent`,
    `reserved` and pools come back as they are held, to the pico-dollar."""
    state = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    big = 2**53 + 1  # the first integer a double cannot hold
    budget = Budget("budget:pico:tenant:t:2026-11", 2**62, pool_pico_usd=big)
    try:
        await state.budget_seed(budget.key, 2**60 + 1)
        decision = await state.admit([], [budget], big)
        assert decision.allowed and decision.spent == (2**60 + 1,) and decision.pools == (big,)
        assert await state.budget_usage(budget.key) == (2**60 + 1, 2 * big)
        rid = decision.reservation_id or ""
        usage = await state.settle_many(
            [Settlement((), [budget.key], actual_pico_usd=big, releases=[(rid, big)])]
        )
        assert usage == {budget.key: (2**60 + 1 + big, big)}  # the pool's part still held
        usage = await state.settle_many([Settlement((), [budget.key], rid, actual_pico_usd=big)])
        assert usage == {budget.key: (2**60 + 1 + 2 * big, 0)}
        assert await state.budget_usage(budget.key) == (2**60 + 1 + 2 * big, 0)
    finally:
        await state.close()


async def test_compare_and_set(state: SharedState) -> None:
    assert await state.kv_get("breaker:b1") is None
    assert await state.kv_compare_and_set("breaker:b1", None, b"open")
    assert not await state.kv_compare_and_set("breaker:b1", None, b"closed")
    assert await state.kv_compare_and_set("breaker:b1", b"open", b"half-open", ttl_s=0.2)
    assert await state.kv_get("breaker:b1") == b"half-open"
    await asyncio.sleep(0.3)
    assert await state.kv_get("breaker:b1") is None


async def test_set_if_absent_is_one_claim_that_lapses(state: SharedState) -> None:
    assert await state.kv_set_if_absent("trial:b1", b"a", 0.3) == (True, 0.3)
    claimed, left = await state.kv_set_if_absent("trial:b1", b"b", 0.3)
    assert not claimed and 0 < left <= 0.3  # what the holder's claim has left
    assert await state.kv_get("trial:b1") == b"a"
    await asyncio.sleep(left + 0.05)
    assert (await state.kv_set_if_absent("trial:b1", b"b", 0.3))[0]
    await state.kv_set("trial:b2", b"kept")
    assert await state.kv_set_if_absent("trial:b2", b"b", 0.3) == (False, math.inf)


async def test_many_keys_in_one_call(state: SharedState) -> None:
    await state.kv_set_many({"affinity:a": b"r1", "affinity:b": b"r2"}, ttl_s=0.2)
    await state.kv_set_many({"affinity:c": b"r3"})
    assert await state.kv_get_many(["affinity:b", "affinity:x", "affinity:a"]) == [b"r2", None, b"r1"]
    await asyncio.sleep(0.3)
    assert await state.kv_get_many(["affinity:a", "affinity:b", "affinity:c"]) == [None, None, b"r3"]


async def test_revocation_reaches_every_subscriber(state: SharedState) -> None:
    seen: list[str] = []
    got = asyncio.Event()

    async def on_revoke(key_hash: str) -> None:
        seen.append(key_hash)
        got.set()

    await state.subscribe_revocations(on_revoke)
    await state.publish_revocation("abc123")
    await asyncio.wait_for(got.wait(), 5)
    assert seen == ["abc123"]


@pytest.mark.redis
async def test_revocation_crosses_replicas(redis_prefix: str) -> None:
    a = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    b = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    got = asyncio.Event()
    seen: list[str] = []

    def on_revoke(key_hash: str) -> None:
        seen.append(key_hash)
        got.set()

    await b.subscribe_revocations(on_revoke)
    await a.publish_revocation("deadbeef")
    await asyncio.wait_for(got.wait(), 5)
    assert seen == ["deadbeef"]
    await a.close()
    await b.close()


WORKER = textwrap.dedent(
    """
    import asyncio, sys
    import redis.asyncio as aioredis
    from gateway.state import Limit
    from gateway.state.redis import RedisState

    async def main() -> None:
        state = RedisState(aioredis.from_url(sys.argv[1]), prefix=sys.argv[2])
        results = await asyncio.gather(*(state.acquire([Limit("rpm:tenant:shared", 60)]) for _ in range(100)))
        print(sum(r.allowed for r in results))
        await state.close()

    asyncio.run(main())
    """
)


@pytest.mark.redis
def test_redis_limit_is_exact_across_processes(redis_prefix: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, REDIS_URL, redis_prefix], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    counts = [int(p.communicate(timeout=60)[0].strip()) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(counts) == 60, counts


@pytest.mark.redis
async def test_redis_window_total_stays_the_sum_of_its_live_buckets(redis_prefix: str) -> None:
    """Admission keeps a running total per limit instead of summing every bucket each time; under a
    random mix of admissions and corrections over several windows it must equal the bucket sum, and
    a hash written before totals were kept (buckets only) must still be counted in full."""
    client = aioredis.from_url(REDIS_URL)
    state = RedisState(client, prefix=redis_prefix)
    rng = random.Random(7)
    window_s, key = 0.3, f"{redis_prefix}tpm:tenant:mix"  # 5 ms buckets
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        admitted = 0
        while loop.time() < deadline:
            decision = await state.admit(
                [Limit("tpm:tenant:mix", 400, cost=rng.randint(1, 40), window_s=window_s)]
            )
            admitted += decision.allowed
            if rng.random() < 0.5:
                await state.adjust("tpm:tenant:mix", rng.randint(-20, 20), window_s=window_s)
            fields = {k.decode(): int(v) for k, v in (await client.hgetall(key)).items()}
            lo, total = fields.pop("lo"), fields.pop("t")
            assert all(int(index) >= lo for index in fields)  # nothing older than `lo` is left
            assert total == sum(fields.values())
            await asyncio.sleep(rng.choice([0, 0, 0.002, 0.02]))
        assert admitted > 20

        # The layout before running totals: bucket fields only. 390 counted; 11 more do not fit.
        legacy = f"{redis_prefix}rpm:tenant:legacy"
        now_s = (await client.time())[0]
        await client.hset(legacy, mapping={str(now_s - 1): 200, str(now_s): 190, str(now_s - 90): 500})
        refused = await state.admit([Limit("rpm:tenant:legacy", 400, cost=11)])
        assert not refused.allowed and 0 < refused.retry_after_s <= 60
        assert (await state.admit([Limit("rpm:tenant:legacy", 400, cost=10)])).allowed
        assert int(await client.hget(legacy, "t")) == 400
        assert await client.hget(legacy, str(now_s - 90)) is None  # expired long ago: removed
    finally:
        await state.close()


@pytest.mark.redis
async def test_redis_state_reloads_its_scripts_and_counts_once(redis_prefix: str) -> None:
    """Scripts are called by hash alone (no SCRIPT EXISTS round trip per batch); after Redis lost
    its script cache (a restart, SCRIPT FLUSH) the refused calls are loaded and run once."""
    client = aioredis.from_url(REDIS_URL)
    state = RedisState(client, prefix=redis_prefix)
    try:
        limit = Limit("rpm:tenant:reload", 5)
        assert (await state.admit([limit])).allowed
        await client.script_flush()
        decisions = await asyncio.gather(*(state.admit([limit]) for _ in range(6)))
        assert sum(d.allowed for d in decisions) == 4  # one counted before, four now, never twice
        assert int(await client.hget(f"{redis_prefix}rpm:tenant:reload", "t")) == 5
    finally:
        await state.close()


async def test_live_replicas_are_those_that_announced_within_their_ttl(state: SharedState) -> None:
    """What the outage fallback shares limits among (gateway.state.degradable): a replica counts
    until its announcement lapses, or until it says it left."""
    assert await state.announce_replica("a", 60.0) == 1
    assert await state.announce_replica("b", 60.0) == 2
    assert await state.announce_replica("a", 60.0) == 2  # again: the same replica
    assert await state.announce_replica("brief", 0.05) == 3
    await asyncio.sleep(0.1)
    assert await state.announce_replica("a", 60.0) == 2  # "brief" lapsed (stopped or crashed)
    await state.replica_left("b")
    assert await state.announce_replica("a", 60.0) == 1
