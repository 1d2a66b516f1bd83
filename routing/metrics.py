"""Routing metrics on the app's Prometheus registry: attempts by route, candidate and outcome, and
hedges by route and result (the executor counts them), and, read at scrape time, breaker states
(shared, and routes' own latency breakers), prefix-affinity hits and prompt tokens cached, the
shipped difficulty head in use, the trained heads routes name, the stored routes left out and whether
the stored table was refused as a whole."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.metrics import drop_series, status_class
from routing.breaker import OPENNESS

# The statuses `weir_route_attempts_total` labels as they are: those clients, retries and failover
# tell apart (a bad request, auth, not found, a timeout, too large, rate limited, cancelled, the
# gateway errors, Anthropic's overloaded). Any other status is its class (`gateway.metrics.
# status_class`): vendors answer whatever codes they like, and each was a series of its own per route
# and candidate (up to ~100). The x-weir-route header and the log keep the exact status.
ROUTE_OUTCOME_STATUSES = frozenset(
    {400, 401, 403, 404, 408, 409, 413, 422, 429, 499, 500, 502, 503, 504, 529}
)


def attempt_outcome(outcome: str) -> str:
    """An attempt's outcome as `weir_route_attempts_total` labels it: a word (`ok`, `cut`, `open`...)
    as it is, a well-known status as it is, any other status its class (`4xx`, `5xx`)."""
    if not outcome.isdigit() or int(outcome) in ROUTE_OUTCOME_STATUSES:
        return outcome
    return status_class(int(outcome))


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry, router: Any) -> None:
        self.attempts = Counter(
            "weir_route_attempts",
            "Upstream attempts by route, candidate and outcome (ok, cut, cancelled, open, slow, a "
            "well-known status, or another status's class: 4xx, 5xx)",
            ("route", "candidate", "outcome"),
            registry=registry,
        )
        self.hedges = Counter(
            "weir_route_hedges",
            "Hedges by route and result: started (sent beside a slow first candidate), won (answered "
            "first; the other attempt is cancelled), capped (not sent: the tenant's hedge spend cap "
            "for the hour was reached), open or slow (not sent: its breaker, or the route's latency "
            "breaker there, opened during the delay), unsupported (not sent: its API cannot express "
            "the request)",
            ("route", "result"),
            registry=registry,
        )
        registry.register(_Collector(router))
        self.in_force = router.in_force

    def attempt(self, route: str, candidate: str, outcome: str) -> None:
        """Count an attempt, unless its route is no longer in force (deleted while it ran): its
        series went with the route and must not come back (`Router.in_force`)."""
        if self.in_force(route):
            self.attempts.labels(route, candidate, attempt_outcome(outcome)).inc()

    def hedge(self, route: str, result: str) -> None:
        if self.in_force(route):
            self.hedges.labels(route, result).inc()

    def forget(self, routes: Collection[str]) -> None:
        """Stop exporting the series of route names no longer in force (`Router.set_routes`): a
        deleted or renamed route's attempts and hedges were exported for as long as the process ran."""
        drop_series(self.attempts, ("route", "candidate", "outcome"), "route", routes)
        drop_series(self.hedges, ("route", "result"), "route", routes)


class _Collector:
    def __init__(self, router: Any) -> None:
        self.router = router

    def collect(self) -> Iterator[Any]:
        states = GaugeMetricFamily(
            "weir_route_breaker_state",
            "Circuit breaker per backend/model: 0 closed, 1 half-open, 2 open",
            labels=("breaker",),
        )
        for key, breaker in list(self.router.breakers.breakers.items()):
            states.add_metric((key,), OPENNESS[breaker.current()])
        yield states
        latency = GaugeMetricFamily(
            "weir_route_latency_breaker_state",
            "A route's own latency breaker per backend/model (its ttft_timeout there, where other routes "
            "wait longer): 0 closed, 1 half-open, 2 open",
            labels=("route", "breaker"),
        )
        # Only the routes in force keep latency breakers, so a route deleted or edited leaves no
        # series behind; routes of one label show as one (two series of one label set fail a scrape).
        for route, by_key in sorted(self.router.breakers.latency_states().items()):
            for key, state in sorted(by_key.items()):
                latency.add_metric((route, key), OPENNESS[state])
        yield latency
        affinity = CounterMetricFamily(
            "weir_prefix_affinity_requests",
            "prefix_affinity requests with text that one of the route's replicas served: hit (the "
            "preferred replica served it) or miss (another replica did)",
            labels=("route", "result"),
        )
        for route, (hits, total) in list(self.router.context.affinity.items()):
            affinity.add_metric((route, "hit"), hits)
            affinity.add_metric((route, "miss"), total - hits)
        yield affinity
        cache = CounterMetricFamily(
            "weir_prefix_affinity_prompt_tokens",
            "Prompt tokens of prefix_affinity routes: cached (read from the replica's prefix cache, as it "
            "reported) or computed",
            labels=("route", "source"),
        )
        for route, (prompt, cached) in list(self.router.context.stats.affinity_tokens.items()):
            cache.add_metric((route, "cached"), cached)
            cache.add_metric((route, "computed"), prompt - cached)
        yield cache
        # Which difficulty head this replica serves: with `difficulty_head: auto` replicas on different
        # CPUs can differ, and their scores with them.
        serving = self.router.context.serving
        if serving is not None:
            head = GaugeMetricFamily(
                "weir_difficulty_head", "The difficulty classifier this replica serves (1)", labels=("head",)
            )
            head.add_metric((serving,), 1)
            yield head
        # Trained heads the routes name, and whether this replica serves them: alert on missing/failed.
        heads = self.router.heads
        if heads is not None and heads.wanted:
            trained = GaugeMetricFamily(
                "weir_difficulty_trained_head",
                "Trained difficulty heads routes name, by state on this replica: loaded (digest set), "
                "loading, missing (not stored), failed (1)",
                labels=("head", "state", "digest"),
            )
            for name in sorted(heads.wanted):
                loaded = heads.get(name)
                trained.add_metric((name, heads.status(name), loaded.digest[:12] if loaded else ""), 1)
            yield trained

        # Stored routes this replica does not serve (GET /admin/api/v1/routes/status says which and why):
        # a model removed from its config, a spec another version wrote. Only with the admin DB.
        store = self.router.store
        if store is not None:
            left_out = GaugeMetricFamily(
                "weir_routes_left_out", "Routes stored in the admin DB that this replica leaves out"
            )
            left_out.add_metric((), len(store.left_out))
            yield left_out
            # The latest table read was refused as a whole: this replica serves routes older than the
            # table, and no edit reaches it until the table changes again (routes/status says why).
            rejected = GaugeMetricFamily(
                "weir_routes_rejected",
                "1 while this replica refuses the routes table in the admin DB as a whole and keeps "
                "serving the routes it loaded before it, else 0",
            )
            rejected.add_metric((), 1 if store.rejected is not None else 0)
            yield rejected

    def describe(self) -> list[Any]:
        return []  # collected lazily: nothing to check at registration
