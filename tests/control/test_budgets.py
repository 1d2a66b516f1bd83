"""Budgets: counted in the ledger's unit, so the counters agree with what the ledger bills, in process
and in Redis."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import redis.asyncio as aioredis

import gateway.state.redis
from gateway.accounting.admission import Admission, QuotaExceeded, Quotas, budget_key, month_of
from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.admin.control_plane import ControlPlane, ControlPlaneSettings
from gateway.db import migrate
from gateway.state import SharedState
from gateway.state.degradable import DegradableState
from gateway.state.redis import RedisState
from gateway.usage import Usage
from tests.control.events import usage_event
from tests.control.helpers import TcpProxy
from tests.fixtures.db import REDIS_URL, premigrated

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
EMBEDDINGS = PriceCatalog(  # USD 0.02 per 1M input tokens: 10 tokens cost 0.2 micro-dollars
    [PriceRow("*", "m", TokenClass.INPUT, 20_000, T0), PriceRow("*", "m", TokenClass.OUTPUT, 0, T0)]
)


def event(request_id: str, usage: Usage, cost_pico_usd: int) -> UsageEvent:
    return usage_event(request_id, cost_pico_usd=cost_pico_usd, usage=usage)


async def test_budget_spend_is_what_the_ledger_bills_not_each_attempt_rounded_up(
    state: SharedState,
) -> None:
    """Each attempt's cost was rounded up to a whole micro-dollar on the budget counter, while the
    ledger (and the seed a restarted replica reads from it) keeps exact pico-dollars: 100 embedding
    calls of 0.2 micro-dollars cost USD 0.00002 in the ledger, the counter said USD 0.0001, and a
    USD 0.0001 budget refused the next call with 80% of it unspent. The counter now holds the
    ledger's pico-dollars, and the budget is refused only once it is really spent."""
    admission = Admission(state, lambda: EMBEDDINGS)
    quotas = Quotas("t", None, tenant_budget_micro_usd=100)  # USD 0.0001
    budget = budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    ledger_pico = 0
    for i in range(100):
        await admission.admit(f"r{i}", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        cost = EMBEDDINGS.price(Usage(input_tokens=10), "b", "m", dt.datetime.now(dt.UTC)).cost_pico_usd
        assert cost == 200_000  # 0.2 micro-dollars
        admission.settle(event(f"r{i}", Usage(input_tokens=10), cost))
        admission.finish(f"r{i}")
        ledger_pico += cost
    await admission.drain()
    assert await state.budget_usage(budget) == (ledger_pico, 0) == (20_000_000, 0)  # USD 0.00002

    # Four times as many calls again fit: 500 calls of 0.2 micro-dollars are the whole budget.
    for i in range(100, 500):
        await admission.admit(f"r{i}", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        admission.settle(event(f"r{i}", Usage(input_tokens=10), 200_000))
        admission.finish(f"r{i}")
    await admission.drain()
    assert await state.budget_usage(budget) == (100 * 10**6, 0)
    with pytest.raises(QuotaExceeded):
        await admission.admit("over", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(REDIS_URL)
    yield client
    await client.aclose()


async def lose_budget(client: aioredis.Redis, redis_prefix: str, scope: str, owner: str) -> None:
    """What Redis restarting without its data, failing over to a replica behind it or evicting the
    keys leaves of one budget: nothing (only this test's keys go)."""
    key = redis_prefix + budget_key(scope, owner, month_of(dt.datetime.now(dt.UTC)))
    assert await client.delete(key, f"{key}:res", f"{key}:exp", f"{key}:unseeded", f"{key}:counted") >= 1


@pytest.mark.redis
async def test_budget_spend_is_not_forgotten_when_redis_loses_its_data(
    redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """docs/deploy.md: budget counters are re-seeded from the ledger. A replica seeded a budget once
    a month (Admission._seeded) and never again, and the seed set `spent` only where it was missing:
    after Redis lost its data every replica admitted the tenant as if nothing had been spent this
    month, until each restarted. Admission now learns from its admission that Redis holds no seed,
    seeds again from the ledger and asks once more; the tenant stays refused on every replica."""
    lookups: list[str] = []

    async def spend(
        scope: str, owner: str, month_start: dt.date, events: Sequence[str], recent_from: str
    ) -> tuple[int, list[str]]:
        lookups.append(owner)
        return 5 * 10**12, []  # the ledger says USD 5 spent this month

    states = [RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix) for _ in range(2)]
    replicas = [Admission(s, lambda: EMBEDDINGS, spend=spend) for s in states]
    quotas = Quotas("t", None, tenant_budget_micro_usd=5 * 10**6)  # a USD 5 budget: all spent
    try:
        for replica in replicas:
            with pytest.raises(QuotaExceeded):
                await replica.admit("before", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        assert lookups == ["t", "t"]
        await lose_budget(redis_client, redis_prefix, "tenant", "t")
        for replica in replicas:
            with pytest.raises(QuotaExceeded):
                await replica.admit("after", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        # The first replica seeded it again, once; the second found it seeded (no lookup, no second ask).
        assert lookups == ["t", "t", "t"]
        assert await states[1].budget_usage(budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))) == (
            5 * 10**12,
            0,
        )
    finally:
        for state in states:
            await state.close()


@pytest.mark.redis
async def test_what_was_settled_after_redis_lost_a_budget_counts_with_the_ledger_s_spend(
    redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """An attempt admitted before the loss settles after it, and recreates the budget's `spent` with
    its own cost alone: that must not pass for the month's spend. The next admission seeds the budget
    again, adding the ledger's spend to it. With the database down then, the request is admitted
    against what Redis holds (as before a first seed, not refused or retried forever), and the
    budget is seeded on a later request."""
    database_down = False

    async def spend(
        scope: str, owner: str, month_start: dt.date, events: Sequence[str], recent_from: str
    ) -> tuple[int, list[str]]:
        if database_down:
            raise OSError("database unreachable")
        return 4 * 10**12, []  # USD 4, none of the attempts settled since the loss

    state = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    admission = Admission(state, lambda: EMBEDDINGS, spend=spend)
    quotas = Quotas("t", None, tenant_budget_micro_usd=5 * 10**6)  # USD 5
    budget = budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    usd = 10**12
    try:
        await admission.admit("r1", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        await lose_budget(redis_client, redis_prefix, "tenant", "t")
        admission.settle(event("r1", Usage(input_tokens=10), usd // 2))
        await admission.drain()
        assert await state.budget_usage(budget) == (usd // 2, 0)

        await admission.admit("r2", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        assert await state.budget_usage(budget) == (usd // 2 + 4 * usd, 200_000)  # r2's estimate held
        with pytest.raises(QuotaExceeded):  # USD 0.6 fits only in what Redis had forgotten
            await admission.admit("r3", quotas, "b", "m", prompt_tokens=30_000_000, max_output_tokens=0)

        database_down = True
        await lose_budget(redis_client, redis_prefix, "tenant", "t")
        await admission.admit("r4", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        database_down = False
        with pytest.raises(QuotaExceeded):  # the next request seeded it: USD 4 + 1.5 > 5
            await admission.admit("r5", quotas, "b", "m", prompt_tokens=75_000_000, max_output_tokens=0)
        assert await state.budget_usage(budget) == (4 * usd, 200_000)  # r4's estimate held
    finally:
        await state.close()


@pytest.mark.redis
async def test_a_seed_reads_the_ledger_again_when_an_attempt_settles_while_it_reads(
    redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """Redis lost a budget while two of replica A's requests were in flight. The first settles and
    its event reaches the ledger; replica B's next request finds the budget unseeded and seeds it.
    While B reads the ledger, A's second request settles and its event reaches the ledger too: the
    spend B read holds it, but B did not ask the ledger about it. B's seed then changes nothing and
    B reads again, so the budget holds the ledger's spend with each attempt counted once."""
    usd = 10**12
    ledger: dict[str, int] = {}  # event id -> cost: the usage events the ledger holds
    a_event = {f"r{i}": event(f"r{i}", Usage(input_tokens=10), usd // 2) for i in range(3)}
    reads: list[list[str]] = []  # the unseeded events each ledger read was asked about

    async def spend(
        scope: str, owner: str, month_start: dt.date, events: Sequence[str], recent_from: str
    ) -> tuple[int, list[str]]:
        reads.append(sorted(events))
        if len(reads) == 2:  # B's first read: A's r2 settles and reaches the ledger meanwhile
            replicas[0].settle(a_event["r2"])
            await replicas[0].drain()
            ledger[a_event["r2"].event_id] = usd // 2
        return sum(ledger.values()), [e for e in events if e in ledger]

    states = [RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix) for _ in range(2)]
    replicas = [Admission(s, lambda: EMBEDDINGS, spend=spend) for s in states]
    quotas = Quotas("t", None, tenant_budget_micro_usd=5 * 10**6)  # USD 5
    budget = budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    try:
        for request_id in a_event:
            await replicas[0].admit(request_id, quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        replicas[0].settle(a_event["r0"])
        await replicas[0].drain()
        ledger[a_event["r0"].event_id] = usd // 2
        await lose_budget(redis_client, redis_prefix, "tenant", "t")
        replicas[0].settle(a_event["r1"])
        await replicas[0].drain()
        ledger[a_event["r1"].event_id] = usd // 2

        await replicas[1].admit("b1", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        assert await states[1].budget_usage(budget) == (3 * usd // 2, 200_000)  # b1's estimate held
        r1, r2 = a_event["r1"].event_id, a_event["r2"].event_id
        assert reads == [[], [r1], sorted([r1, r2])]
    finally:
        for state in states:
            await state.close()


async def test_a_budget_stored_above_the_bound_is_counted_as_the_bound(
    state: SharedState, caplog: pytest.LogCaptureFixture
) -> None:
    """A budget stored before the admin API bounded them (up to 2^63-1 micro-dollars) is 10^6 times
    that in pico-dollars, past what Redis's 64-bit counter holds: a request estimated at USD 10M was
    admitted against it and its reservation overflowed the counter (a Redis error on every such
    request of the tenant). It is now counted as MAX_BUDGET_MICRO (USD 1M), and logged."""
    pricey = PriceCatalog(  # USD 10 per 1M tokens, in and out
        [PriceRow("*", "m", TokenClass.INPUT, 10**7, T0), PriceRow("*", "m", TokenClass.OUTPUT, 10**7, T0)]
    )
    admission = Admission(state, lambda: pricey)
    quotas = Quotas("t", None, tenant_budget_micro_usd=2**63 - 1)
    with pytest.raises(QuotaExceeded, match=r"whole monthly budget \(USD 1000000\)"):
        await admission.admit("big", quotas, "b", "m", prompt_tokens=10, max_output_tokens=10**12)
    assert "above the most a budget can be" in caplog.text
    await admission.admit("small", quotas, "b", "m", prompt_tokens=10, max_output_tokens=10)
    budget = budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    assert await state.budget_usage(budget) == (0, 20 * 10**7)  # only the small request is reserved


MICRO_PER_TOKEN = PriceCatalog(  # USD 1 per 1M input tokens: one micro-dollar a token
    [PriceRow("*", "m", TokenClass.INPUT, 10**6, T0), PriceRow("*", "m", TokenClass.OUTPUT, 0, T0)]
)


@pytest.mark.parametrize("leasing", [False, True])
async def test_a_spent_budget_is_refused_for_good_and_one_held_by_requests_in_flight_is_not(
    state: SharedState, leasing: bool
) -> None:
    """A budget's refusal told no client whether waiting could help. Spent (what settled leaves no
    room for the request): nothing lifts it before the month turns or an administrator raises it,
    and it says `x-should-retry: false`, which the official SDKs obey where they retry a 429 twice.
    Held by requests in flight (their reservations, which settle for what they really cost, usually
    less): a retry may fit once they finish, so it says nothing of the kind."""
    admission = Admission(state, lambda: MICRO_PER_TOKEN, leasing=leasing)
    quotas = Quotas("t", None, tenant_budget_micro_usd=100)

    async def refused(tokens: int) -> QuotaExceeded:
        with pytest.raises(QuotaExceeded) as caught:
            await admission.admit("refused", quotas, "b", "m", prompt_tokens=tokens, max_output_tokens=0)
        return caught.value

    await admission.admit("a", quotas, "b", "m", prompt_tokens=60, max_output_tokens=0)  # 60 reserved
    held = await refused(50)
    assert held.code == "insufficient_quota" and "x-should-retry" not in held.headers
    assert "in flight" in held.message
    admission.settle(event("a", Usage(input_tokens=30), 30 * 10**6))  # it cost 30: 70 left
    admission.finish("a")
    await admission.drain()
    await admission.admit("b", quotas, "b", "m", prompt_tokens=50, max_output_tokens=0)  # the retry fits
    admission.settle(event("b", Usage(input_tokens=50), 50 * 10**6))  # 80 spent
    admission.finish("b")
    await admission.drain()
    spent = await refused(30)
    assert spent.code == "insufficient_quota" and spent.headers["x-should-retry"] == "false"
    assert "retry-after" not in spent.headers
    await admission.admit("c", quotas, "b", "m", prompt_tokens=20, max_output_tokens=0)  # what is left


@pytest.fixture
async def control(db_url: str, tmp_path: Path) -> AsyncIterator[ControlPlane]:
    """A control plane over a migrated ledger that holds USD 2 of this month's spend, settled long ago:
    what a seed reads, beside the attempts a test writes."""
    plane = ControlPlane(ControlPlaneSettings(database_url=db_url, spool_dir=str(tmp_path / "spool")))
    try:
        await migrate.upgrade_async(premigrated(db_url))
        await plane.writer.write([event("before", Usage(input_tokens=10), 2 * 10**12)])
        yield plane
    finally:
        await plane.stop()


@pytest.mark.redis
async def test_an_attempt_whose_event_reached_the_ledger_before_its_settlement_counts_once(
    control: ControlPlane, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """Redis lost a budget while replica A's request was in flight. Its usage event reaches the
    ledger before its settlement reaches Redis, and replica B seeds the budget in between: the
    spend B reads holds the attempt, which had not settled in Redis yet. Its settlement counted it
    again when it came (USD 3 spent, USD 4 on the books). The seed now tells Redis which of the
    ledger's recent events it counted, and the late settlement of one of them adds nothing; one of
    an event the ledger did not hold counts as ever."""
    usd = 10**12
    states = [RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix) for _ in range(2)]
    replicas = [Admission(s, lambda: EMBEDDINGS, spend=control._spend_this_month) for s in states]
    quotas = Quotas("t", None, tenant_budget_micro_usd=5 * 10**6)  # USD 5
    budget = budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    late = event("r1", Usage(input_tokens=10), usd)
    try:
        await replicas[0].admit("r1", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        await lose_budget(redis_client, redis_prefix, "tenant", "t")
        await control.writer.write([late])  # r1's event is written to the ledger...
        await replicas[1].admit("b1", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        replicas[0].settle(late)  # ...then its settlement reaches Redis, after B's seed
        await replicas[0].drain()
        assert await states[1].budget_usage(budget) == (3 * usd, 200_000)  # b1's estimate held

        replicas[1].settle(event("b1", Usage(input_tokens=10), usd // 2))  # not in the ledger yet
        await replicas[1].drain()
        assert await states[1].budget_usage(budget) == (3 * usd + usd // 2, 0)
    finally:
        for state in states:
            await state.close()


@pytest.mark.redis
async def test_a_seed_made_while_redis_was_away_counts_a_late_settlement_once(
    control: ControlPlane, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    """As above, but replica A, which seeds the budget, cannot reach Redis then: its seed waits for
    Redis to answer again (DegradableState._catch_up), and was handed over with the ledger's spend
    alone. Redis then kept no record of the ledger's recent events, and the settlement of one that
    came after the seed landed counted it again (USD 4 on the books for USD 3 spent). The seed now
    lands as it would have, with the recent events the ledger held when it was read."""
    usd = 10**12
    proxy = TcpProxy(6379)  # Redis as replica A sees it: stop() plays an outage
    await proxy.start()
    a = DegradableState(
        RedisState(aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0"), prefix=redis_prefix), retry_s=0.02
    )
    b = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    replicas = [Admission(s, lambda: EMBEDDINGS, spend=control._spend_this_month) for s in (a, b)]
    quotas = Quotas("t", None, tenant_budget_micro_usd=5 * 10**6)  # USD 5
    budget = budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    late = event("r1", Usage(input_tokens=10), usd)
    try:
        await replicas[1].admit("r1", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        await lose_budget(redis_client, redis_prefix, "tenant", "t")
        await control.writer.write([late])  # r1's event is written to the ledger...
        await proxy.stop()
        await replicas[0].admit("a1", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        assert a.degraded  # A read the ledger (USD 3, r1 in it) and holds the seed for Redis
        await proxy.start()
        async with asyncio.timeout(5):
            while a.degraded:  # the prober hands Redis the seed, then switches back to it
                await asyncio.sleep(0.01)
        replicas[1].settle(late)  # ...then r1's settlement reaches Redis, after A's seed
        await replicas[1].drain()
        assert await b.budget_usage(budget) == (3 * usd, 0)  # a1's estimate is held by A alone

        replicas[1].settle(event("r1", Usage(input_tokens=10), usd // 2))  # r1's retry: not in the ledger
        await replicas[1].drain()
        assert await b.budget_usage(budget) == (3 * usd + usd // 2, 0)
    finally:
        for replica in replicas:
            await replica.drain()
        await a.close()
        await b.close()
        await proxy.stop()


@pytest.mark.redis
async def test_a_budget_left_unseeded_records_a_bounded_number_of_attempts_for_its_seed(
    redis_prefix: str, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the database down at seed time, a budget stays unseeded, and each attempt settled on it
    added an entry to `<budget>:unseeded` (for the seed to tell which of them the ledger holds) for
    as long as the database stayed down, kept 40 days. It now holds at most UNSEEDED_MAX of them,
    the oldest: those the ledger is first to hold once the database is back. Attempts beyond it
    count in `spent` alone, and the seed counts exactly once those that are not in the ledger yet."""
    monkeypatch.setattr(gateway.state.redis, "UNSEEDED_MAX", 3)
    usd = 10**12
    ledger: dict[str, int] = {}
    database_down = True

    async def spend(
        scope: str, owner: str, month_start: dt.date, events: Sequence[str], recent_from: str = ""
    ) -> tuple[int, list[str]]:
        if database_down:
            raise OSError("database unreachable")
        return sum(ledger.values()), [e for e in ledger if e in events or e >= recent_from]

    state = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    admission = Admission(state, lambda: EMBEDDINGS, spend=spend)
    quotas = Quotas("t", None, tenant_budget_micro_usd=50 * 10**6)  # USD 50
    budget = budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    events = [event(f"r{i}", Usage(input_tokens=10), usd) for i in range(6)]
    try:
        for e in events:
            await admission.admit(e.request_id, quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
            admission.settle(e)
            admission.finish(e.request_id)
        await admission.drain()
        assert await redis_client.hlen(redis_prefix + budget + ":unseeded") == 3
        assert await state.budget_usage(budget) == (6 * usd, 0)

        database_down = False
        for e in events[:3]:  # the writer catches up oldest first: half the outage's events so far
            ledger[e.event_id] = usd
        await admission.admit("after", quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        assert await state.budget_usage(budget) == (6 * usd, 200_000)  # each attempt once
        assert await redis_client.exists(redis_prefix + budget + ":unseeded") == 0
    finally:
        await state.close()
