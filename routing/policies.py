"""Routing policies: each orders a route's candidates for one request and says why.

Every policy returns the full candidate list (best first), so the ones it did not pick are the
failover order. Scores are in the unit the policy optimises (USD, seconds, p_strong, hash weight).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.accounting.pricing import TokenClass, resolve
from gateway.pipeline import model_prices
from routing.breaker import Breakers
from routing.load import LoadReports
from routing.plan import Choice, Features, Lesson, Outcome
from routing.prefixes import PrefixIndex, cuts, prefix_keys
from routing.routes import Route
from routing.stats import REMEASURE_S, RETRY_UNMEASURED_S, ModelStats, RoutingStats, uses_prefix_affinity
from routing.windows import ContextWindows

if TYPE_CHECKING:
    from routing.difficulty import HeadChoice, StrongCall, StrongShareCalibrator
    from routing.heads import HeadStore
    from routing.router import InForce

Scorer = Callable[[str], float]  # prompt -> p_strong
# (backend, upstream model, service tier or None) -> the price catalog's micro-USD per 1M tokens by
# token class, valid now, at that tier's prices over the base ones; empty where the catalog has none.
PriceLookup = Callable[[str, str, str | None], dict[TokenClass, int]]


@dataclass
class PolicyContext:
    stats: RoutingStats
    in_flight: dict[str, int] = field(default_factory=dict)  # model name -> attempts running now
    scorer: Scorer | None = None  # None: the shipped difficulty classifier, loaded on first use
    head: HeadChoice = "auto"  # which shipped classifier: "auto", "encoder" or "static" (routing.difficulty)
    serving: str | None = None  # the shipped head in use once loaded ("encoder" or "static"), for metrics
    heads: HeadStore | None = None  # trained heads routes name (`Route.head`), with the admin DB
    # (route name, which head scores[, the route's conditions]) -> StrongShareCalibrator: a new head
    # starts a new window, and so does each route of a shared name that has conditions of its own.
    calibrators: dict[tuple[str, ...], Any] = field(default_factory=dict)
    # route name -> [hits, requests]: requests with text its replicas served, of them by the preferred one
    affinity: dict[str, list[int]] = field(default_factory=dict)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # prefix affinity's memory
    loads: LoadReports = field(default_factory=LoadReports)  # engine replicas' own queue reports
    rng: random.Random = field(default_factory=random.Random)
    # The executor's circuit breakers (the router's), which prefix affinity reads: a replica they would
    # skip is not where a request goes, nor where its prefixes are remembered.
    breakers: Breakers | None = None
    # The admin DB's price catalog, which bills every attempt (an admin may change it at any time);
    # None, or a model it has no row for: the config's `price`.
    prices: PriceLookup | None = None
    # Router.in_force: a request sent after its route was deleted or edited (since its plan awaited a
    # score or a prefix look-up in Redis, or the gateway's admission) adds back no window or count the
    # table change let go of (`forget`).
    in_force: InForce = lambda name, does=None: True
    # The router's context windows (what backends' model lists and 400s say, `routing.windows`), which
    # the executor fits each attempt's output in: a candidate is fitted to a request in the same one.
    windows: ContextWindows = field(default_factory=ContextWindows)
    # Numbers the requests `lowest_latency` plans to send an unmeasured candidate first
    # (`ModelStats.picked`), so a burst planned before any is sent takes each in turn.
    picks: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def score_difficulty(self, prompt: str) -> float:
        if self.scorer is None:
            from routing.difficulty import DifficultyClassifier

            clf = DifficultyClassifier.default(self.head)
            self.scorer, self.serving = clf.score, clf.kind
        return self.scorer(prompt)

    def warm(self) -> None:
        """Load the shipped classifier (a second or two: torch, MiniLM's first layers and, for "auto",
        timing them) unless a scorer is set; `Router` calls this off the event loop as soon as a
        difficulty route exists."""
        if self.scorer is None:
            from routing.difficulty import DifficultyClassifier

            self.serving = DifficultyClassifier.default(self.head).kind

    def affinity_hit_rate(self, route: str) -> float | None:
        """Of the route's requests that affinity could apply to, served by its replicas, the share
        the preferred replica served (`AffinityOutcome`); None before the first."""
        hits, total = self.affinity.get(route, (0, 0))
        return hits / total if total else None

    def forget(self, routes: Sequence[Route]) -> None:
        """Let go of what was learned for routes no longer in force (`Router.set_routes`): routes
        are created, renamed and deleted through the admin API while a replica runs for weeks, and
        each strong-share window holds up to 2,000 scores. Kept: the windows of difficulty routes
        with a target share (`reads_window`), and prefix_affinity routes' counts."""
        by_name: dict[str, list[Route]] = {}
        for route in routes:
            by_name.setdefault(route.name, []).append(route)
        for key in list(self.calibrators):
            if not any(reads_window(route, key) for route in by_name.get(key[0], ())):
                del self.calibrators[key]
        for table in (self.affinity, self.stats.affinity_tokens):
            for name in [n for n in table if not any(map(uses_prefix_affinity, by_name.get(n, ())))]:
                del table[name]


def head_name(label: str | None) -> str | None:
    """The trained head a scoring label names (`name@digest`, routing.heads.TrainedHead.label); None
    for a shipped head's label, or none."""
    return label.rsplit("@", 1)[0] if label and "@" in label else None


def _route_key(route: Route) -> tuple[str, ...]:
    """The route's name and, for one with conditions, those: routes sharing a name keep their own."""
    if route.when is None:
        return (route.name,)
    return (route.name, msgspec.json.encode(route.when).decode())


def reads_window(route: Route, key: tuple[str, ...]) -> bool:
    """Whether `route` reads the strong-share window `key` (route name, scoring head[, conditions]):
    a difficulty route with a target share, of that name and those conditions, scored by a shipped
    head or the trained head it names (one it no longer names is not read again)."""
    trained = head_name(key[1])
    return (
        route.policy == "difficulty"
        and route.strong_share is not None
        and trained in (None, route.head)
        and _route_key(route) == (key[0], *key[2:])
    )


async def order(
    route: Route, choices: list[Choice], feats: Features, ctx: PolicyContext, lessons: list[Lesson] | None
) -> tuple[list[Choice], str, Outcome | None]:
    """The candidates in order, the policy's note and what it counts by where the request is served
    (`Plan.outcome`). What the policy learns from the request (strong-share windows, prefixes) goes to
    `lessons`, to be kept once the request is sent (`Plan.commit`); None (a preview, a token count)
    learns nothing."""
    if route.policy == "fixed":
        for choice in choices:
            choice.reason = "fixed"
        return choices, "", None
    if route.policy == "weighted":
        return weighted(choices, ctx.rng), "", None
    if route.policy == "cheapest":
        return cheapest(route, choices, feats, ctx), "", None
    if route.policy == "lowest_latency":
        return lowest_latency(route, choices, feats, ctx, lessons), "", None
    if route.policy == "difficulty":
        return (*await difficulty(route, choices, feats, ctx, lessons), None)
    ordered, outcome = await prefix_affinity(route, choices, feats, ctx, lessons)
    return ordered, "", outcome


def weighted(choices: list[Choice], rng: random.Random) -> list[Choice]:
    # Weighted sampling without replacement (Efraimidis-Spirakis): the first is drawn by weight, the
    # rest follow in a weighted-random order as fallbacks. The key u^(1/w), highest first, is compared
    # as log(-ln u) - ln w, lowest first (the same order): the power underflows to 0 for small weights
    # (0.001 and 0.003 tied at 0 in 5% of draws, which then went to the first listed) and rounds to 1
    # for huge ones, and ln(u)/w overflows to -inf below ~1e-308 (every such candidate tied). So every
    # positive weight a route holds is drawn by what it says.
    keyed = []
    for choice in choices:
        weight = choice.candidate.weight
        choice.score = weight
        choice.reason = "weighted"
        exponential = -math.log(1.0 - rng.random())  # 1 - [0, 1): never log(0)
        key = math.log(exponential) - math.log(weight) if exponential > 0 else -math.inf
        keyed.append((key, choice))
    keyed.sort(key=lambda item: item[0])
    return [choice for _, choice in keyed]


def fits(choice: Choice, feats: Features, output_tokens: int, windows: ContextWindows) -> str | None:
    """Why the candidate cannot take this request, or None when it can. Its window is the one its
    attempt is fitted in (`ContextWindows.of`): a model list's or a 400's where the backend said one,
    at most the candidate's `context_window`, so one declared larger than the backend serves no longer
    sends a request the backend cannot hold to the cheapest candidate."""
    candidate = choice.candidate
    window = windows.of(choice)
    if window is not None and feats.prompt_tokens + output_tokens > window:
        return "context_window"
    if feats.tools and not candidate.tools:
        return "no_tools"
    if feats.images and not candidate.vision:
        return "no_vision"
    return None


def _stats(choice: Choice, ctx: PolicyContext) -> ModelStats:
    """What the router has learned of this candidate's model on its backend."""
    return ctx.stats.get(choice.target.backend.name, choice.target.upstream_model)


def expected_cost(choice: Choice, feats: Features, output_tokens: float, ctx: PolicyContext) -> float:
    """Expected USD for this request at the prices that will bill it, counting the shares of the
    prompt the cache is expected to serve and to be written with (each billed at its own price:
    writes cost more than input). `output_tokens` is one choice's: a request for `n` of them is
    billed each one's output, its prompt once."""
    backend, model = choice.target.backend.name, choice.target.upstream_model
    # At the prices of the service tier the request asks for, where the candidate prices one of that
    # name (OpenAI's `flex`, `priority`: served as asked), else the base prices.
    asked = feats.service_tier
    catalog = ctx.prices(backend, model, asked) if ctx.prices is not None else {}
    # In micro-USD per 1M tokens, as billing finds them (`model_prices`: above the model's long-context
    # threshold every token bills at its rates), unpriced classes as billing prices them (`resolve`).
    prices = resolve(
        model_prices(choice.target.model, catalog, asked, feats.prompt_tokens, choice.target.backend.type)
    )
    shares = _cache_shares(choice, feats, ctx)
    input_price = prices.get(TokenClass.INPUT, 0)
    per_prompt_token = input_price + sum(
        share * (prices.get(token_class, input_price) - input_price) for token_class, share in shares.items()
    )
    output_price = prices.get(TokenClass.OUTPUT, 0)
    output = output_tokens * feats.choices
    return (feats.prompt_tokens * per_prompt_token + output * output_price) / 1e12


def _cache_shares(choice: Choice, feats: Features, ctx: PolicyContext) -> dict[TokenClass, float]:
    """The shares of the prompt expected to bill as each cache class: those observed on the model's
    prompts of its size (`routing.stats.size_class`), or before one is seen the candidate's
    `cache_hit_rate` read. No share on Anthropic for a request without a breakpoint: it caches nothing
    that no `cache_control` marks (neither reads nor writes), so the share its other traffic (clients
    that mark one) reads was a discount this request never gets."""
    if choice.target.backend.type == "anthropic" and feats.cache_breakpoints is False:
        return {}
    stats = _stats(choice, ctx)
    observed = stats.prompt_shares(feats.prompt_tokens)
    return observed or {TokenClass.CACHED_INPUT: choice.candidate.cache_hit_rate}


def expected_output(
    choice: Choice, route: Route, feats: Features, ctx: PolicyContext, reasoning: bool = True
) -> float:
    """Output tokens to expect of this candidate: the route's `expected_output_tokens` and, with
    `reasoning`, the reasoning (hidden or streamed) its answers have been observed to bill on top
    (moving average); at most the request's limit (which counts reasoning too). The limit itself is a
    ceiling, not an expectation: the Messages API requires one and clients set 4,096 or more whatever
    they ask; priced at it, output prices outweighed any prompt (and decode speed any time to first
    token), so the candidate where the request cost (or took) the most could win."""
    expected = float(route.expected_output_tokens)
    if reasoning:
        stats = _stats(choice, ctx)
        expected += stats.reasoning_tokens or 0.0
    limit = feats.requested_output_tokens
    return expected if not limit else min(expected, choice.output_within(limit))


def output_room(choice: Choice, route: Route, feats: Features) -> int:
    """The output an attempt on this candidate may write: the request's limit (without one, the
    route's expected output), lowered to the model's own `max_output_tokens` as the attempt is
    (`routing.execute.within_output_limit`)."""
    return choice.output_within(feats.requested_output_tokens or route.expected_output_tokens)


def cheapest(route: Route, choices: list[Choice], feats: Features, ctx: PolicyContext) -> list[Choice]:
    fitting, misfits = [], []
    for choice in choices:
        choice.score = expected_cost(choice, feats, expected_output(choice, route, feats, ctx), ctx)
        # What must fit the window is what the request may write there: vendors refuse a prompt
        # whose limit does not fit, however short its answers turn out.
        why = fits(choice, feats, output_room(choice, route, feats), ctx.windows)
        if why is None:
            choice.reason = "cheapest_fit"
            fitting.append(choice)
        else:
            choice.reason = why
            misfits.append(choice)
    fitting.sort(key=lambda c: c.score or 0.0)
    if fitting:
        return fitting

    # Nothing fits: let the backends refuse it with their own message, but ask first those likeliest
    # to take it (a 400 ends the request: it never fails over). The prompt's size is an estimate, so
    # a window too small may still do, the largest first; a missing capability is certain, so last.
    def likeliest(choice: Choice) -> tuple[int, float, float]:
        candidate = choice.candidate
        lacks = (feats.tools and not candidate.tools) + (feats.images and not candidate.vision)
        window = ctx.windows.of(choice)
        return lacks, -(window if window is not None else math.inf), choice.score or 0.0

    return sorted(misfits, key=likeliest)


# `lowest_latency`'s order by reason: unmeasured first (so each gets measured), then one whose
# estimate is stale (so it is measured again), then by expected seconds, then unmeasured ones whose
# measuring request is under way, and one unmeasured that failed last.
_LATENCY_RANK = {
    "unmeasured": 0,
    "remeasure": 1,
    "expected_seconds": 2,
    "measuring": 3,
    "unmeasured_failed": 4,
}


def lowest_latency(
    route: Route, choices: list[Choice], feats: Features, ctx: PolicyContext, lessons: list[Lesson] | None
) -> list[Choice]:
    now = time.monotonic()
    # A candidate with a time to first token but no decode speed yet (its streams all shorter than
    # MIN_DECODE_TOKENS) is expected to decode at the route's median measured speed: scored on its
    # time to first token alone, it beat every candidate whose score counts the whole answer.
    speeds = [s.tokens_per_s for s in (_stats(c, ctx) for c in choices) if s.ttft_s and s.tokens_per_s]
    prior = statistics.median(speeds) if speeds else None
    for choice in choices:
        stats = _stats(choice, ctx)
        if stats.ttft_s is None and stats.latency_s is not None:
            # Answered (or too slow to: `routing.stats`), but never streamed (no first token to
            # time): the whole attempts' moving average. Left "unmeasured", a route whose clients
            # never stream measured no one and sent every request to the first listed candidate,
            # however slow.
            choice.score, choice.reason = stats.latency_s, "expected_seconds"
            continue
        if stats.ttft_s is None:
            # No score: there is no expected time to show (`score=0` read as an instant answer).
            choice.score, choice.reason = None, _unmeasured(stats, now)
            continue
        # The answer, and the reasoning only where the model streams it: hidden reasoning comes
        # before the first token, so the time to first token counts it already; streamed, the first
        # token is reasoning, and all of it is still to come (left out, DeepSeek's reasoner, whose
        # first token comes at once, looked faster than a model that answers without reasoning).
        output_tokens = expected_output(choice, route, feats, ctx, reasoning=stats.streams_reasoning)
        speed = stats.tokens_per_s or prior
        decode = output_tokens / speed if speed else 0.0
        choice.score, choice.reason = stats.ttft_s + decode, "expected_seconds"

    def rank(choice: Choice) -> tuple[int, float, int]:
        # Unmeasured ones by the request that last picked each (never: 0), so a burst planned before
        # any of it is sent (and marks its candidate `measuring`) takes each in turn: planned in the
        # listed order, every request of it went to the first.
        picked = _stats(choice, ctx).picked if choice.reason == "unmeasured" else 0
        return _LATENCY_RANK[choice.reason], choice.score or 0.0, picked

    ranked = sorted(choices, key=rank)
    stale = _stale(route, ranked, ctx, now)
    if stale is not None:
        stale.reason = "remeasure"
        ranked.remove(stale)
        ranked.insert(0, stale)
    first = ranked[0]
    if lessons is not None and first.reason == "unmeasured":
        _stats(first, ctx).picked = next(ctx.picks)
    # Not one behind an open breaker: the executor skips it, and no request measures it.
    if lessons is not None and first.reason in ("unmeasured", "remeasure") and not _open(first, route, ctx):
        lessons.append(lambda: _measuring(first, ctx))
    return ranked


def _unmeasured(stats: ModelStats, now: float) -> str:
    """Where a candidate with no speed estimate goes. First ("unmeasured"), so that it gets measured,
    unless a request was sent to measure it within RETRY_UNMEASURED_S ("measuring": its usage event
    comes when the attempt ends, after a whole stream; until then every request went to it, a flood
    of each candidate in turn after each restart, the slow ones too) or its last attempt failed then
    ("unmeasured_failed": it had its turn; first again, it was every request's first attempt, with no
    breaker until it answered)."""
    if stats.failed_at is not None and now - stats.failed_at < RETRY_UNMEASURED_S:
        return "unmeasured_failed"
    if stats.measuring_at is not None and now - stats.measuring_at < RETRY_UNMEASURED_S:
        return "measuring"
    return "unmeasured"


def _stale(route: Route, ranked: list[Choice], ctx: PolicyContext, now: float) -> Choice | None:
    """The measured candidate behind the first whose speed was learned (or last asked to be learned)
    longest ago, more than REMEASURE_S ago, and whose breaker would let a request through. One the
    policy ranks behind others gets no traffic: a backend that was slow for a while (an incident, a
    cold start) kept that estimate, and its place behind, long after it recovered."""
    if ranked[0].reason != "expected_seconds":
        return None  # an unmeasured candidate is measured first, this request
    oldest: tuple[float, Choice] | None = None
    for choice in ranked[1:]:
        if choice.reason != "expected_seconds":
            continue
        stats = _stats(choice, ctx)
        seen = max(stats.learned_at or 0.0, stats.measuring_at or 0.0)
        if now - seen <= REMEASURE_S or _open(choice, route, ctx):
            continue
        if oldest is None or seen < oldest[0]:
            oldest = (seen, choice)
    return oldest[1] if oldest is not None else None


def _measuring(choice: Choice, ctx: PolicyContext) -> None:
    """A request was sent to measure `choice`: the next ones go elsewhere until its answer comes (an
    unmeasured one for RETRY_UNMEASURED_S at most, a stale one for REMEASURE_S), not all of them."""
    _stats(choice, ctx).measuring_at = time.monotonic()


async def difficulty(
    route: Route, choices: list[Choice], feats: Features, ctx: PolicyContext, lessons: list[Lesson] | None
) -> tuple[list[Choice], str]:
    weak, strong = choices[0], choices[1]
    trained = None
    if route.head is not None and ctx.heads is not None:
        trained = ctx.heads.get(route.head)
        if trained is None and ctx.serving is None and ctx.scorer is None:
            # The route's head is loading and the shipped one is not loaded either (a route added
            # just now): waiting for the load in flight beats starting a second one here.
            trained = await ctx.heads.loaded(route.head)
    # The classifier is CPU work of a few ms; off the event loop so other requests keep flowing.
    if trained is not None:
        p_strong = await asyncio.to_thread(trained.classifier.score, feats.last_user)
        head: str | None = trained.label
    else:
        p_strong = await asyncio.to_thread(ctx.score_difficulty, feats.last_user)
        head = ctx.serving  # None: a scorer set in code
    if route.strong_share is not None:
        # Routes that share a name (`when:` tells them apart) each rank their own traffic against their
        # own target: with one window they took turns replacing it, so none ever left the warm-up.
        route_key = _route_key(route)
        key = (route_key[0], head or "", *route_key[1:])
        # Kept from the request's decision (its window stays empty until one is sent): a burst
        # decided before any is sent shares one credit for the share's edge, where each had a window
        # of its own, read an empty credit and went weak (a new route's opening burst).
        kept = _kept(route, key, trained is not None, ctx) if lessons is not None else None
        calibrator = kept if kept is not None else _calibrator(route, key, ctx)
        call = calibrator.call(p_strong, preview=lessons is None)
        if lessons is not None:
            lessons.append(lambda: _learn_score(route, key, trained is not None, call, ctx))
        go_strong, threshold = call.strong, call.threshold
    else:
        threshold = route.threshold
        go_strong = p_strong > threshold
    for choice in (weak, strong):
        choice.score, choice.scored_by = p_strong, head
    weak.reason, strong.reason = ("fallback", "hard") if go_strong else ("easy", "fallback")
    first = [strong, weak] if go_strong else [weak, strong]
    # Which head scored: with `difficulty_head: auto` replicas can differ, and a trained head is named
    # with its digest, so the ledger tells its versions apart. A route whose trained head is not
    # (yet) loaded here is scored by the shipped head, and says why.
    # As precise as the header's score (`Plan.header`): at 4 digits a score just below the threshold
    # (easy) could read above it.
    note = f"threshold={threshold:.6g}" + (f"; head={head}" if head is not None else "")
    if route.head is not None and trained is None:
        status = ctx.heads.status(route.head) if ctx.heads is not None else "missing"
        note += f"; head_wanted={route.head}; head_status={status}"
    return first + choices[2:], note


def _calibrator(route: Route, key: tuple[str, ...], ctx: PolicyContext) -> StrongShareCalibrator:
    """The strong-share window `key` of `route`, or a new one where there is none for its target."""
    from routing.difficulty import StrongShareCalibrator

    calibrator: StrongShareCalibrator | None = ctx.calibrators.get(key)
    assert route.strong_share is not None
    if calibrator is None:
        # No `initial_threshold`: the route's `threshold` (0.5 unless set) sent about 1% of the shipped
        # head's scores strong, whatever the target, for each window's first 50 requests (every
        # replica's start, new head); ranked from the first, the share holds.
        return StrongShareCalibrator(route.strong_share)
    if calibrator.target_share != route.strong_share:
        # A new target for the same head's scores keeps their window: started empty, the first
        # requests after an edit of the share were ranked among a few scores, not the last 2,000.
        return calibrator.retargeted(route.strong_share)
    return calibrator


def _learn_score(
    route: Route, key: tuple[str, ...], trained: bool, call: StrongCall, ctx: PolicyContext
) -> None:
    """Count a sent request's score in its route's strong-share window `key`: only while the route in
    force reads that window at that target."""
    calibrator = _kept(route, key, trained, ctx)
    if calibrator is not None:
        calibrator.count(call)


def _kept(
    route: Route, key: tuple[str, ...], trained: bool, ctx: PolicyContext
) -> StrongShareCalibrator | None:
    """The strong-share window `key` of `route`, kept in `ctx` from the first: only while the route in
    force reads that window at that target (None when it does not)."""
    share = route.strong_share
    if not ctx.in_force(route.name, lambda now: reads_window(now, key) and now.strong_share == share):
        return None
    calibrator = _calibrator(route, key, ctx)
    if ctx.calibrators.get(key) is not calibrator:
        if trained:
            # A new version of the route's head (retrained, stored again under its name): the
            # window of the one it replaces is never read again (kept, one window leaked with
            # every swap).
            route_key = _route_key(route)
            for old in [
                k for k in ctx.calibrators if head_name(k[1]) == route.head and (k[0], *k[2:]) == route_key
            ]:
                del ctx.calibrators[old]
        ctx.calibrators[key] = calibrator
    return calibrator


def _learn_prefixes(
    route: Route, used: bytes | None, learned: list[bytes], went: str, ctx: PolicyContext
) -> None:
    """Keep the prefix a sent request `used` (found) in memory, and remember the prefixes it sends to
    `went`: only while its route in force uses prefix affinity."""
    if not ctx.in_force(route.name, uses_prefix_affinity):
        return
    if used is not None:
        ctx.prefixes.touch(used)
    ctx.prefixes.remember(learned, went)


@dataclass(slots=True)
class AffinityOutcome:
    """Prefix affinity's hit or miss, by where the request is served (`routing.plan.Outcome`): a hit
    when the replica that answered is the preferred one (the one that served the prompt's longest
    remembered prefix, else the hash's first), a miss when another replica answered (the preferred one
    overloaded, behind an open breaker, or failed). Counted in the route's hit rate only where affinity
    could apply: a request with text (a prompt with none is spread at random), answered by one of the
    route's replicas (not a fallback beyond them, nor by none), and sent (not a preview)."""

    route: Route
    ctx: PolicyContext
    preferred: str | None  # the preferred replica's model; None: no text, no prefix to follow
    by: str  # conversation, shared or prefix (`affinity_by`)
    share: float  # of the prompt, the followed prefix
    new: list[bytes]  # the prompt's prefixes no replica had been sent (the rest stay where they are)
    went: str  # where its first attempt went, and its prefixes were remembered
    record: bool  # a request, not a preview: counted once served (`Plan.serve` calls `served` once)

    def _counts(self, choice: Choice | None) -> bool:
        return self.preferred is not None and choice is not None and choice.reason != "fallback"

    def describe(self, choice: Choice | None, pending: bool) -> str:
        hits, requests = self.ctx.affinity.get(self.route.name, (0, 0))
        if self.preferred is None:
            note = "affinity=none"
        else:
            hit = choice is not None and choice.candidate.model == self.preferred
            note = f"affinity={'hit' if hit else 'miss'}; affinity_by={self.by}"
            if self.by != "prefix":
                note += f"; affinity_shared={self.share:.2f}"
            if pending and self.record and self._counts(choice):
                # The header its answer goes out with: this request counted as it would be.
                hits, requests = hits + hit, requests + 1
        return f"{note}; affinity_hit_rate={hits / requests:.3f}" if requests else note

    def served(self, choice: Choice) -> None:
        if not (
            self.record and self._counts(choice) and self.ctx.in_force(self.route.name, uses_prefix_affinity)
        ):
            return
        model = choice.candidate.model
        counts = self.ctx.affinity.setdefault(self.route.name, [0, 0])
        counts[0] += model == self.preferred
        counts[1] += 1
        if model != self.went:
            # Its first attempt failed and another replica answered: what was new goes with it, as
            # with a replica overloaded when it was planned (the conversation's next turn follows it
            # there), and the prefixes it shares stay with their replica, where traffic returns.
            self.ctx.prefixes.remember(self.new, model)


def _rendezvous(key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\0" + name.encode(), digest_size=8).digest(), "big")


def _overloaded(choice: Choice, ctx: PolicyContext) -> bool:
    """This gateway replica's own requests to it reach `max_in_flight`, or the replica's last load
    report (every gateway replica's requests) shows `max_waiting` or more queued."""
    candidate = choice.candidate
    if (
        candidate.max_in_flight is not None
        and ctx.in_flight.get(candidate.model, 0) >= candidate.max_in_flight
    ):
        return True
    if candidate.max_waiting is None:
        return False
    waiting = ctx.loads.waiting(choice.target.backend.name)
    return waiting is not None and waiting >= candidate.max_waiting


def _open(choice: Choice, route: Route, ctx: PolicyContext) -> bool:
    """The executor would skip it: its breaker is open, or half-open with its one trial under way."""
    if route.breaker is None or ctx.breakers is None:
        return False
    target = choice.target
    breaker = ctx.breakers.breakers.get(Breakers.key(target.backend.name, target.upstream_model))
    return breaker is not None and not breaker.admits()


async def prefix_affinity(
    route: Route, choices: list[Choice], feats: Features, ctx: PolicyContext, lessons: list[Lesson] | None
) -> tuple[list[Choice], AffinityOutcome]:
    """The replica that served the longest prefix of this prompt recently (`routing.prefixes`), when
    that prefix is the conversation's history or at least `prefix_share` of the prompt; else
    rendezvous hashing of the first `prefix_chars`: the same prefix ranks the replicas the same way,
    and adding or removing a replica only moves the prefixes that hashed to it. The rest follow in
    rendezvous order."""
    prompt, history = feats.prompt, feats.history_chars
    # A prompt with no text (token ids, images alone) has no prefix to follow or share: hashed, every
    # one of them went to the same replica. They are spread at random instead.
    key = prompt[: route.prefix_chars].encode() if prompt else ctx.rng.randbytes(8)
    for choice in choices:
        choice.score = float(_rendezvous(key, choice.candidate.model))
        choice.reason = "affinity"
    ranked = sorted(choices, key=lambda c: c.score or 0.0, reverse=True)
    points = cuts(len(prompt))
    ends = sorted({*points, len(prompt), *([history] if history else [])} - {0})
    keys = prefix_keys(route.name, prompt, ends)
    by, share = "prefix", 0.0
    found = await ctx.prefixes.longest(keys, {choice.candidate.model for choice in choices})
    if found is not None:
        end, went = ends[found[0]], found[1]
        conversation = history is not None and end >= history
        if conversation or end >= route.prefix_share * len(prompt):
            for i, choice in enumerate(ranked):
                if choice.candidate.model == went:
                    ranked.insert(0, ranked.pop(i))
                    by, share = ("conversation" if conversation else "shared"), end / len(prompt)
                    break
    preferred = ranked[0]
    available, overloaded, closed = [], [], []
    for choice in ranked:
        if _open(choice, route, ctx):
            choice.reason = "open"
            closed.append(choice)
        elif _overloaded(choice, ctx):
            choice.reason = "overloaded"
            overloaded.append(choice)
        else:
            available.append(choice)
    # Every replica overloaded: the preferred one still takes it (its cache has the prefix). One
    # behind an open breaker takes nothing: the executor skips it.
    ordered = available + overloaded + closed
    hit = ordered[0] is preferred and preferred.reason != "open"
    looked_up = history if history not in (len(prompt), *points) else None

    def beyond(known: int) -> list[bytes]:
        return [k for k, end in zip(keys[known:], ends[known:], strict=True) if end != looked_up]

    new = beyond(found[0] + 1 if found is not None else 0)  # what no replica has been sent yet
    learned = new if not hit else beyond(0)
    went = ordered[0].candidate.model
    if lessons is not None and keys:
        # Where it goes is where its KV cache will be: later requests that start with it look it up.
        # Sent past an overloaded (or unreachable) replica, only what was new goes with it: the
        # prefixes it shares stay with their replica, so traffic returns there once the load passes.
        # The history's end is looked up, not remembered: the conversation's previous request
        # remembered it as its whole prompt. Remembered here, earlier turns that every request repeats
        # (a few-shot template, a canned greeting) passed for each request's conversation and pulled
        # them all to one replica, whatever their share of the prompt.
        used = keys[found[0]] if found is not None else None
        lessons.append(lambda: _learn_prefixes(route, used, learned, went, ctx))
    outcome = AffinityOutcome(
        route,
        ctx,
        preferred.candidate.model if keys else None,
        by,
        share,
        new,
        went,
        record=lessons is not None,
    )
    return ordered, outcome
