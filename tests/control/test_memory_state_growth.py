"""The in-process state (no Redis, or Redis unreachable) holds what is live, not everything it ever saw:
rate-limit and spend windows, kv values and reservations that lapsed are dropped as its clock moves
on, and the fallback behind Redis lets past months' budgets go as the month turns."""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.accounting import admission as admission_module
from gateway.accounting.admission import Admission, Quotas, budget_key, month_of
from gateway.accounting.pricing import PriceCatalog
from gateway.state import memory
from gateway.state.base import Budget, Limit
from gateway.state.degradable import DegradableState
from gateway.state.memory import SWEEP_CHUNK, SWEEP_S, MemoryState
from gateway.state.redis import RedisState
from routing.execute import HOUR, SpendCap
from tests.fixtures.db import REDIS_URL

KEYS = 10_000


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1_000_000.0]
    monkeypatch.setattr(MemoryState, "_now", staticmethod(lambda: now[0]))
    return now


async def test_ten_thousand_keys_leave_once_their_windows_pass(clock: list[float]) -> None:
    """10,000 API keys (created, used once, revoked) each make one request within 50 s: a tenant and a key RPM
    limit, a token limit settled afterwards, a hedge charged to a per-tenant hourly spend cap, a
    reservation never settled (its replica died), an admin session stored for a while. Everything
    stayed for as long as the process ran; once each window, TTL and reservation has run out, the
    state is back to what the next requests use, by the time they have made one round of sweeps."""
    state = MemoryState()
    hedges = SpendCap("hedge", state)
    for i in range(KEYS):
        limits = [Limit("rpm:tenant:t", 10**9), Limit(f"rpm:key:k{i}", 60), Limit(f"tpm:key:k{i}", 10**6, 50)]
        decision = state.admit_now(limits, [Budget(f"budget:key:k{i}:2026-12", 10**9)], 10, ttl_s=600.0)
        assert decision.allowed
        state.settle_attempt([f"tpm:key:k{i}"], -20, [], "", 0, report=False)
        assert await hedges.charge(f"t{i}", "r", 0.01, cap=1.0) is not None
        await state.kv_set(f"session:{i}", b"{}", ttl_s=900.0)
        clock[0] += 0.005  # all within 50 s (less than SWEEP_S): nothing has lapsed yet
    assert len(state._windows) == 3 * KEYS + 1 and len(state._kv) == KEYS

    clock[0] += HOUR + SWEEP_S  # past every window, TTL and reservation
    held = len(state._windows) + len(state._kv) + len(state._budgets)
    for _ in range(math.ceil(held / SWEEP_CHUNK)):  # the calls a round over all of it takes
        assert state.admit_now([Limit("rpm:tenant:t", 10**9), Limit("rpm:key:new", 10**9)]).allowed
    await state.kv_set("session:new", b"{}", ttl_s=900.0)
    assert set(state._windows) == {"rpm:tenant:t", "rpm:key:new"}
    assert set(state._kv) == {"session:new"}
    # The month's spend stays (with no reservation left): it counts until the month turns.
    assert all(not b.reservations and not b._recent for b in state._budgets.values())
    assert len(state._budgets) == KEYS


async def test_no_call_walks_more_than_a_chunk_of_a_hundred_thousand_keys(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """100,000 keys held (two hourly windows and a kv value each). Once a sweep is due, the request that
    found it walked all 300,000 entries (50-170 ms); now each call visits at most SWEEP_CHUNK of them,
    counted here rather than timed, and the calls after it carry the round on. Live entries stay;
    once they have lapsed, the calls a round takes drop every one of them."""
    keys = 100_000
    state = MemoryState()
    for k in range(keys):
        state.admit_now([Limit(f"rph:key:k{k}", 10, window_s=HOUR), Limit(f"tph:key:k{k}", 10**6, 30, HOUR)])
        await state.kv_set(f"session:{k}", b"{}", ttl_s=HOUR)
    held = 3 * keys
    visits = [0]

    def counting(lapsed: Callable[[Any, float], bool]) -> Callable[[Any, float], bool]:
        def counted(entry: Any, now: float) -> bool:
            visits[0] += 1
            return lapsed(entry, now)

        return counted

    for name in ("_window_lapsed", "_kv_lapsed", "_budget_lapsed"):  # what a sweep asks of each entry
        monkeypatch.setattr(memory, name, counting(getattr(memory, name)))
    a_request = [Limit("rpm:tenant:t", 10**9)]
    rounds = math.ceil(held / SWEEP_CHUNK)

    clock[0] += SWEEP_S  # a round is due; everything is still live
    per_call = []
    for _ in range(rounds + 1):
        visits[0] = 0
        assert state.admit_now(a_request).allowed
        per_call.append(visits[0])
    assert max(per_call) <= SWEEP_CHUNK
    assert sum(per_call) >= held  # the round visited everything...
    assert per_call[-1] == 0  # ...and is over: the next call pays one comparison
    assert len(state._windows) == 2 * keys + 1 and len(state._kv) == keys

    clock[0] += HOUR + SWEEP_S  # all lapsed
    sizes = [len(state._windows) + len(state._kv)]
    for _ in range(rounds + 1):
        visits[0] = 0
        assert state.admit_now(a_request).allowed
        assert visits[0] <= SWEEP_CHUNK
        sizes.append(len(state._windows) + len(state._kv))
    dropped = [before - after for before, after in itertools.pairwise(sizes)]
    assert max(dropped) <= SWEEP_CHUNK, "one call dropped more than a chunk"
    assert list(state._windows) == ["rpm:tenant:t"] and not state._kv


async def test_what_is_held_stays_bounded_under_churn(clock: list[float]) -> None:
    """A new API key on every request, 100 a second for 20 minutes: what is held is the keys of the
    last two minutes or so (their windows' length, a sweep interval and a round), not all 120,000."""
    state = MemoryState()
    held = []
    for i in range(20 * 60 * 100):
        limits = [Limit("rpm:tenant:t", 10**9), Limit(f"rpm:key:k{i}", 60), Limit(f"tpm:key:k{i}", 10**9, 30)]
        assert state.admit_now(limits).allowed
        state.settle_attempt([f"tpm:key:k{i}"], -5, [], "", 0, report=False)
        clock[0] += 0.01
        held.append(len(state._windows))
    # A key's windows lapse a minute after its request, a round starts within SWEEP_S after that and
    # takes a few calls: about two minutes of keys are held (two windows each), under three.
    assert max(held) <= 2 * 100 * 3 * 60 + 1


async def test_a_window_with_a_live_bucket_stays_and_counts_as_before(clock: list[float]) -> None:
    """The sweep drops a window only once nothing in it is left: a spend cap's hour outlives a
    minute's sweep, and a rate limit swept between two requests counts the same as a fresh one."""
    state = MemoryState()
    hedges = SpendCap("hedge", state)
    assert await hedges.charge("t", "r", 0.6, cap=1.0) is not None
    assert state.admit_now([Limit("rpm:key:k", 2)]).allowed
    assert state.admit_now([Limit("rpm:key:k", 2)]).allowed
    assert not state.admit_now([Limit("rpm:key:k", 2)]).allowed
    clock[0] += HOUR / 2  # a sweep: the minute's window goes, the hour's stays
    assert state.admit_now([Limit("rpm:other", 1)]).allowed
    assert "rpm:key:k" not in state._windows and hedges.key("t", "r") in state._windows
    assert await hedges.charge("t", "r", 0.6, cap=1.0) is None  # 0.6 of the hour's 1.0 still counted
    assert state.admit_now([Limit("rpm:key:k", 2)]).allowed
    assert state.admit_now([Limit("rpm:key:k", 2)]).allowed
    assert not state.admit_now([Limit("rpm:key:k", 2)]).allowed
    clock[0] += HOUR / 2 + SWEEP_S
    assert await hedges.charge("t", "r", 0.6, cap=1.0) is not None


async def test_a_kv_claim_lasts_its_ttl_through_sweeps(clock: list[float]) -> None:
    state = MemoryState()
    assert (await state.kv_set_if_absent("trial:b", b"1", 3 * SWEEP_S))[0]
    await state.kv_set("forever", b"x")
    for _ in range(2):
        clock[0] += SWEEP_S
        await state.kv_set("other", b"y", ttl_s=1.0)  # sweeps
        assert not (await state.kv_set_if_absent("trial:b", b"1", 3 * SWEEP_S))[0]
    clock[0] += SWEEP_S
    await state.kv_set("other", b"y", ttl_s=1.0)
    assert "trial:b" not in state._kv and await state.kv_get("forever") == b"x"


@pytest.mark.redis
async def test_the_fallback_behind_redis_lets_past_months_budgets_go(
    monkeypatch: pytest.MonkeyPatch, redis_prefix: str
) -> None:
    """With Redis the fallback learns each budget's spend from every admission (to start from it in
    an outage), but Admission's month turn never reached it: every budget of every month stayed."""
    month = [dt.datetime(2026, 1, 28, tzinfo=dt.UTC)]
    monkeypatch.setattr(
        admission_module,
        "dt",
        SimpleNamespace(datetime=SimpleNamespace(now=lambda tz: month[0]), UTC=dt.UTC, date=dt.date),
    )
    state = DegradableState(RedisState.from_url(REDIS_URL, prefix=redis_prefix))
    admission = Admission(state, PriceCatalog)
    quotas = [Quotas(tenant_id=f"t{i}", key_id=f"k{i}", key_budget_micro_usd=10**9) for i in range(3)]
    try:
        for m in range(1, 5):
            month[0] = month[0].replace(month=m)
            for i, quota in enumerate(quotas):
                await admission.admit(f"r{m}-{i}", quota, "openai", "gpt-4o-mini", 10, 10)
        current = month_of(month[0])
        assert sorted(state.fallback._budgets) == [budget_key("key", f"k{i}", current) for i in range(3)]
    finally:
        await admission.drain()
        await state.close()
