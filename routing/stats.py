"""What routing learns from traffic: moving averages per backend and upstream model, fed by the
usage events every attempt produces (so it sees exactly what the ledger sees)."""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import TokenClass
from gateway.usage import Usage

if TYPE_CHECKING:
    from routing.router import InForce
    from routing.routes import Route

ALPHA = 0.2  # weight of the newest observation in each moving average
WINDOW = 200  # recent TTFTs kept for the p95
# ...and none older than this: an estimate this old says how fast the model was then (REMEASURE_S,
# below, restarts the averages by the same rule). Kept by count alone, a window full of an incident's
# slow answers and timeouts (up to MAX_CENSORED_S each) held the `p95` hedge delay there after the
# backend recovered until 200 new observations had come, hours on a quiet route, and for good where
# `lowest_latency` sent the model nothing but its hedges.
WINDOW_AGE_S = 300.0
# Decode speed is learned only from streams this long. Over a handful of tokens the decode time is
# mostly scheduling jitter: on a loaded host one 0.3 s stall turned a 3-token stream's 100 tokens/s
# into 6, which then outweighed any difference in time to first token (a flaky lowest_latency test).
MIN_DECODE_TOKENS = 16
# `lowest_latency` tries a candidate it has not measured first, so that it gets measured; one whose
# last attempt failed (no answer, 429, 5xx) has had that try and waits this long for another.
RETRY_UNMEASURED_S = 30.0
# The most a censored observation (`_slower_than`) counts for in the p95 window. Uncapped, a p95
# hedge's delay fed itself: each race the first candidate loses is entered as slower than the delay
# (the delay plus the hedge's time to answer), so where that candidate stopped answering (more than 5%
# of its window soon lost races) every lost race lifted the delay a little further, without end.
# Answers are entered as they came, and the moving average takes censored ones uncapped: no delay
# comes from it.
MAX_CENSORED_S = 10.0
# `lowest_latency` sends one request to a candidate it ranks behind the fastest once its estimate is
# this old: a backend that was slow (an incident, a cold start) is otherwise never asked again, so its
# estimate never learns that it recovered. At most one request per candidate per this many seconds.
REMEASURE_S = 300.0


# Prompt sizes (tokens) whose cache shares are kept apart: vendors cache no prompt under a minimum
# (OpenAI, Claude Sonnet and Opus, Gemini Flash: 1,024; Claude Haiku: 2,048; Gemini Pro: 4,096), so
# a model's long prompts may read 90% from its cache while its short ones read nothing.
CACHE_SIZE_BOUNDS = (1024, 2048, 4096)


def size_class(prompt_tokens: int) -> int:
    """Which of the `CACHE_SIZE_BOUNDS` classes a prompt of `prompt_tokens` is in (0: the shortest)."""
    return bisect.bisect_right(CACHE_SIZE_BOUNDS, prompt_tokens)


@dataclass(slots=True)
class CacheShares:
    """Moving averages of an answer's prompt tokens and of those read from the prompt cache and
    written to it (at the 5-minute and 1-hour TTL prices): their ratios are the shares `cheapest`
    prices each at its own price. Shares of tokens, not an average of each answer's share: where
    long cached prompts mix with shorter ones, each answer's share counted alike whatever its size,
    and a model with a cheap cache lost a long request to a dearer one."""

    prompt: float | None = None
    cached: float = 0.0
    write_5m: float = 0.0
    write_1h: float = 0.0

    def add(self, usage: Usage) -> None:
        first = self.prompt is None  # each average starts at its first value
        self.prompt = _ewma(self.prompt, usage.prompt_tokens)
        self.cached = _ewma(None if first else self.cached, usage.cached_input_tokens)
        self.write_5m = _ewma(None if first else self.write_5m, usage.cache_write_5m_tokens)
        self.write_1h = _ewma(None if first else self.write_1h, usage.cache_write_1h_tokens)

    def shares(self) -> dict[TokenClass, float] | None:
        prompt = self.prompt
        if not prompt:
            return None
        return {
            TokenClass.CACHED_INPUT: self.cached / prompt,
            TokenClass.CACHE_WRITE_5M: self.write_5m / prompt,
            TokenClass.CACHE_WRITE_1H: self.write_1h / prompt,
        }


class Window:
    """The latest observations (seconds) a p95 is read from: the last WINDOW of them, none older than
    WINDOW_AGE_S (`recent`, oldest first)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (monotonic time, value)

    def append(self, value: float) -> None:
        self._seen.append((time.monotonic(), value))

    def recent(self) -> list[float]:
        oldest = time.monotonic() - WINDOW_AGE_S
        while self._seen and self._seen[0][0] < oldest:
            self._seen.popleft()
        return [value for _, value in self._seen]


# A `delay: p95` hedge trusts an observed p95 from this many observations on: from fewer it is their
# maximum (one observation's p95 is that observation), which hedged about one request in n + 1 (half
# of them after the first), so until then the delay is at least DEFAULT_HEDGE_DELAY_S.
MIN_P95_SAMPLES = 20
DEFAULT_HEDGE_DELAY_S = 1.0


@dataclass(slots=True)
class ModelStats:
    # moving average time to first token (streams), counting attempts too slow to reach it (`_censored`)
    ttft_s: float | None = None
    tokens_per_s: float | None = None  # moving average decode speed after the first token
    latency_s: float | None = None  # moving average whole-attempt latency
    # What the model's prompt cache served and was written with: over all its answers (what
    # /routes/status reports) and by prompt size (`size_class`, what `cheapest` expects).
    cache: CacheShares = field(default_factory=CacheShares)
    cache_by_size: dict[int, CacheShares] = field(default_factory=dict)
    # Moving average of an answer's reasoning tokens, billed as output though the client never sees
    # them: `cheapest` expects them on top of the route's `expected_output_tokens`. A reasoning model
    # writes thousands; priced at the route's expected answer alone, it looked as cheap as a model
    # that writes just the answer.
    reasoning_tokens: float | None = None
    # Whether the model streams its reasoning (DeepSeek's `reasoning_content`, Claude's thinking), as
    # its last stream with reasoning did (`UsageEvent.reasoning_streamed`): then its time to first
    # token is its first reasoning token's, and `lowest_latency` expects the reasoning's time after
    # it. Hidden reasoning (OpenAI's reasoning models, Gemini's thoughts) is inside the TTFT already.
    streams_reasoning: bool = False
    ttfts: Window = field(default_factory=Window)  # for the p95, likewise
    # Whole-answer latencies of attempts not streamed (answers, and censored ones likewise): the p95 a
    # hedge of a request not streamed waits, whose "first token" is its whole answer. A stream's
    # time to first token is a fraction of that: waited, nearly every such request was hedged.
    answers: Window = field(default_factory=Window)
    samples: int = 0
    # monotonic times its speed was last learned from an answer and `lowest_latency` last sent a
    # request to measure it (unmeasured, or again after REMEASURE_S). An attempt too slow to answer is
    # no new estimate to start from: it says only that the answer would have come later
    # (`_slower_than`).
    learned_at: float | None = None
    measuring_at: float | None = None
    failed_at: float | None = None  # monotonic time of the backend's last failed attempt, until one succeeds
    # The number (`PolicyContext.picks`) of the last request `lowest_latency` planned to send it first
    # while unmeasured (0: none), marked when planned: `measuring_at` is marked once a request is sent,
    # so a burst planned before that all went to the first listed unmeasured candidate.
    picked: int = 0

    @property
    def cache_hit_rate(self) -> float | None:
        """The observed share of prompt tokens read from the prompt cache; None before the model's
        first usage event with a prompt."""
        shares = self.cache.shares()
        return shares[TokenClass.CACHED_INPUT] if shares is not None else None

    def prompt_shares(self, prompt_tokens: int) -> dict[TokenClass, float] | None:
        """The observed shares of a prompt of `prompt_tokens` billed as each cache class (the rest
        bill as input): those of the model's prompts of its size class; None before one was seen."""
        found = self.cache_by_size.get(size_class(prompt_tokens))
        return found.shares() if found is not None else None

    def p95_ttft(self) -> float | None:
        return _p95(self.ttfts.recent())

    def hedge_delay(self, stream: bool, min_delay: float) -> float:
        """What a `delay: p95` hedge waits for this model's answer (`stream`: its first token; else its
        whole answer, which is what a request not streamed waits for): the observed p95 of that, at
        least `min_delay`; at least DEFAULT_HEDGE_DELAY_S too while its window (`Window`: the last
        WINDOW_AGE_S) holds fewer than MIN_P95_SAMPLES."""
        window = (self.ttfts if stream else self.answers).recent()
        observed = _p95(window)
        if observed is None or len(window) < MIN_P95_SAMPLES:
            observed = max(observed or 0.0, DEFAULT_HEDGE_DELAY_S)
        return max(min_delay, observed)


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


def _learning(stats: ModelStats) -> None:
    """A new observation of the model's speed: the averages start again from it where the last one
    is more than REMEASURE_S old. They say how fast it was then; averaged in at ALPHA, a backend
    measured while it was slow took a dozen answers to look fast again, and `lowest_latency` asks one
    it ranks behind only once per REMEASURE_S."""
    now = time.monotonic()
    if stats.learned_at is not None and now - stats.learned_at > REMEASURE_S:
        stats.ttft_s = stats.tokens_per_s = stats.latency_s = None
    stats.learned_at = now


def _decoded_tokens(event: UsageEvent) -> int:
    """The output tokens a stream generated from its first token on, the time decode speed is timed
    over: its reasoning tokens only where it streamed its reasoning (`reasoning_streamed`). Reasoning
    a vendor hides (OpenAI's reasoning models, Gemini's thoughts) is billed as output but generated
    before the first token, in the time to first token: counted, a reasoning model's hundreds of
    hidden tokens over its short answer's stream read as thousands of tokens/s, and `lowest_latency`
    expected its long answers to take no time at all."""
    usage = event.usage
    return usage.output_tokens if event.reasoning_streamed else usage.output_tokens - usage.reasoning_tokens


def _censored(event: UsageEvent) -> bool:
    """Whether a failed attempt says its backend is at least as slow as the attempt lasted: it ended
    without its answer (a stream: its first token) because it was too slow, not for anything the
    backend said (a 4xx, a 5xx, a refused connection) nor because its client left. So: a hedge race's
    loser (`cancelled`, the router's 499; a client's is `client_disconnected`) and a timeout (504:
    the route's TTFT timeout, the backend's own timeouts)."""
    return event.ttft_ms is None and (event.status == 504 or event.error == "cancelled")


def _slower_than(stats: ModelStats, event: UsageEvent) -> None:
    """A censored observation: the answer (a stream's first token) would have come later than the
    attempt's `latency_ms`, by how much is unknown. The moving average takes that lower bound where
    it is above the average and leaves it out otherwise: below, it says nothing (a hedge that lost
    after a few ms), and as a value it would pull the estimate down. The p95 window takes it by the
    same rule, at most MAX_CENSORED_S: each value there is at most its attempt's true time, so the
    delay `p95` follows a backend that slowed down up to what its attempts really took, never beyond,
    and one that stopped answering up to MAX_CENSORED_S."""
    waited = event.latency_ms / 1000
    windowed = min(waited, MAX_CENSORED_S)
    if not event.stream and (stats.latency_s is None or windowed > stats.latency_s):
        stats.answers.append(windowed)
    if stats.latency_s is None or waited > stats.latency_s:
        stats.latency_s = _ewma(stats.latency_s, waited)
    if not event.stream:
        return
    if stats.ttft_s is None or windowed > stats.ttft_s:
        stats.ttfts.append(windowed)
    if stats.ttft_s is None or waited > stats.ttft_s:
        stats.ttft_s = _ewma(stats.ttft_s, waited)


def uses_prefix_affinity(route: Route) -> bool:
    """Whether the route keeps prefix-affinity counts (hits, cached prompt tokens)."""
    return route.policy == "prefix_affinity"


def _on_affinity_replica(routing: str) -> bool:
    """Whether an attempt (its `x-weir-route` decision) went to a prefix_affinity route's candidate,
    one of the replicas whose prefix caches the route's hit rate measures, not to a fallback (a
    vendor, say) the route moved on to once they all failed."""
    parts = routing.split("; ")
    return "policy=prefix_affinity" in parts and "reason=fallback" not in parts


class RoutingStats:
    """A UsageSink: record() is called once per attempt; must not block."""

    def __init__(self, in_force: InForce = lambda name, does=None: True) -> None:
        self.models: dict[tuple[str, str], ModelStats] = {}
        # Router.in_force: the late attempts of a route deleted, or no longer prefix_affinity, add no row
        self.in_force = in_force
        # prefix_affinity route -> [prompt tokens, of them read from the replicas' prefix caches]: the
        # hit rate the policy achieves, as the engines report it (where it sent requests is not that).
        self.affinity_tokens: dict[str, list[int]] = {}

    def get(self, backend: str, model: str) -> ModelStats:
        stats = self.models.get((backend, model))
        if stats is None:
            stats = self.models[(backend, model)] = ModelStats()
        return stats

    def record(self, event: UsageEvent) -> None:
        if not event.ok:
            # Failures feed the breakers; the backend's own (not a 4xx the request caused, nor a 499:
            # cancelled by a hedge or a client; a TTFT timeout is a 504) are noted. Only those that
            # show the backend slow teach the speed estimates (`_censored`).
            if event.status == 0 or event.status == 429 or event.status >= 500:
                self.get(event.backend, event.model).failed_at = time.monotonic()
            if _censored(event):
                _slower_than(self.get(event.backend, event.model), event)
            return
        stats = self.get(event.backend, event.model)
        stats.failed_at = None
        stats.samples += 1
        _learning(stats)
        latency = event.latency_ms / 1000
        stats.latency_s = _ewma(stats.latency_s, latency)
        if not event.stream:
            stats.answers.append(latency)
        usage = event.usage
        stats.reasoning_tokens = _ewma(stats.reasoning_tokens, usage.reasoning_tokens)
        if event.stream and usage.reasoning_tokens:  # a stream without reasoning shows neither way
            stats.streams_reasoning = event.reasoning_streamed
        if event.ttft_ms is not None:
            ttft = event.ttft_ms / 1000
            stats.ttft_s = _ewma(stats.ttft_s, ttft)
            stats.ttfts.append(ttft)
            decode_s = latency - ttft
            decoded = _decoded_tokens(event)
            if decoded >= MIN_DECODE_TOKENS and decode_s > 0:
                stats.tokens_per_s = _ewma(stats.tokens_per_s, (decoded - 1) / decode_s)
        prompt = usage.prompt_tokens
        if prompt > 0:
            stats.cache.add(usage)
            stats.cache_by_size.setdefault(size_class(prompt), CacheShares()).add(usage)
            if event.routing is not None and _on_affinity_replica(event.routing):
                tokens = self.affinity_tokens.get(event.route)
                if tokens is None and self.in_force(event.route, uses_prefix_affinity):
                    tokens = self.affinity_tokens[event.route] = [0, 0]
                if tokens is not None:
                    tokens[0] += prompt
                    tokens[1] += usage.cached_input_tokens

    def affinity_cache(self, route: str) -> dict[str, float | int | None]:
        """A prefix_affinity route's prompt tokens, how many the replicas read from cache, and the share."""
        prompt, cached = self.affinity_tokens.get(route, (0, 0))
        return {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else None,
        }
