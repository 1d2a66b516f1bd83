"""What routing learns from usage events: moving averages of time to first token and decode speed."""

from __future__ import annotations

import datetime as dt

import pytest

from gateway.accounting.events import UsageEvent
from gateway.usage import Usage
from routing.stats import MIN_DECODE_TOKENS, RoutingStats


def stream(tokens: int, ttft_s: float, latency_s: float) -> UsageEvent:
    return UsageEvent(
        request_id="r",
        attempt=1,
        ts=dt.datetime.now(dt.UTC),
        tenant_id=None,
        key_id=None,
        route="fast",
        backend="b",
        model="m",
        usage=Usage(input_tokens=3, output_tokens=tokens),
        prices={},
        cost_pico_usd=0,
        latency_ms=latency_s * 1000,
        ttft_ms=ttft_s * 1000,
    )


def test_short_streams_teach_time_to_first_token_but_not_decode_speed() -> None:
    stats = RoutingStats()
    # Three tokens after a 0.3 s stall: as decode speed this would read 6 tokens/s.
    stats.record(stream(3, ttft_s=0.1, latency_s=0.43))
    learned = stats.get("b", "m")
    assert learned.ttft_s == pytest.approx(0.1) and learned.tokens_per_s is None
    stats.record(stream(MIN_DECODE_TOKENS + 1, ttft_s=0.1, latency_s=0.1 + MIN_DECODE_TOKENS * 0.01))
    assert learned.tokens_per_s == pytest.approx(100.0)
    assert learned.ttft_s == pytest.approx(0.1) and learned.samples == 2
