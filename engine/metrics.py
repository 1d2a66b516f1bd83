"""Prometheus metrics of the engine server: latency histograms and token counters observed per request,
plus the engine's own state (running/waiting requests, KV-cache use, prefix-cache hits) read at scrape
time. Each server has its own registry, so several servers (tests) never collide."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats
    from engine.speculative import SpecStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 60)
# A request's time to its first token (queued behind others) and to its last (thousands of tokens):
# minutes, where a latency past the last finite bucket is one no quantile can place.
REQUEST_BUCKETS = (*LATENCY_BUCKETS, 120, 300, 600)
THROUGHPUT_WINDOW_S = 10.0


class EngineMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "weir_engine_time_to_first_token_seconds",
            "Time from receiving a request to its first generated token.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "weir_engine_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "weir_engine_request_latency_seconds",
            "Time from receiving a request to its last token.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("weir_engine_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.cached_tokens = Counter(
            "weir_engine_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.generation_tokens = Counter("weir_engine_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "weir_engine_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.refused = Counter(
            "weir_engine_requests_refused",
            "Requests refused with a 429 because more than --max-queued sequences would have waited.",
            registry=r,
        )
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) in the throughput window
        r.register(_EngineStateCollector(stats, self._tokens_per_second))

    def observe_tokens(self, n: int, now: float) -> None:
        self.generation_tokens.inc(n)
        self._recent.append((now, n))

    def finish(self, reason: str, prompt: int, cached: int, started: float, now: float) -> None:
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.e2e.observe(now - started)

    def _tokens_per_second(self) -> float:
        horizon = time.perf_counter() - THROUGHPUT_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStateCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], tokens_per_second: Callable[[], float]):
        self._stats = stats
        self._tps = tokens_per_second

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "weir_engine_generation_tokens_per_second",
            f"Tokens generated per second over the last {THROUGHPUT_WINDOW_S:g} s.",
            value=self._tps(),
        )
        s = self._stats()
        if s is None:
            return
        yield GaugeMetricFamily(
            "weir_engine_num_requests_running", "Requests in the batch.", value=s.num_running
        )
        yield GaugeMetricFamily(
            "weir_engine_num_requests_waiting", "Requests queued for admission.", value=s.num_waiting
        )
        used = s.kv_blocks_total - s.kv_blocks_free
        yield GaugeMetricFamily(
            "weir_engine_kv_cache_usage_ratio",
            "Fraction of the model's KV-cache blocks in use (cached-but-free prefix blocks count as "
            "free; a draft model's cache is weir_engine_draft_kv_cache_*).",
            value=used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        )
        yield GaugeMetricFamily(
            "weir_engine_kv_cache_blocks_total", "The model's KV-cache blocks.", value=s.kv_blocks_total
        )
        yield GaugeMetricFamily(
            "weir_engine_kv_cache_blocks_free", "Free KV-cache blocks of the model.", value=s.kv_blocks_free
        )
        if s.draft_kv_blocks_total:
            yield from _draft_cache_metrics(s)
        yield CounterMetricFamily(
            "weir_engine_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=s.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "weir_engine_prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            value=s.prefix_cache_hits,
        )
        yield GaugeMetricFamily(
            "weir_engine_prefix_cache_hit_rate",
            "Prefix-cache hits / queries, in tokens, since start.",
            value=s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
        )
        yield CounterMetricFamily(
            "weir_engine_preemptions",
            "Requests preempted (recomputed) for lack of KV blocks.",
            value=s.num_preemptions,
        )
        if s.speculative is not None:
            yield from _speculative_metrics(s.speculative)


def _draft_cache_metrics(s: EngineStats) -> Iterator[Metric]:
    """A speculative draft model's own KV cache (only with one): paid from the same memory as the
    model's, but dropped whenever it runs short, so it never holds a request up."""
    used = s.draft_kv_blocks_total - s.draft_kv_blocks_free
    yield GaugeMetricFamily(
        "weir_engine_draft_kv_cache_usage_ratio",
        "Fraction of the draft model's KV-cache blocks held for requests (idle ones are dropped on demand).",
        value=used / s.draft_kv_blocks_total,
    )
    yield GaugeMetricFamily(
        "weir_engine_draft_kv_cache_blocks_total",
        "The draft model's KV-cache blocks.",
        value=s.draft_kv_blocks_total,
    )
    yield GaugeMetricFamily(
        "weir_engine_draft_kv_cache_blocks_free",
        "Free KV-cache blocks of the draft model.",
        value=s.draft_kv_blocks_free,
    )


def _speculative_metrics(spec: SpecStats) -> Iterator[Metric]:
    """Speculative decoding (only when it is on): acceptance by draft position (1 = the first drafted
    token), tokens per verification step and the tokens/s that verification steps emitted."""
    method = ["method"]
    proposed = CounterMetricFamily(
        "weir_engine_spec_draft_tokens",
        "Drafted tokens verified, by draft position.",
        labels=[*method, "position"],
    )
    accepted = CounterMetricFamily(
        "weir_engine_spec_accepted_tokens",
        "Drafted tokens accepted, by draft position.",
        labels=[*method, "position"],
    )
    rate = GaugeMetricFamily(
        "weir_engine_spec_acceptance_rate",
        "Accepted / drafted tokens since start, by draft position.",
        labels=[*method, "position"],
    )
    for i, (p, a) in enumerate(
        zip(spec.proposed_by_position, spec.accepted_by_position, strict=True), start=1
    ):
        labels = [spec.method, str(i)]
        proposed.add_metric(labels, p)
        accepted.add_metric(labels, a)
        rate.add_metric(labels, a / p if p else 0.0)
    yield proposed
    yield accepted
    yield rate
    steps = CounterMetricFamily(
        "weir_engine_spec_verification_steps",
        "Request-steps that verified at least one drafted token.",
        labels=method,
    )
    steps.add_metric([spec.method], spec.num_steps)
    yield steps
    emitted = CounterMetricFamily(
        "weir_engine_spec_emitted_tokens",
        "Tokens emitted by verification steps (accepted drafts plus the target's own token).",
        labels=method,
    )
    emitted.add_metric([spec.method], spec.num_emitted_tokens)
    yield emitted
    mean_accepted = GaugeMetricFamily(
        "weir_engine_spec_mean_accepted_tokens_per_step",
        "Accepted drafted tokens per verification step, since start.",
        labels=method,
    )
    mean_accepted.add_metric(
        [spec.method], spec.num_accepted_tokens / spec.num_steps if spec.num_steps else 0.0
    )
    yield mean_accepted
    tps = GaugeMetricFamily(
        "weir_engine_spec_tokens_per_second",
        f"Tokens emitted by verification steps per second over the last {THROUGHPUT_WINDOW_S:g} s.",
        labels=method,
    )
    tps.add_metric([spec.method], spec.tokens_per_second)
    yield tps
