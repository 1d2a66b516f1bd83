"""The engine's request histograms place a request of minutes in a finite bucket."""

from __future__ import annotations

from engine.metrics import EngineMetrics


def test_a_request_of_minutes_lands_in_a_finite_bucket() -> None:
    """A long generation (thousands of tokens) or a first token queued behind others takes minutes;
    the last finite bucket was 60 s, so every such request fell in `+Inf` alone."""
    metrics = EngineMetrics(lambda: None)
    metrics.ttft.observe(200.0)
    metrics.finish("length", prompt=10, cached=0, started=0.0, now=400.0)
    value = metrics.registry.get_sample_value
    assert value("weir_engine_time_to_first_token_seconds_bucket", {"le": "60.0"}) == 0
    assert value("weir_engine_time_to_first_token_seconds_bucket", {"le": "300.0"}) == 1
    assert value("weir_engine_request_latency_seconds_bucket", {"le": "300.0"}) == 0
    assert value("weir_engine_request_latency_seconds_bucket", {"le": "600.0"}) == 1
