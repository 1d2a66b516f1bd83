"""The outage drill (benchmarks/outage_drill.py) at a small size: steady streaming load, the primary
killed midway (in-flight streams cut included). Routed: no client request fails; the plain model,
with no route, fails every request after the kill."""

from __future__ import annotations

from benchmarks.outage_drill import run_drill


def test_outage_drill_loses_no_client_request() -> None:
    result = run_drill(requests=60, rate=60.0)
    routed, plain = result["routed"], result["plain"]
    assert routed["failed_share"] == 0.0
    assert plain["failed_share"] >= 0.3  # the same kill without routing: the control works
    assert routed["p50_after_ms"] < 2000  # failover adds milliseconds, not timeouts
