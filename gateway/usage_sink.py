"""Where usage events go. The API hands one UsageEvent per upstream attempt to a `UsageSink`; `record`
must not block (the accounting pipeline queues, it never writes to the DB on the request path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import structlog

from gateway.accounting.events import UsageEvent
from gateway.auth import ANONYMOUS
from gateway.metrics import Metrics

log = structlog.get_logger("weir.usage")


class UsageSink(Protocol):
    def record(self, event: UsageEvent) -> None: ...


class MetricsSink:
    """The default sink: token and server tool counters in Prometheus and a debug log line per attempt."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def record(self, event: UsageEvent) -> None:
        self.metrics.record_tokens(event.backend, event.route, event.usage)
        tenant = event.tenant_id or ANONYMOUS.tenant_id
        self.metrics.record_server_tools(event.backend, event.route, tenant, event.usage)
        log.debug(
            "usage",
            request_id=event.request_id,
            attempt=event.attempt,
            tenant_id=event.tenant_id,
            route=event.route,
            backend=event.backend,
            model=event.model,
            status=event.status,
            cost_pico_usd=event.cost_pico_usd,
        )


class ListSink:
    """Keeps every event in memory (embedding, tests, drills)."""

    def __init__(self) -> None:
        self.events: list[UsageEvent] = []

    def record(self, event: UsageEvent) -> None:
        self.events.append(event)


class FanoutSink:
    def __init__(self, sinks: Sequence[UsageSink]) -> None:
        self.sinks = list(sinks)

    def record(self, event: UsageEvent) -> None:
        for sink in self.sinks:
            sink.record(event)
