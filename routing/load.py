"""What engine replicas say about their own load, in ORCA's per-response header.

A gateway replica counts only the requests it sent itself; an engine replica's queue holds every
gateway replica's. So the bundled engine (and vLLM, which speaks the same header) answers a request
that carries ``endpoint-load-metrics-format: TEXT`` with ``endpoint-load-metrics: TEXT
named_metrics.num_requests_waiting=3, named_metrics.kv_cache_usage_perc=0.42, ...``, and prefix
affinity skips a replica whose last report shows a queue of ``max_waiting`` or more."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from gateway.config import Backend

REQUEST_HEADER = "endpoint-load-metrics-format"
RESPONSE_HEADER = "endpoint-load-metrics"
FRESH_S = 10.0  # an older report says nothing about the queue now


def report_request(backend: Backend) -> dict[str, str]:
    """The header that asks `backend` for its load report, on requests and health probes: the
    bundled engine is always asked (another server opts in through the backend's own `headers`)."""
    return {REQUEST_HEADER: "TEXT"} if backend.type == "engine" else {}


def parse_orca(value: str) -> dict[str, float]:
    """The named metrics of an ``endpoint-load-metrics`` value; {} for one it cannot read (a report
    is advice: a malformed one must never fail the request it came with)."""
    fmt, _, data = value.strip().partition(" ")
    named: dict[str, float] = {}
    try:
        if fmt.upper() == "TEXT":
            for item in data.split(","):
                key, _, number = item.strip().partition("=")
                if key.startswith("named_metrics."):
                    named[key.removeprefix("named_metrics.")] = float(number)
        elif fmt.upper() == "JSON":
            decoded = msgspec.json.decode(data)
            metrics = decoded.get("named_metrics", {}) if isinstance(decoded, dict) else {}
            named = {str(k): float(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {}
    except (ValueError, TypeError, msgspec.DecodeError, OverflowError, RecursionError):
        # OverflowError: a JSON integer too large for a float; RecursionError: JSON nested deeper
        # than the decoder goes. Either raised out of the request (a 500) and the probe round.
        return {}
    return {k: v for k, v in named.items() if math.isfinite(v)}


@dataclass(slots=True, frozen=True)
class Load:
    waiting: float  # requests queued, not yet scheduled
    at: float  # time.monotonic() of the report


class LoadReports:
    """The last load each backend (a server: its queue is every model's it serves) reported to this
    gateway replica, in answers to requests and to health probes."""

    def __init__(self) -> None:
        self.last: dict[str, Load] = {}

    def observe(self, backend: str, headers: Mapping[str, str]) -> None:
        value = headers.get(RESPONSE_HEADER)
        if value is None:
            return
        named = parse_orca(value)
        if "num_requests_waiting" in named:
            self.last[backend] = Load(named["num_requests_waiting"], time.monotonic())

    def waiting(self, backend: str) -> float | None:
        """The queue the backend last reported, if it did within `FRESH_S`."""
        load = self.last.get(backend)
        if load is None or time.monotonic() - load.at > FRESH_S:
            return None
        return load.waiting
