"""Budgets: counted in the ledger's unit, so the counters agree with what the ledger bills, in process
and in Redis."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.accounting.admission import Admission, QuotaExceeded, Quotas, budget_key, month_of
from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.state import MemoryState, SharedState
from gateway.state.redis import RedisState
from gateway.usage import Usage
from tests.control.conftest import REDIS_URL

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
EMBEDDINGS = PriceCatalog(  # USD 0.02 per 1M input tokens: 10 tokens cost 0.2 micro-dollars
    [PriceRow("*", "m", TokenClass.INPUT, 20_000, T0), PriceRow("*", "m", TokenClass.OUTPUT, 0, T0)]
)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def state(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[SharedState]:
    if request.param == "memory":
        s: SharedState = MemoryState()
    else:
        s = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    yield s
    await s.close()


def event(request_id: str, usage: Usage, cost_pico_usd: int) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        attempt=1,
        ts=dt.datetime.now(dt.UTC),
        tenant_id="t",
        key_id="k",
        route="m",
        backend="b",
        model="m",
        usage=usage,
        prices={},
        cost_pico_usd=cost_pico_usd,
    )


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
