"""Admission remembers a request (its reservation, TPM estimate) only while it can still settle: a
finished request is forgotten after a grace period, so memory holds a minute of traffic, not 15."""

from __future__ import annotations

import datetime as dt
import gc
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from gateway.accounting import admission as admission_module
from gateway.accounting.admission import Admission, Quotas, budget_key, month_of
from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import PriceCatalog
from gateway.state.memory import MemoryState
from tests.control.events import usage_event

QUOTAS = Quotas(tenant_id="t1", key_id="k1", tenant_tpm=10**9, tenant_budget_micro_usd=10**9)


async def test_finished_requests_are_forgotten_after_the_grace_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admission = Admission(MemoryState(), PriceCatalog)
    for i in range(5):
        await admission.admit(
            f"r{i}", QUOTAS, "openai", "gpt-4o-mini", prompt_tokens=10, max_output_tokens=10
        )
    for i in range(4):
        admission.finish(f"r{i}")
    admission.finish("never-admitted")  # requests without limits were never remembered: a no-op

    await admission.admit("r5", QUOTAS, "openai", "gpt-4o-mini", prompt_tokens=10, max_output_tokens=10)
    assert len(admission._pending) == 6  # still within the grace period: late attempts can settle

    monkeypatch.setattr(admission_module, "FINISHED_GRACE_S", 0.0)
    monkeypatch.setattr(admission_module, "EXPIRE_EVERY_S", 0.0)
    admission._next_expiry = 0.0  # the next admission looks (they look at most every EXPIRE_EVERY_S)
    await admission.admit("r6", QUOTAS, "openai", "gpt-4o-mini", prompt_tokens=10, max_output_tokens=10)
    assert sorted(admission._pending) == ["r4", "r5", "r6"]  # the unfinished ones stay


async def test_a_settled_request_keeps_an_untracked_record_and_later_attempts_still_settle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After its first settlement a request keeps only a tuple of immutable values (the collector
    stops tracking it, so a minute of finished requests costs full collections nothing), and its
    later attempts (retries, fallbacks) still count in its budgets and token limits."""
    state = MemoryState()
    admission = Admission(state, PriceCatalog)
    await admission.admit("r1", QUOTAS, "openai", "gpt-4o-mini", prompt_tokens=10, max_output_tokens=10)
    budget = budget_key("tenant", "t1", month_of(dt.datetime.now(dt.UTC)))
    assert (await state.budget_usage(budget))[1] == 1  # the estimate's minimum: one pico-dollar reserved

    admission.settle(event("r1", total_tokens=15, cost_pico_usd=2_500_000))  # 2.5 micro-USD
    await admission.drain()
    # Exactly what the ledger bills, in its unit (pico-dollars); the reservation released. (It was
    # rounded up to 3 micro-dollars per attempt, and the counter drifted ahead of the ledger.)
    assert await state.budget_usage(budget) == (2_500_000, 0)
    assert state._windows["tpm:tenant:t1"].total == 15  # the estimate (20) corrected to the truth
    admission.finish("r1")
    gc.collect()
    gc.collect()  # (the first may look at it before untracking the plan's tuples inside it)
    assert not gc.is_tracked(admission._pending["r1"])

    admission.settle(event("r1", total_tokens=7, cost_pico_usd=1_000_000, attempt=2))  # a fallback
    await admission.drain()
    assert await state.budget_usage(budget) == (3_500_000, 0)
    assert state._windows["tpm:tenant:t1"].total == 22

    monkeypatch.setattr(admission_module, "FINISHED_GRACE_S", 0.0)
    monkeypatch.setattr(admission_module, "EXPIRE_EVERY_S", 0.0)
    admission._next_expiry = 0.0
    await admission.admit("r2", QUOTAS, "openai", "gpt-4o-mini", prompt_tokens=10, max_output_tokens=10)
    assert sorted(admission._pending) == ["r2"]  # a settled record is forgotten like any other


def event(
    request_id: str, total_tokens: int, cost_pico_usd: int, attempt: int = 1, status: int = 200
) -> UsageEvent:
    return usage_event(
        request_id,
        total_tokens,
        cost_pico_usd,
        attempt=attempt,
        status=status,
        tenant_id="t1",
        key_id="k1",
        backend="openai",
        model="gpt-4o-mini",
    )


async def test_in_process_settlement_is_immediate() -> None:
    """Without Redis an attempt settles at once (no task, no loop turn, no batch): the next
    admission already sees its cost and its real token count."""
    state = MemoryState()
    admission = Admission(state, PriceCatalog)
    await admission.admit("r1", QUOTAS, "openai", "gpt-4o-mini", prompt_tokens=10, max_output_tokens=10)
    admission.settle(event("r1", total_tokens=30, cost_pico_usd=5_000_000))
    budget = budget_key("tenant", "t1", month_of(dt.datetime.now(dt.UTC)))
    assert state._budgets[budget].spent == 5_000_000 and state._budgets[budget].total_reserved == 0
    assert state._windows["tpm:tenant:t1"].total == 30
    assert not admission.settling()  # nothing left for a flush task to do


async def test_a_failed_attempt_holds_the_reservation_until_an_answer_or_the_end_of_the_exchange() -> None:
    """A failed attempt counts what it cost but keeps the request's reservation for the retry or
    fallback after it; the answer releases it, or the end of the exchange does when none came. A
    failed attempt that settles only after the exchange ended releases at once (nothing follows it),
    rather than holding the money until the reservation expires."""
    state = MemoryState()
    admission = Admission(state, PriceCatalog)
    budget = budget_key("tenant", "t1", month_of(dt.datetime.now(dt.UTC)))
    quota = {"prompt_tokens": 10, "max_output_tokens": 10}

    await admission.admit("answered", QUOTAS, "openai", "gpt-4o-mini", **quota)
    admission.settle(event("answered", total_tokens=4, cost_pico_usd=2_000_000, status=500))
    assert state._budgets[budget].spent == 2_000_000 and state._budgets[budget].total_reserved == 1
    admission.settle(event("answered", total_tokens=15, cost_pico_usd=3_000_000, attempt=2))
    assert state._budgets[budget].spent == 5_000_000 and state._budgets[budget].total_reserved == 0
    assert state._windows["tpm:tenant:t1"].total == 19  # both attempts' tokens, no estimate left

    await admission.admit("failed", QUOTAS, "openai", "gpt-4o-mini", **quota)
    admission.settle(event("failed", total_tokens=4, cost_pico_usd=0, status=502))
    assert state._budgets[budget].total_reserved == 1
    admission.finish("failed")
    assert state._budgets[budget].total_reserved == 0
    assert state._windows["tpm:tenant:t1"].total == 23

    await admission.admit("late", QUOTAS, "openai", "gpt-4o-mini", **quota)
    admission.finish("late")  # the exchange ended before its attempt's event was recorded
    assert state._budgets[budget].total_reserved == 1
    admission.settle(event("late", total_tokens=0, cost_pico_usd=0, status=499))
    assert state._budgets[budget].total_reserved == 0
    assert state._windows["tpm:tenant:t1"].total == 23


async def test_budgets_of_past_months_are_let_go_when_the_month_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which budgets were seeded from the ledger, the tenant budgets seen and their use for /metrics,
    and without Redis the budgets themselves, were kept for every month the replica ran; last
    month's use stayed on /metrics as the tenant's. At the month's first request they go, and this
    month's budgets count as before."""
    clock = [dt.datetime(2026, 1, 31, 23, 0, tzinfo=dt.UTC)]
    monkeypatch.setattr(
        admission_module,
        "dt",
        SimpleNamespace(datetime=SimpleNamespace(now=lambda tz: clock[0]), UTC=dt.UTC, date=dt.date),
    )
    seeded: list[tuple[str, str, dt.date]] = []

    async def spend(
        scope: str, owner: str, start: dt.date, events: Sequence[str], recent_from: str
    ) -> tuple[int, list[str]]:
        seeded.append((scope, owner, start))
        return 0, []

    state = MemoryState()
    admission = Admission(state, PriceCatalog, spend)
    quotas = [
        Quotas(tenant_id=f"t{i}", key_id=f"k{i}", tenant_budget_micro_usd=10**9, key_budget_micro_usd=10**9)
        for i in range(3)
    ]
    for month in range(1, 13):
        clock[0] = clock[0].replace(month=month, day=28)
        for i, quota in enumerate(quotas):
            await admission.admit(f"r{month}-{i}", quota, "openai", "gpt-4o-mini", 10, 10)
            admission.settle(event(f"r{month}-{i}", total_tokens=20, cost_pico_usd=2_000_000))
    current = month_of(clock[0])
    assert all(key.endswith(current) for key in admission._seeded) and len(admission._seeded) == 6
    assert set(admission._tenant_budgets) == {budget_key("tenant", f"t{i}", current) for i in range(3)}
    assert admission._seed_locks == {}
    assert all(key.endswith(current) for key in state._budgets) and len(state._budgets) == 6
    assert admission.budget_usage_ratio == {f"t{i}": 2 / 10**9 for i in range(3)}
    assert len(seeded) == 12 * 6  # each budget seeded once in each month, none again within it
    # The next month: only its first requests' tenants have a budget in use.
    clock[0] = dt.datetime(2027, 1, 1, 0, 5, tzinfo=dt.UTC)
    await admission.admit("next", quotas[0], "openai", "gpt-4o-mini", 10, 10)
    assert set(admission._tenant_budgets) == {budget_key("tenant", "t0", "2027-01")}
    assert admission.budget_usage_ratio == {"t0": 1 / 10**15}  # its reservation: a pico-dollar


async def test_a_request_that_runs_longer_than_a_quarter_of_an_hour_is_still_charged() -> None:
    """An exchange still running was forgotten 15 minutes after its admission as if it had been lost
    (PENDING_TTL_S), and the settlement of its attempt then found nothing to settle: a long stream (a
    slow engine, a reasoning model thinking for long) or a non-streaming answer under a long
    `first_byte` timeout cost its tenant's budget and token limit nothing, though the ledger billed
    it. Only a request whose exchange ended is forgotten soon (FINISHED_GRACE_S after its end)."""
    state = MemoryState()
    admission = Admission(state, PriceCatalog)
    quota = {"prompt_tokens": 10, "max_output_tokens": 10}
    await admission.admit("long", QUOTAS, "openai", "gpt-4o-mini", **quota)
    pending = admission._pending["long"]
    assert isinstance(pending, admission_module._Pending)
    pending.created -= 16 * 60  # admitted 16 minutes ago, and still streaming
    admission._next_expiry = 0.0  # the next admission looks for requests to forget
    await admission.admit("other", QUOTAS, "openai", "gpt-4o-mini", **quota)
    admission.settle(event("long", total_tokens=5_000, cost_pico_usd=7_000_000))
    budget = budget_key("tenant", "t1", month_of(dt.datetime.now(dt.UTC)))
    assert state._budgets[budget].spent == 7_000_000
    assert state._windows["tpm:tenant:t1"].total == 5_000 + 20  # its tokens, and other's estimate
