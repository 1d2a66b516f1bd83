"""Prometheus metrics, one registry per app (so several apps in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.usage import Usage

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("endpoint", "backend", "model")
        self.requests = Counter(
            "weir_requests", "Requests by outcome", (*labels, "status"), registry=self.registry
        )
        self.latency = Histogram(
            "weir_request_duration_seconds",
            "Request latency, to the last byte",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "weir_time_to_first_token_seconds",
            "Time to the first streamed token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "weir_tokens", "Tokens by class", ("backend", "model", "class"), registry=self.registry
        )
        self.errors = Counter("weir_errors", "Errors by type", (*labels, "type"), registry=self.registry)
        self.in_flight = Gauge("weir_requests_in_flight", "Requests being served", registry=self.registry)

    def record_tokens(self, backend: str, model: str, usage: Usage) -> None:
        for token_class, count in (
            ("input", usage.input_tokens),
            ("cached_input", usage.cached_input_tokens),
            ("cache_write_5m", usage.cache_write_5m_tokens),
            ("cache_write_1h", usage.cache_write_1h_tokens),
            ("output", usage.output_tokens),
            ("reasoning", usage.reasoning_tokens),
        ):
            if count:
                self.tokens.labels(backend, model, token_class).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
