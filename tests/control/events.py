"""Usage events for the control-plane tests."""

from __future__ import annotations

import datetime as dt
from typing import Any

from gateway.accounting.events import UsageEvent
from gateway.usage import Usage


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
