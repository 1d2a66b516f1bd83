"""Rate limits and budgets across a Redis outage: while Redis is away each replica counts in its own
process, starting from what Redis last said each window held (and each budget's spend), and admits its
share of each limit (1/R, R the live replicas it last counted in Redis) and of what was left of each
budget, so the outage's first minute admits about the limit less what was used across the replicas,
and the replicas together spend about what was left of a budget: docs/reliability.md. What they counted meanwhile is added to Redis once
it answers, so the minute after the outage does not admit the limit again. The outage is logged once,
not on every retry."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.accounting.admission import Admission, BudgetUnconfirmed, QuotaExceeded, Quotas, RateLimited
from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.admin import control_plane
from gateway.config import ConfigError, parse_config
from gateway.state.degradable import DegradableState
from gateway.state.redis import RedisState
from tests.control.events import usage_event
from tests.control.helpers import TcpProxy
from tests.fixtures.db import REDIS_PORT, REDIS_URL, migrated_sqlite

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


async def counted(states: list[DegradableState], live: int) -> None:
    """Until each of `states` has counted `live` replicas in Redis (they announce every 0.05 s)."""
    async with asyncio.timeout(5):
        while any(state.replicas != live for state in states):
            await asyncio.sleep(0.01)


def behind_proxy(proxy: TcpProxy, prefix: str) -> DegradableState:
    client = aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0")
    return DegradableState(RedisState(client, prefix=prefix), retry_s=0.02, announce_s=0.05)


@contextlib.asynccontextmanager
async def two_replicas(
    prefix: str, prices: PriceCatalog
) -> AsyncIterator[tuple[list[TcpProxy], list[DegradableState], tuple[Admission, Admission]]]:
    """Two replicas, each reaching Redis through a proxy of its own (stop() plays an outage for it),
    both announcing themselves, and counted by both (R = 2)."""
    proxies = [TcpProxy(REDIS_PORT), TcpProxy(REDIS_PORT)]
    for proxy in proxies:
        await proxy.start()
    states = [behind_proxy(proxy, prefix) for proxy in proxies]
    replicas = (Admission(states[0], lambda: prices), Admission(states[1], lambda: prices))
    try:
        for state in states:
            state.start()
        await counted(states, 2)
        yield proxies, states, replicas
    finally:
        for replica in replicas:
            await replica.drain()
        for state in states:
            await state.close()
        for proxy in proxies:
            await proxy.stop()


async def test_replicas_share_what_is_left_of_a_limit_while_redis_is_away(redis_prefix: str) -> None:
    """Each replica's fallback admitted all that was left of a limit on its own: two replicas twice
    the remainder, and a whole limit each of one never asked about (R x the limit)."""
    quotas = Quotas("t", None, tenant_rpm=10, tenant_tpm=10_000)
    unseen = Quotas("u", None, tenant_rpm=10, tenant_tpm=10_000)
    async with two_replicas(redis_prefix, PriceCatalog([])) as (proxies, states, (replica_a, replica_b)):
        assert len(await admitted(replica_a, quotas, 5)) == 5  # A last heard: 5 of 10 used
        assert len(await admitted(replica_b, quotas, 1)) == 1  # B last heard: 6
        for proxy in proxies:
            await proxy.stop()
        during = [await admitted(replica, quotas, 10) for replica in (replica_a, replica_b)]
        assert all(state.degraded for state in states)
        # Half of the limit each, less half of what it last heard was used (rounded up): 5 - 3 each.
        assert [len(ids) for ids in during] == [2, 2]  # 4 left of the minute: not 4 + 5
        # A limit neither asked Redis about: half of it each, not all of it each.
        assert [len(await admitted(replica, unseen, 10)) for replica in (replica_a, replica_b)] == [5, 5]
        # The rate-limit headers say what this replica has left of its share.
        headers = await replica_a.admit(
            uuid.uuid4().hex, Quotas("v", None, tenant_rpm=10), "b", "m", prompt_tokens=1, max_output_tokens=0
        )
        assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == (
            "10",
            "4",
        )


async def test_a_replica_counts_the_live_replicas_in_redis(redis_prefix: str) -> None:
    """Every replica says it is alive every `announce_s` and counts those that did within three of
    them: one that stops leaves the count at once, one cut off from Redis once it lapses. While Redis
    is away the count of when it went holds."""
    proxy = TcpProxy(REDIS_PORT)
    await proxy.start()
    cut_off = behind_proxy(proxy, redis_prefix)
    others = [
        DegradableState(RedisState.from_url(REDIS_URL, prefix=redis_prefix), announce_s=0.05) for _ in "ab"
    ]
    states = [cut_off, *others]
    try:
        for state in states:
            state.start()
        await counted(states, 3)
        await others[1].close()
        await counted([cut_off, others[0]], 2)
        await proxy.stop()
        await counted(others[:1], 1)  # its announcements lapsed (3 x 0.05 s)
        assert cut_off.degraded and cut_off.replicas == 2
    finally:
        for state in states:
            await state.close()
        await proxy.stop()


async def test_a_replica_that_starts_during_an_outage_shares_limits_by_the_configs_hint(
    redis_prefix: str,
) -> None:
    """Before it has counted the replicas in Redis, a replica knows only what the config says
    (`replicas:`): it admits that share of each limit, where it knew of no replica but itself."""
    proxy = TcpProxy(REDIS_PORT)  # never started: Redis is away from the first call
    hinted = DegradableState(
        RedisState(aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0"), prefix=redis_prefix),
        retry_s=0.02,
        replicas=parse_config("replicas: 4\n", {}).replicas,
    )
    replica = Admission(hinted, lambda: PriceCatalog([]))
    try:
        hinted.start()
        assert len(await admitted(replica, Quotas("t", None, tenant_rpm=8, tenant_tpm=10_000), 8)) == 2
        assert hinted.degraded and hinted.replicas == 4
    finally:
        await replica.drain()
        await hinted.close()
    with pytest.raises(ConfigError):
        parse_config("replicas: 0\n", {})


async def test_a_gateway_shares_limits_by_the_configs_hint_until_it_has_counted_the_replicas(
    sqlite_url: str, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEIR_DATABASE_URL", raising=False)
    monkeypatch.delenv("WEIR_REDIS_URL", raising=False)
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    text = f"database_url: {migrated_sqlite(sqlite_url)}\nredis_url: {REDIS_URL}\nreplicas: 3\n"
    control = control_plane.from_config(parse_config(text, {}))
    assert control is not None and isinstance(control.state, DegradableState)
    assert control.state.replicas == 3  # the hint, until counted
    await control.start()
    try:
        async with asyncio.timeout(5):
            while control.state.replicas != 1:  # the only replica in this namespace
                await asyncio.sleep(0.01)
    finally:
        await control.stop()


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


# USD 1 per 1M input tokens: a request of 100 prompt tokens costs USD 0.0001 (100 micro-dollars).
MICRO_PER_TOKEN = PriceCatalog(
    [
        PriceRow("*", "m", TokenClass.INPUT, 10**6, dt.datetime(2026, 1, 1, tzinfo=dt.UTC)),
        PriceRow("*", "m", TokenClass.OUTPUT, 0, dt.datetime(2026, 1, 1, tzinfo=dt.UTC)),
    ]
)
BUDGETED = Quotas("t", None, tenant_budget_micro_usd=1_000)  # ten requests of 100 tokens


async def spent(admission: Admission, n: int, tokens: int = 100) -> int:
    """Requests of `tokens` prompt tokens admitted and settled at their estimate, of `n` asked, until
    the first refusal."""
    for i in range(n):
        request_id = uuid.uuid4().hex
        try:
            await admission.admit(request_id, BUDGETED, "b", "m", prompt_tokens=tokens, max_output_tokens=0)
        except (QuotaExceeded, BudgetUnconfirmed):
            return i
        admission.settle(usage_event(request_id, cost_pico_usd=tokens * 10**6))
        admission.finish(request_id)
        await admission.drain()
    return n


async def refusal_of(admission: Admission, tokens: int) -> Exception:
    with pytest.raises((QuotaExceeded, BudgetUnconfirmed)) as refused:
        await admission.admit(uuid.uuid4().hex, BUDGETED, "b", "m", prompt_tokens=tokens, max_output_tokens=0)
    return refused.value


async def test_replicas_share_what_is_left_of_a_budget_while_redis_is_away(redis_prefix: str) -> None:
    """Each replica's fallback let it spend all that was left of a budget on its own: two replicas
    twice the remainder. Each now spends what Redis last said was spent plus half of what was left
    then; a request its share refuses but the budget still has room for is a 429 to retry (another
    replica may take it), not `insufficient_quota`, which clients do not retry."""
    async with two_replicas(redis_prefix, MICRO_PER_TOKEN) as (proxies, states, (replica_a, replica_b)):
        assert await spent(replica_a, 2) == 2  # A last heard: 200 of 1,000 micro-dollars spent
        assert await spent(replica_b, 1) == 1  # B last heard: 300
        for proxy in proxies:
            await proxy.stop()
        # A: 200 + 800 / 2 = 600, four requests more; B: 300 + 700 / 2 = 650, three more.
        during = [await spent(replica, 10) for replica in (replica_a, replica_b)]
        assert all(state.degraded for state in states)
        assert during == [4, 3]  # 300 + 700 spent in all: the budget, not 300 + 700 + 800
        # A has spent its share; the budget has 400 left as far as A knows.
        unconfirmed = await refusal_of(replica_a, 100)
        assert isinstance(unconfirmed, BudgetUnconfirmed)
        assert (unconfirmed.status, unconfirmed.code) == (429, "budget_unconfirmed")
        assert unconfirmed.headers["retry-after"] == "2" and "x-should-retry" not in unconfirmed.headers
        assert "cannot be confirmed" in unconfirmed.message
        # More than what is left of the whole budget: over budget, as with Redis.
        over = await refusal_of(replica_a, 500)
        assert isinstance(over, QuotaExceeded) and over.code == "insufficient_quota"
        assert over.headers["x-should-retry"] == "false"  # spent, as far as A knows: for good


@contextlib.asynccontextmanager
async def _lone_replica(redis_prefix: str) -> AsyncIterator[tuple[TcpProxy, DegradableState, Admission]]:
    """One replica whose Redis is behind a proxy the test can stop, its state counted and started."""
    proxy = TcpProxy(REDIS_PORT)
    await proxy.start()
    state = behind_proxy(proxy, redis_prefix)
    replica = Admission(state, lambda: MICRO_PER_TOKEN)
    try:
        state.start()
        await counted([state], 1)
        yield proxy, state, replica
    finally:
        await replica.drain()
        await state.close()
        await proxy.stop()


async def test_a_lone_replica_spends_what_is_left_of_a_budget_while_redis_is_away(redis_prefix: str) -> None:
    """One replica (R = 1) spends all that was left, then refuses as over budget, as before."""
    async with _lone_replica(redis_prefix) as (proxy, state, replica):
        assert await spent(replica, 3) == 3
        await proxy.stop()
        assert await spent(replica, 10) == 7
        assert state.degraded
        assert isinstance(await refusal_of(replica, 100), QuotaExceeded)


async def test_a_request_admitted_in_an_outage_and_settled_after_it_holds_nothing_in_the_next(
    redis_prefix: str,
) -> None:
    """A request the fallback admitted while Redis was away, and that finished once Redis was back,
    settled in Redis alone: its spend reached Redis (and the fallback learns it from there), but the
    fallback kept its reservation for the reservation's TTL (10 minutes). A second outage within them
    started with that money held on top of its spend: counted twice, and the tenant refused early."""
    async with _lone_replica(redis_prefix) as (proxy, state, replica):
        assert await spent(replica, 3) == 3  # 300 of 1,000 micro-dollars
        await proxy.stop()
        straddling = uuid.uuid4().hex
        await replica.admit(straddling, BUDGETED, "b", "m", prompt_tokens=100, max_output_tokens=0)
        assert state.degraded
        await proxy.start()
        async with asyncio.timeout(5):
            while state.degraded:
                await asyncio.sleep(0.01)
        replica.settle(usage_event(straddling, cost_pico_usd=100 * 10**6))  # 400 spent, in Redis
        replica.finish(straddling)
        await replica.drain()
        await proxy.stop()
        assert await spent(replica, 10) == 6  # the 600 left, not 500
        assert state.degraded


class LateRedis(TcpProxy):
    """127.0.0.1:<port> -> Redis, whose answers come `delay` seconds late while it is set: Redis runs
    each call at once, and its caller gives up before the answer comes."""

    delay = 0.0

    async def forward(self, data: bytes, dst: asyncio.StreamWriter, upstream: bool) -> None:
        if not upstream and self.delay:
            await asyncio.sleep(self.delay)
        await super().forward(data, dst, upstream)


@pytest.mark.parametrize("settled", ["during", "after"])
async def test_an_admission_whose_answer_redis_lost_counts_once_and_holds_nothing_after(
    redis_prefix: str, settled: str
) -> None:
    """Redis ran the admission, and its answer came after the caller's timeout: the fallback admitted
    the request again, under a reservation id of its own. Redis kept its reservation until it
    expired (10 minutes) on top of the request's spend, and the fallback's count of the request was
    added to Redis's own once Redis answered: the request counted twice on RPM. Now both sides hold
    it under one id, released on both when it settles (during the outage or after it), and Redis's
    mark of the admission keeps its units from being owed to it again."""
    proxy = LateRedis(REDIS_PORT)
    await proxy.start()
    client = aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0")
    state = DegradableState(RedisState(client, prefix=redis_prefix), timeout_s=0.2, retry_s=0.02)
    replica = Admission(state, lambda: MICRO_PER_TOKEN)
    direct = aioredis.from_url(REDIS_URL)
    quotas = Quotas("t", None, tenant_rpm=10, tenant_budget_micro_usd=1_000)
    budget = f"{redis_prefix}budget:pico:tenant:t:{dt.datetime.now(dt.UTC):%Y-%m}"

    async def back() -> None:
        proxy.delay = 0.0
        async with asyncio.timeout(5):
            while state.degraded:  # the prober hands Redis what was counted here, then switches back
                await asyncio.sleep(0.01)

    try:
        # Redis has the scripts (an unknown one's answer, NOSCRIPT, is a call that did not run).
        warm = Quotas("warm", None, tenant_rpm=10, tenant_budget_micro_usd=1_000)
        await replica.admit(uuid.uuid4().hex, warm, "b", "m", prompt_tokens=1, max_output_tokens=0)
        proxy.delay = 0.5
        request_id = uuid.uuid4().hex
        await replica.admit(request_id, quotas, "b", "m", prompt_tokens=100, max_output_tokens=0)
        assert state.degraded  # admitted by the fallback; Redis ran it too
        if settled == "after":
            await back()
        replica.settle(usage_event(request_id, cost_pico_usd=100 * 10**6))
        replica.finish(request_id)
        await replica.drain()
        await back()
        assert [int(v or 0) for v in await direct.hmget(budget, "spent", "reserved")] == [100 * 10**6, 0]
        assert await window_total(direct, f"{redis_prefix}rpm:tenant:t") == 1
        assert state.fallback.budget_usage_now(budget.removeprefix(redis_prefix)) in (None, (100 * 10**6, 0))
    finally:
        await replica.drain()
        await state.close()
        await direct.aclose()
        await proxy.stop()
