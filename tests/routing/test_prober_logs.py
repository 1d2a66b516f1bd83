"""The prober logs a backend's state changes, not every failed probe: an engine still loading its
model is "not up yet" (info), an outage is one warning, and the recovery says how long it took."""

from __future__ import annotations

from structlog.testing import capture_logs

from gateway.config import Backend
from routing.breaker import Breakers
from routing.health import HealthProber


async def test_probe_logs_only_state_changes() -> None:
    backend = Backend(name="local", type="openai", base_url="http://127.0.0.1:1/v1")
    prober = HealthProber(transport=None, breakers=Breakers(), interval=1)
    answers = iter([False, False, True, True, False, False, False, True])

    async def fake_probe(_: Backend) -> tuple[bool, float]:
        return next(answers), 1.0

    prober._timed_probe = fake_probe  # type: ignore[method-assign]
    prober.watch({"local": (backend, ["local/m"])})
    with capture_logs() as logs:
        for _ in range(8):
            await prober.run_once()
    events = [(entry["event"], entry["log_level"]) for entry in logs if entry["event"].startswith("backend_")]
    assert events == [
        ("backend_probe_not_up_yet", "info"),
        ("backend_probe_up", "info"),
        ("backend_probe_failed", "warning"),
        ("backend_probe_recovered", "info"),
    ]


async def test_a_failed_round_logs_no_url_query() -> None:
    """A probe URL carries a backend's configured query (a Gemini-style `?key=`): an error that
    quotes it reaches the log without it."""
    prober = HealthProber(transport=None, breakers=Breakers(), interval=0.01)

    async def failing_round() -> None:
        prober._stopping = True
        raise ValueError("cannot read http://backend.example/v1beta/models?key=SECRET-KEY-123")

    prober.run_once = failing_round  # type: ignore[method-assign]
    with capture_logs() as logs:
        await prober._loop()
    [entry] = [entry for entry in logs if entry["event"] == "health_probe_round_failed"]
    assert "SECRET-KEY-123" not in entry["error"]
    assert "http://backend.example/v1beta/models" in entry["error"]
