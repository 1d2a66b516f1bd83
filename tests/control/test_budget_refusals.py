"""What a request its budget refuses is told: the rate-limit headers of its tenant's RPM and TPM
limits, as on every other answer (in process, in Redis and in Redis's in-process fallback), and, when
the shared state lost the budget again while it was being seeded again, that the budget cannot be
confirmed, not a rate limit that was never reached."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
import redis.asyncio as aioredis

from gateway.accounting.admission import Admission, BudgetUnconfirmed, QuotaExceeded, Quotas, budget_key
from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.state import SharedState
from gateway.state.degradable import DegradableState
from gateway.state.memory import MemoryState
from gateway.state.redis import RedisState
from tests.control.events import usage_event
from tests.fixtures.db import REDIS_URL
from tests.fixtures.net import free_port

MICRO_PER_TOKEN = PriceCatalog(
    [
        PriceRow("*", "m", TokenClass.INPUT, 10**6, dt.datetime(2026, 1, 1, tzinfo=dt.UTC)),
        PriceRow("*", "m", TokenClass.OUTPUT, 0, dt.datetime(2026, 1, 1, tzinfo=dt.UTC)),
    ]
)
# Three requests of 100 tokens (100 micro-dollars each) in a budget of 300.
LIMITED = Quotas("t", "k", tenant_rpm=10, tenant_tpm=10_000, tenant_budget_micro_usd=300)


async def admit(admission: Admission, quotas: Quotas = LIMITED) -> dict[str, str]:
    return await admission.admit(uuid.uuid4().hex, quotas, "b", "m", prompt_tokens=100, max_output_tokens=0)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis), "redis-away"])
async def states(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[SharedState]:
    """The in-process state, Redis, and Redis's in-process fallback (a Redis that never answers)."""
    made: SharedState
    if request.param == "memory":
        made = MemoryState()
    elif request.param == "redis":
        made = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    else:
        unreachable = RedisState(aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0"))
        made = DegradableState(unreachable, retry_s=60)
    yield made
    await made.close()


async def test_a_budgets_429_says_what_is_left_of_the_rate_limits(states: SharedState) -> None:
    admission = Admission(states, lambda: MICRO_PER_TOKEN)
    for _ in range(3):
        request_id = uuid.uuid4().hex
        await admission.admit(request_id, LIMITED, "b", "m", prompt_tokens=100, max_output_tokens=0)
        admission.settle(usage_event(request_id, 100, cost_pico_usd=100 * 10**6))
        admission.finish(request_id)
        await admission.drain()
    with pytest.raises(QuotaExceeded) as refused:
        await admit(admission)
    headers = refused.value.headers
    # Three requests of ten, 300 of 10,000 tokens: nothing of the refused one counted.
    assert headers["x-ratelimit-limit-requests"] == "10"
    assert headers["x-ratelimit-remaining-requests"] == "7"
    assert headers["x-ratelimit-remaining-tokens"] == "9700"
    assert headers["x-should-retry"] == "false"
    assert headers["x-ratelimit-reset-requests"].endswith("s")


@pytest.mark.redis
async def test_a_budget_lost_again_while_it_was_seeded_again_is_said_to_be_unconfirmed(
    redis_prefix: str,
) -> None:
    """Redis loses the tenant's budget; while a replica seeds it again, Redis loses the key's (a
    second failover): the refusal names the budget, where it said "Rate limit reached ... requests
    per minute" of a limit with room left."""
    client = aioredis.from_url(REDIS_URL)
    state = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    month = f"{dt.datetime.now(dt.UTC):%Y-%m}"
    tenant_budget, key_budget = (budget_key(scope, "t", month) for scope in ("tenant", "key"))
    quotas = Quotas("t", "t", tenant_rpm=10, tenant_budget_micro_usd=300, key_budget_micro_usd=300)
    seeds: list[str] = []

    async def spend(
        scope: str, owner: str, start: dt.date, ids: Sequence[str], since: str
    ) -> tuple[int, list[str]]:
        seeds.append(scope)
        if len(seeds) == 3:  # the tenant's seed again: meanwhile Redis loses the key's budget too
            await client.delete(f"{redis_prefix}{key_budget}")
        return 0, []

    admission = Admission(state, lambda: MICRO_PER_TOKEN, spend)
    try:
        await admit(admission, quotas)  # both budgets seeded
        await client.delete(f"{redis_prefix}{tenant_budget}")
        with pytest.raises(BudgetUnconfirmed) as refused:
            await admit(admission, quotas)
        assert seeds == ["tenant", "key", "tenant"]
        assert refused.value.status == 429 and refused.value.code == "budget_unconfirmed"
        assert "key's monthly budget cannot be confirmed" in refused.value.message
        assert refused.value.headers["retry-after"] == "2"
        await admit(admission, quotas)  # the next request seeds the key's budget again
        assert seeds == ["tenant", "key", "tenant", "key"]
    finally:
        await admission.drain()
        await state.close()
        await client.aclose()
