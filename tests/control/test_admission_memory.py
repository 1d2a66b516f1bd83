"""Admission remembers a request (its reservation, TPM estimate) only while it can still settle: a
finished request is forgotten after a grace period, so memory holds a minute of traffic, not 15."""

from __future__ import annotations

import pytest

from gateway.accounting import admission as admission_module
from gateway.accounting.admission import Admission, Quotas
from gateway.accounting.pricing import PriceCatalog
from gateway.state.memory import MemoryState

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
