"""Prometheus metrics, one registry per app (so several apps in one process never collide)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gateway.state.degradable import degraded_states
from gateway.usage import Usage

# Up to the default `first_byte` timeout (600 s): a reasoning model's whole reply, or its first token,
# can take minutes, and a latency past the last finite bucket is one no quantile can place.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
NO_BACKEND = "none"  # the backend and model labels of a request that no backend answered


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
        # Per tenant, where the token counter is not: a search is billed on its own ($10 per 1,000,
        # gateway.accounting.pricing), and one tenant's agent can run hundreds of them an hour.
        self.server_tools = Counter(
            "weir_server_tool_uses",
            "Anthropic server tool uses (web_search, web_fetch) by backend, model and tenant",
            ("backend", "model", "tenant", "tool"),
            registry=self.registry,
        )
        self.errors = Counter("weir_errors", "Errors by type", (*labels, "type"), registry=self.registry)
        # Per upstream attempt (each retry, fallback and hedge), where `weir_requests_total` counts a
        # request once, under its last attempt's backend: the denominator of a backend's failure share.
        self.attempts = Counter(
            "weir_upstream_attempts",
            "Upstream attempts (retries, fallbacks and hedges each one) by backend, configured model "
            "and status class (2xx, 4xx, 5xx; 429, 499 cancelled and 0 no answer as they are)",
            ("backend", "model", "status"),
            registry=self.registry,
        )
        self.in_flight = Gauge("weir_requests_in_flight", "Requests being served", registry=self.registry)
        Gauge(
            "weir_shared_state_degraded",
            "1 while Redis is unreachable and limits and budgets hold per process only",
            registry=self.registry,
        ).set_function(lambda: min(degraded_states(), 1))
        # Labelled children, looked up once: `labels()` takes a lock and builds a key on every call.
        # Label values are configured backends and models (fixed while the process runs), status
        # codes (per attempt, their classes) and route names; a route's go with it (`forget_models`).
        self._done: dict[tuple[str, str, str, int], tuple[Any, Any]] = {}
        self._tokens: dict[tuple[str, str, str], Any] = {}
        self._server_tools: dict[tuple[str, str, str, str], Any] = {}
        self._attempts: dict[tuple[str, str, str], Any] = {}
        # Whether a model name is served now (Router.in_force; the gateway sets it): a request of a
        # route deleted while it ran makes no series of it again, once `forget_models` dropped them.
        self.in_force: Callable[[str], bool] = lambda model: True

    def request_done(self, endpoint: str, backend: str, model: str, status: int, seconds: float) -> None:
        key = (endpoint, backend, model, status)
        children = self._done.get(key)
        if children is None:
            if model != NO_BACKEND and not self.in_force(model):
                return
            children = self._done[key] = (
                self.requests.labels(endpoint, backend, model, str(status)),
                self.latency.labels(endpoint, backend, model),
            )
        children[0].inc()
        children[1].observe(seconds)

    def attempt_done(self, backend: str, model: str, status: int) -> None:
        """One upstream attempt ended: `model` is the configured model it went to (not a route's name:
        those are request-level), `status` its status (0: the backend never answered)."""
        key = (backend, model, status_class(status))
        child = self._attempts.get(key)
        if child is None:
            child = self._attempts[key] = self.attempts.labels(*key)
        child.inc()

    def record_tokens(self, backend: str, model: str, usage: Usage) -> None:
        for token_class, count in (
            ("input", usage.input_tokens),
            ("cached_input", usage.cached_input_tokens),
            ("cache_write_5m", usage.cache_write_5m_tokens),
            ("cache_write_1h", usage.cache_write_1h_tokens),
            ("output", usage.output_tokens),
            ("reasoning", usage.reasoning_tokens),
        ):
            if count and not self._add(
                self._tokens, self.tokens, (backend, model, token_class), model, count
            ):
                return

    def record_server_tools(self, backend: str, model: str, tenant: str, usage: Usage) -> None:
        """Count the server tool uses an attempt's usage reports (Anthropic's `server_tool_use`),
        labelled as `record_tokens` labels tokens, and with the tenant."""
        if not (usage.web_search_requests or usage.web_fetch_requests):  # nearly every attempt
            return
        for tool, count in (
            ("web_search", usage.web_search_requests),
            ("web_fetch", usage.web_fetch_requests),
        ):
            if count and not self._add(
                self._server_tools, self.server_tools, (backend, model, tenant, tool), model, count
            ):
                return

    def _add(
        self, children: dict[Any, Any], counter: Counter, key: tuple[str, ...], model: str, count: int
    ) -> bool:
        """Add `count` to `counter`'s series `key`, kept in `children` once made. False, counting
        nothing, for a model no longer served: a request of a deleted route that ends after
        `forget_models` would make its series again, which nothing would ever drop."""
        child = children.get(key)
        if child is None:
            if not self.in_force(model):
                return False
            child = children[key] = counter.labels(*key)
        child.inc(count)
        return True

    def forget_models(self, names: Collection[str]) -> None:
        """Stop exporting the series of model names that are gone (deleted or renamed routes): each
        route name ever created kept its request, latency and token series for as long as the process
        ran. A name used again starts its series afresh (a counter reset, which rate() absorbs)."""
        self._done = {key: c for key, c in self._done.items() if key[2] not in names}
        self._tokens = {key: c for key, c in self._tokens.items() if key[1] not in names}
        self._server_tools = {key: c for key, c in self._server_tools.items() if key[1] not in names}
        drop_series(self.requests, ("endpoint", "backend", "model", "status"), "model", names)
        drop_series(self.latency, ("endpoint", "backend", "model"), "model", names)
        drop_series(self.tokens, ("backend", "model", "class"), "model", names)
        drop_series(self.server_tools, ("backend", "model", "tenant", "tool"), "model", names)

    def watch_budgets(self, ratios: Callable[[], Mapping[str, float]]) -> None:
        """Export each tenant's monthly budget use (spent + reserved over the budget) on every scrape."""
        self.registry.register(_BudgetCollector(ratios))

    def watch_set_aside(self, count: Callable[[], int]) -> None:
        """Export the usage events the ledger refused for their data, and the queued lines that are
        no event, that the batch writer set aside (its dead-letter file), read from the writer on
        every scrape."""
        self.registry.register(_SetAsideCollector(count))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def status_class(status: int) -> str:
    """An upstream attempt's status as `weir_upstream_attempts_total` labels it: its class ("2xx",
    "4xx", "5xx"), but 429 (the backend's rate limit, which retries and failover wait out, where other
    4xx are the request's fault), 499 (cancelled: a hedge that lost, a client that left) and 0 (no
    answer) as they are. Backends answer whatever codes they like (Cloudflare's 52x, Anthropic's 529,
    a proxy's 418): each was a series of its own for every configured model."""
    if status in (0, 429, 499):
        return str(status)
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


def drop_series(
    metric: MetricWrapperBase, labelnames: Sequence[str], label: str, values: Collection[str]
) -> None:
    """Remove every series of `metric` (labelled `labelnames`) whose `label` is one of `values`:
    `remove` takes whole label sets, so they are read from what the metric exports."""
    if not values:
        return
    found = {
        tuple(sample.labels[name] for name in labelnames)
        for family in metric.collect()
        for sample in family.samples
        if sample.labels.get(label) in values
    }
    for labelvalues in found:
        metric.remove(*labelvalues)


class _BudgetCollector(Collector):
    def __init__(self, ratios: Callable[[], Mapping[str, float]]) -> None:
        self._ratios = ratios

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "weir_budget_usage_ratio",
            "Share of the tenant's monthly budget spent or reserved, as of its last settled request",
            labels=["tenant"],
        )
        for tenant, ratio in sorted(self._ratios().items()):
            family.add_metric([tenant], ratio)
        yield family


class _SetAsideCollector(Collector):
    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "weir_usage_events_set_aside",
            "Usage events the database refused for their data, and queued lines that are no event, "
            "set aside in the dead-letter file instead of written to the ledger (weir db replay-usage "
            "writes them)",
            value=self._count(),
        )
