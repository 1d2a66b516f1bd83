"""What routing learns from usage events: moving averages of time to first token and decode speed, from\nanswers and from attempts too slow to answer (censored observations), and the p95 hedges wait."""

from __future__ import annotations

import math

import msgspec
import pytest

import routing.stats
from gateway.accounting.events import UsageEvent
from gateway.usage import Usage
from routing.routes import Hedge
from routing.stats import (
    ALPHA,
    DEFAULT_HEDGE_DELAY_S,
    MAX_CENSORED_S,
    MIN_DECODE_TOKENS,
    MIN_P95_SAMPLES,
    WINDOW_AGE_S,
    RoutingStats,
)
from tests.control.events import usage_event


def stream(tokens: int, ttft_s: float, latency_s: float) -> UsageEvent:
    return usage_event(
        "r",
        tenant_id=None,
        key_id=None,
        route="fast",
        usage=Usage(input_tokens=3, output_tokens=tokens),
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


@pytest.mark.parametrize("streamed", [False, True])
def test_decode_speed_counts_hidden_reasoning_out_and_streamed_reasoning_in(streamed: bool) -> None:
    """1,000 reasoning tokens and a 17-token answer, billed as 1,017 output tokens. Hidden, the
    reasoning was generated before the first token (10 s of it), and the answer took 0.16 s: 100
    tokens/s, where 1,016 tokens over 0.16 s read 6,350. Streamed, the first token was reasoning, and
    every token came in the 10.16 s after it: 100 tokens/s too."""
    stats = RoutingStats()
    usage = Usage(input_tokens=3, output_tokens=1017, reasoning_tokens=1000)
    ttft, latency = (10.0, 10.16) if not streamed else (0.1, 10.26)
    event = stream(0, ttft_s=ttft, latency_s=latency)
    stats.record(msgspec.structs.replace(event, usage=usage, reasoning_streamed=streamed))
    assert stats.get("b", "m").tokens_per_s == pytest.approx(100.0)


def ended(latency_s: float, status: int, error: str | None, *, streamed: bool = True) -> UsageEvent:
    """An attempt that ended without its answer (a stream: its first token) after `latency_s`."""
    return msgspec.structs.replace(
        stream(0, ttft_s=0.0, latency_s=latency_s), ttft_ms=None, status=status, error=error, stream=streamed
    )


def measured(ttft_s: float, times: int = 5) -> RoutingStats:
    stats = RoutingStats()
    for _ in range(times):
        stats.record(msgspec.structs.replace(stream(3, ttft_s=ttft_s, latency_s=ttft_s + 0.05), stream=True))
    return stats


@pytest.mark.parametrize(("status", "error"), [(499, "cancelled"), (504, "upstream_error")])
def test_an_attempt_ended_for_being_slow_counts_as_at_least_that_slow(status: int, error: str) -> None:
    """A hedge race's loser (the router's 499) and a timeout (504) never reached their first token:
    the time they waited is a lower bound of their TTFT. Dropped, a candidate that slowed down kept
    the average of its fast days, and `lowest_latency` tried it first on every request."""
    stats = measured(0.01)
    learned = stats.get("b", "m")
    stats.record(ended(1.01, status, error))
    assert learned.ttft_s == pytest.approx(0.01 + ALPHA * 1.0)
    assert learned.latency_s is not None and learned.latency_s > 0.06
    assert learned.ttfts.recent()[-1] == pytest.approx(1.01) and learned.samples == 5
    # Not streamed: its whole answer's time (`lowest_latency` ranks such candidates by it), no TTFT.
    stats.record(msgspec.structs.replace(ended(3.0, status, error, streamed=False), model="whole"))
    whole = stats.get("b", "whole")
    assert (whole.latency_s, whole.ttft_s, whole.ttfts.recent()) == (pytest.approx(3.0), None, [])


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (499, "client_disconnected"),
        (400, "invalid_request_error"),
        (502, "upstream_error"),
        (0, "upstream_error"),
    ],
)
def test_an_attempt_that_ended_for_another_reason_says_nothing_of_its_speed(status: int, error: str) -> None:
    """A client that left after 5 ms, a 4xx the request caused, a backend that failed outright: how
    long that took is not how slow the backend is."""
    stats = measured(0.5)
    learned = stats.get("b", "m")
    before = (learned.ttft_s, learned.latency_s, learned.ttfts.recent())
    stats.record(ended(2.0, status, error))
    assert (learned.ttft_s, learned.latency_s, learned.ttfts.recent()) == before


def test_a_lower_bound_below_the_estimate_leaves_it_as_it_was() -> None:
    """A hedge that lost after 20 ms to a primary that answered says it would have taken more than
    20 ms: no news about a backend whose first token takes 0.5 s, and no reason to lower its numbers.
    A failed attempt that had its first token is no lower bound either."""
    stats = measured(0.5)
    learned = stats.get("b", "m")
    before = (learned.ttft_s, learned.latency_s, learned.ttfts.recent())
    stats.record(ended(0.02, 499, "cancelled"))
    stats.record(msgspec.structs.replace(ended(9.0, 504, "upstream_error"), ttft_ms=400.0))  # stalled later
    assert (learned.ttft_s, learned.latency_s, learned.ttfts.recent()) == before


def _hedged_by_p95(stats: RoutingStats, true_ttft_s: float, requests: int, hedge_ttft_s: float = 0.05) -> int:
    """`requests` streams to a primary whose first token takes `true_ttft_s`, each hedged after the
    delay `delay: p95` waits (routing.execute: the p95, at least `min_delay`) by a candidate whose
    first token takes `hedge_ttft_s`; the first to answer wins and the other is cancelled. Returns
    how many of them the hedge won."""
    lost = 0
    for _ in range(requests):
        delay = stats.get("b", "m").hedge_delay(True, Hedge().min_delay)
        if true_ttft_s <= delay + hedge_ttft_s:
            stats.record(msgspec.structs.replace(stream(3, true_ttft_s, true_ttft_s + 0.05), stream=True))
        else:
            lost += 1
            stats.record(ended(delay + hedge_ttft_s, 499, "cancelled"))
    return lost


def test_a_p95_hedge_delay_follows_a_primary_that_slowed_down_to_its_new_p95() -> None:
    """Its lost races lift the p95 until the primary answers before the hedge does: then it is
    hedged as rarely as before (its slowest answers), not on every request."""
    stats = measured(0.1, times=50)
    assert _hedged_by_p95(stats, true_ttft_s=3.0, requests=1000) > 50  # lost races while it caught up
    assert _hedged_by_p95(stats, true_ttft_s=3.0, requests=200) == 0
    p95 = stats.get("b", "m").p95_ttft()
    assert p95 is not None and 2.9 < p95 <= 3.0  # never above what the attempts really took


def test_a_p95_hedge_delay_stops_growing_where_the_primary_never_answers() -> None:
    """Each lost race is entered as slower than the delay that hedged it, which lifts the delay: for a
    primary that stopped answering, that went on with every request. Censored values count for at
    most MAX_CENSORED_S in the window."""
    stats = measured(0.1, times=50)
    _hedged_by_p95(stats, true_ttft_s=math.inf, requests=5000)
    assert stats.get("b", "m").p95_ttft() == MAX_CENSORED_S
    learned = stats.get("b", "m")
    assert learned.ttft_s is not None and learned.ttft_s > MAX_CENSORED_S  # ranked as slow as it is


def answered(latency_s: float) -> UsageEvent:
    """A whole answer, not streamed, after `latency_s`."""
    return msgspec.structs.replace(stream(40, ttft_s=0.0, latency_s=latency_s), ttft_ms=None, stream=False)


def test_a_request_not_streamed_is_hedged_by_the_p95_of_whole_answers_not_of_first_tokens() -> None:
    """A request not streamed has its answer when the whole answer is in: hedged after the p95 time
    to first token of the model's streams (0.1 s), nearly every such request (its answers take 2 s)
    was sent twice."""
    stats = measured(0.1, times=50)
    for _ in range(50):
        stats.record(answered(2.0))
    stats.record(ended(3.0, 499, "cancelled", streamed=False))  # a race it lost: at least that slow
    learned = stats.get("b", "m")
    assert learned.hedge_delay(True, Hedge().min_delay) == pytest.approx(0.1)
    assert learned.hedge_delay(False, Hedge().min_delay) == pytest.approx(2.0)
    assert learned.answers.recent()[-1] == pytest.approx(3.0)


def test_a_p95_hedge_delay_waits_at_least_the_default_until_enough_was_observed() -> None:
    """The p95 of one observation is that observation: a model whose first stream took 0.1 s had
    every later request slower than that hedged (half of them) until the window filled."""
    stats = measured(0.1, times=1)
    learned = stats.get("b", "m")
    assert learned.hedge_delay(True, Hedge().min_delay) == DEFAULT_HEDGE_DELAY_S
    assert learned.hedge_delay(False, Hedge().min_delay) == DEFAULT_HEDGE_DELAY_S  # none observed
    for _ in range(MIN_P95_SAMPLES - 2):
        stats.record(msgspec.structs.replace(stream(3, ttft_s=0.1, latency_s=0.15), stream=True))
    assert learned.hedge_delay(True, Hedge().min_delay) == DEFAULT_HEDGE_DELAY_S
    stats.record(msgspec.structs.replace(stream(3, ttft_s=0.1, latency_s=0.15), stream=True))
    assert learned.hedge_delay(True, Hedge().min_delay) == pytest.approx(0.1)
    # A slow model's few observations count as they are: it is not hedged after 1 s on every request.
    slow = measured(3.0, times=2).get("b", "m")
    assert slow.hedge_delay(True, Hedge().min_delay) == pytest.approx(3.0)


class Clock:
    """routing.stats' `time`, at a time the test sets (monotonic seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_p95_hedge_delay_forgets_an_incident_once_it_is_window_age_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A primary that stopped answering filled its window with lost races (MAX_CENSORED_S each).
    Kept by count alone, they held the delay at 10 s after it recovered until some 190 new answers
    had come: hours on a quiet route, for good where nothing else sent it requests."""
    clock = Clock()
    monkeypatch.setattr(routing.stats, "time", clock)
    stats = measured(0.1, times=50)
    _hedged_by_p95(stats, true_ttft_s=math.inf, requests=5000)  # the incident
    learned = stats.get("b", "m")
    assert learned.hedge_delay(True, Hedge().min_delay) == MAX_CENSORED_S
    clock.now += WINDOW_AGE_S / 2  # recovered: a few fast answers since, in the incident's window
    for _ in range(MIN_P95_SAMPLES):
        stats.record(msgspec.structs.replace(stream(3, ttft_s=0.1, latency_s=0.15), stream=True))
    assert learned.hedge_delay(True, Hedge().min_delay) == MAX_CENSORED_S
    clock.now += WINDOW_AGE_S / 2 + 1  # the incident is WINDOW_AGE_S old: only the answers since count
    assert learned.hedge_delay(True, Hedge().min_delay) == pytest.approx(0.1)
    assert learned.p95_ttft() == pytest.approx(0.1)
    clock.now += WINDOW_AGE_S + 1  # nothing observed lately: the default, as before any observation
    assert learned.hedge_delay(True, Hedge().min_delay) == DEFAULT_HEDGE_DELAY_S
