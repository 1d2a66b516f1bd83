"""Usage events for the control-plane tests."""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.usage import Usage
from tests.control.helpers import priced_event, random_usage

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)  # when CATALOG's prices start
CATALOG = PriceCatalog(
    [
        PriceRow("*", "m1", TokenClass.INPUT, 2_500_000, T0),
        PriceRow("*", "m1", TokenClass.CACHED_INPUT, 1_250_000, T0),
        PriceRow("*", "m1", TokenClass.OUTPUT, 10_000_000, T0),
    ]
)


def usage_event(request_id: str, tokens: int = 0, cost_pico_usd: int = 0, **fields: Any) -> UsageEvent:
    """One attempt's event, now: tenant `t`, key `k`, model and route `m` on backend `b`, `tokens`
    split between input and output (or `usage=`), unless `fields` say otherwise."""
    defaults: dict[str, Any] = {
        "attempt": 1,
        "ts": dt.datetime.now(dt.UTC),
        "tenant_id": "t",
        "key_id": "k",
        "route": "m",
        "backend": "b",
        "model": "m",
        "usage": Usage(input_tokens=tokens // 2, output_tokens=tokens - tokens // 2),
        "prices": {},
    }
    return UsageEvent(request_id=request_id, cost_pico_usd=cost_pico_usd, **(defaults | fields))


def numbered_event(n: int) -> UsageEvent:
    """Request `r{n}`'s event: `n` input tokens and one output token, so events tell apart by either."""
    return usage_event(f"r{n}", usage=Usage(input_tokens=n, output_tokens=1))


def random_events(n: int, seed: int = 1) -> list[UsageEvent]:
    """`n` events of model `m1` priced at CATALOG, over tenants t1/t2, random usage and times in the
    three days after T0, one in four a 502; the same ones for the same seed."""
    rng = random.Random(seed)
    return [
        priced_event(
            CATALOG,
            tenant_id=rng.choice(["t1", "t2"]),
            backend="openai",
            model="m1",
            usage=random_usage(rng),
            ts=T0 + dt.timedelta(hours=rng.randint(0, 72)),
            status=rng.choice([200, 200, 200, 502]),
        )
        for _ in range(n)
    ]
