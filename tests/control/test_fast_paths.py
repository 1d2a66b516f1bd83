"""The shortcuts taken for the control plane's CPU cost give the answers of the slow ways: running
window and reservation totals in the memory state, price sheets resolved once, hiredis command
packing, and leases that grow with traffic while the books stay exact."""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import random
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection

from gateway.accounting import events
from gateway.accounting.admission import LEASE_REQUESTS, Admission, Quotas, budget_key, month_of
from gateway.accounting.pricing import USAGE_FIELD, PriceCatalog, PriceRow, TokenClass, price_usage, resolve
from gateway.state.base import BUCKETS, Adjustment, Budget, Limit, Settlement
from gateway.state.memory import MemoryState
from gateway.state.redis import HiredisConnection, RedisState, client_from_url
from gateway.usage import Usage
from tests.control.events import usage_event
from tests.fixtures.db import REDIS_URL


async def test_memory_state_running_totals_match_a_recount(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random admissions, settlements and clock jumps (within a bucket, across a few, past the whole
    window): the running totals always equal a recount of what the state holds, and the window is
    swept away only when the recount finds nothing left in it."""
    rng = random.Random(7)
    clock = [1_000_000.0]
    monkeypatch.setattr(MemoryState, "_now", staticmethod(lambda: clock[0]))
    state = MemoryState()
    limit, budget = Limit("rpm:t", 10**9, window_s=60.0), Budget("budget:t", 10**12)
    log: list[tuple[float, int]] = []  # (when, units) of everything counted in the window
    held: dict[str, tuple[int, float]] = {}  # reservation id -> (amount, expires)
    for _ in range(2000):
        step = rng.choice([0.0, 0.0, 0.3, 1.0, 2.5, 45.0, 200.0])
        clock[0] += step
        now = clock[0]
        if rng.random() < 0.7:
            cost, amount, ttl = rng.randint(1, 5), rng.randint(1, 50), rng.choice([0.5, 30.0, 600.0])
            decision = await state.admit([Limit(limit.key, limit.limit, cost)], [budget], amount, ttl_s=ttl)
            assert decision.allowed and decision.reservation_id
            log.append((now, cost))
            held[decision.reservation_id] = (amount, now + ttl)
        elif held:
            rid = rng.choice(list(held))
            release = rng.choice([0, 1, 10**6])
            await state.settle_many(
                [Settlement((), [budget.key], actual_pico_usd=3, releases=[(rid, release)])]
            )
            amount, expires = held[rid]
            if 0 < release < amount:
                held[rid] = (amount - release, expires)
            else:
                del held[rid]
        if not log:
            continue
        first_live = int(now // (limit.window_s / BUCKETS)) - BUCKETS + 1
        expected = sum(units for when, units in log if int(when // (limit.window_s / BUCKETS)) >= first_live)
        window = state._windows.get(limit.key)
        if window is None:  # swept: only once nothing it counted was left in it
            assert expected == 0
        else:
            window.advance(int(now // (limit.window_s / BUCKETS)))
            assert window.total == sum(window.buckets.values()) == expected
        live = {rid: v for rid, v in held.items() if v[1] > now}
        assert state._budgets[budget.key].reserved(now) == sum(amount for amount, _ in live.values())
        held = live


def test_price_sheets_price_as_the_formula_does() -> None:
    rng = random.Random(3)
    for _ in range(500):
        sheet = {c: rng.randint(0, 10**7) for c in TokenClass if rng.random() < 0.6}
        usage = Usage(**{field: rng.randint(0, 10**6) for field in USAGE_FIELD.values()})
        full = resolve(sheet)
        cost = price_usage(usage, sheet)
        assert cost.cost_pico_usd == sum(getattr(usage, USAGE_FIELD[c]) * full.get(c, 0) for c in TokenClass)
        assert cost.savings_pico_usd == usage.cached_input_tokens * (
            full.get(TokenClass.INPUT, 0) - full.get(TokenClass.CACHED_INPUT, 0)
        )
        assert cost.prices == {str(c): p for c, p in full.items()}
        sheet[TokenClass.OUTPUT] = sheet.get(TokenClass.OUTPUT, 0) + 1  # the same dict, changed
        assert price_usage(usage, sheet).cost_pico_usd == cost.cost_pico_usd + usage.output_tokens


def test_hiredis_packing_is_byte_for_byte_redis_py() -> None:
    fast, plain = HiredisConnection(), Connection()
    for args in [
        ("EVALSHA", "ab12", 2, "weir:k1", "weir:k2", 60, -5, 10**18, "é"),
        ("CONFIG GET", "maxmemory"),
        (b"XADD", "s", "*", "e", b"\x00\xff\n" * 1000),
        ("SET", "k", 1.5),
    ]:
        assert b"".join(fast.pack_command(*args)) == b"".join(plain.pack_command(*args))
    with pytest.raises(Exception, match="Invalid input"):
        fast.pack_command("SET", "k", True)


@pytest.fixture
async def admission(redis_prefix: str) -> AsyncIterator[tuple[Admission, aioredis.Redis]]:
    state = RedisState(client_from_url(REDIS_URL), prefix=redis_prefix)
    catalog = PriceCatalog(
        [PriceRow("*", "m", TokenClass.INPUT, 1_000_000, dt.datetime(2026, 1, 1, tzinfo=dt.UTC))]
    )
    admission = Admission(state, lambda: catalog, leasing=True)
    client = aioredis.from_url(REDIS_URL)
    yield admission, client
    admission.release_leases()
    await admission.drain()
    await state.close()
    await client.aclose()


@pytest.mark.redis
async def test_concurrent_requests_wait_for_the_lease_and_leases_grow(
    admission: tuple[Admission, aioredis.Redis], redis_prefix: str
) -> None:
    adm, client = admission
    quotas = Quotas("t", "k", tenant_rpm=10**7, tenant_budget_micro_usd=10**12, key_rpm=10**7)

    async def one() -> str:
        rid = uuid.uuid4().hex
        await adm.admit(rid, quotas, "b", "m", prompt_tokens=10, max_output_tokens=0)
        return rid

    admitted = []
    for _ in range(3):  # warm up: each wave bigger than the lease doubles the next one
        admitted += await asyncio.gather(*(one() for _ in range(4 * LEASE_REQUESTS)))
    before = adm.local_admissions
    for _ in range(4):
        admitted += await asyncio.gather(*(one() for _ in range(4 * LEASE_REQUESTS)))
    # Nearly all from leases now (a bucket ending mid-wave costs one ask and its waiters' misses).
    assert adm.local_admissions - before >= 0.9 * 4 * 4 * LEASE_REQUESTS
    for rid in admitted:
        adm.finish(rid)
    adm.release_leases()
    await adm.drain()
    for key in ("rpm:tenant:t", "rpm:key:k"):  # unused leased units all came back
        fields = {k.decode(): int(v) for k, v in (await client.hgetall(f"{redis_prefix}{key}")).items()}
        assert fields["t"] == len(admitted)
    budget = redis_prefix + budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    # Unsettled requests still hold their estimate (10 micro-USD each); the pools are released.
    assert int(await client.hget(budget, "reserved")) == 10 * 10**6 * len(admitted)


async def test_in_process_admit_and_settle_match_the_state_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """`admit_now` / `settle_attempt` (Admission's in-process path: no coroutine, lock or
    Settlement) leave the memory state exactly as `admit` / `settle_many` do, refusals included."""
    rng = random.Random(11)
    clock = [2_000_000.0]
    monkeypatch.setattr(MemoryState, "_now", staticmethod(lambda: clock[0]))
    slow, fast = MemoryState(), MemoryState()
    limits = [Limit("rpm:t", 40), Limit("tpm:t", 5_000, 1)]
    budgets = [Budget("budget:t", 3_000), Budget("budget:k", 2_500)]
    held: list[tuple[str, str]] = []  # (slow's reservation, fast's) of admitted requests
    for _ in range(3000):
        clock[0] += rng.choice([0.0, 0.0, 0.4, 1.0, 7.0, 61.0])
        if rng.random() < 0.6:
            cost, amount = rng.randint(1, 200), rng.randint(1, 60)
            asked = [limits[0], Limit("tpm:t", 5_000, cost)]
            ttl = rng.choice([0.5, 600.0])
            a = await slow.admit(asked, budgets, amount, ttl_s=ttl)
            b = fast.admit_now(asked, budgets, amount, ttl)
            assert a.allowed == b.allowed
            assert (a.blocked_by, a.retry_after_s) == (b.blocked_by, b.retry_after_s)
            if a.allowed:
                held.append((a.reservation_id or "", b.reservation_id or ""))
        elif held:
            rid_slow, rid_fast = held.pop(rng.randrange(len(held)))
            delta, actual = rng.randint(-150, 150), rng.randint(0, 80)
            keys = [b.key for b in budgets]
            expected = await slow.settle_many(
                [Settlement([Adjustment("tpm:t", delta)], keys, rid_slow, actual)]
            )
            got = fast.settle_attempt(["tpm:t"], delta, keys, rid_fast, actual)
            assert got == expected
        now_bucket = int(clock[0] // (60.0 / BUCKETS))
        for key in ("rpm:t", "tpm:t"):
            if key in slow._windows:
                slow._windows[key].advance(now_bucket)
                fast._windows[key].advance(now_bucket)
                assert slow._windows[key].total == fast._windows[key].total
        for budget in budgets:
            if budget.key in slow._budgets:
                assert slow._budgets[budget.key].spent == fast._budgets[budget.key].spent


async def test_token_limits_count_each_requests_own_estimate() -> None:
    """Admission reuses a caller's limits while the token estimate repeats; a request with another
    estimate still counts its own, and the next one with the first estimate the first."""
    state = MemoryState()
    admission = Admission(state, PriceCatalog)
    quotas = Quotas("t1", "k1", tenant_rpm=10**6, tenant_tpm=10**9, key_tpm=10**9)
    estimates = [(10, 20), (10, 20), (500, 20), (10, 20), (10, 7), (10, 20)]
    for i, (prompt, output) in enumerate(estimates):
        await admission.admit(f"r{i}", quotas, "b", "m", prompt_tokens=prompt, max_output_tokens=output)
    total = sum(p + o for p, o in estimates)
    assert state._windows["tpm:tenant:t1"].total == state._windows["tpm:key:k1"].total == total
    assert state._windows["rpm:tenant:t1"].total == len(estimates)


def test_usage_events_are_not_tracked_by_the_collector() -> None:
    event = usage_event(
        "r", cost_pico_usd=1, tenant_id=None, key_id=None, usage=Usage(input_tokens=1), prices={"input": 1}
    )
    assert not gc.is_tracked(event)
    assert not gc.is_tracked(events.decode(events.encode(event)))


def test_budget_reservations_expire_on_time_though_filed_late() -> None:
    """New reservations join the expiry heap only later (or never, when released first): the
    reserved total still drops exactly when each expires, mixed TTLs included, as a recount says."""
    from gateway.state.memory import _Budget

    rng = random.Random(5)
    budget = _Budget()
    model: dict[str, tuple[int, float]] = {}  # id -> (amount, expires): the recount's own books
    now = 1_000.0
    for i in range(20_000):
        now += rng.choice([0.0, 0.001, 0.01, 0.3, 2.0])
        if rng.random() < 0.55 or not model:
            rid, amount = f"r{i}", rng.randint(1, 50)
            expires = now + rng.choice([0.5, 1.0, 5.0, 600.0])
            budget.reserve(rid, amount, expires)
            model[rid] = (amount, expires)
        else:
            rid = rng.choice(list(model))
            part = rng.choice([0, 0, rng.randint(1, 60)])
            budget.release(rid, part)
            amount, expires = model[rid]
            if 0 < part < amount:
                model[rid] = (amount - part, expires)
            else:
                del model[rid]
        model = {r: v for r, v in model.items() if v[1] > now}
        assert budget.reserved(now) == sum(a for a, _ in model.values())
