"""The routing engine the gateway asks for a plan: routes by name and conditions, policies, breakers.

Routes come from the config's `routes:` section and, when a control plane is configured, from the
admin DB (see routing.store), replaced whole on each change (`set_routes`). A public model name with
no route is a plain model: one candidate, one attempt, as before routing existed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

import structlog
from prometheus_client import CollectorRegistry

from gateway.auth import Principal
from gateway.config import Backend
from gateway.errors import ModelNotFound
from gateway.router_basic import ModelTable
from gateway.state import MemoryState
from routing.breaker import Breakers, route_label, shared_settings
from routing.health import HealthProber, ProbeListener
from routing.metrics import RoutingMetrics
from routing.plan import Choice, Features, Lesson, Plan
from routing.policies import PolicyContext, order
from routing.routes import HEAD_NAME, NAME_RULE, Candidate, Conditions, Retry, Route, fit_name
from routing.routes import Breaker as BreakerSettings
from routing.stats import RoutingStats
from routing.store import RouteStore
from routing.windows import ContextWindows

if TYPE_CHECKING:
    from routing.difficulty import HeadChoice
    from routing.heads import HeadStore

# Called after each route table change with the routes now in force and the names no longer in force
# (deleted or renamed: no route of the name is left), to let go of what was kept for them.
RoutesListener = Callable[[Sequence[Route], Collection[str]], None]


class InForce(Protocol):
    """`Router.in_force`, as what is kept per route asks it before adding a row for a late event."""

    def __call__(self, name: str, does: Callable[[Route], bool] | None = None) -> bool: ...


IDLE_PROBE_INTERVAL_S = 5.0  # how often an idle prober looks for routes to probe
log = structlog.get_logger("weir.routing")


def _log_warm_failure(task: asyncio.Task[object]) -> None:
    # A failed warm-up is not fatal: the first request that needs the classifier tries again and
    # fails over by the route's rules.
    if not task.cancelled() and task.exception() is not None:
        log.warning("difficulty_classifier_load_failed", error=repr(task.exception()))


class RouteError(ValueError):
    """A route names something that does not exist; the message says which."""


def admits(when: Conditions | None, tenant: str | None, key_id: str | None) -> bool:
    """Whether the route's caller conditions (tenants, keys) let this tenant and key use it."""
    return when is None or (
        (when.tenants is None or tenant in when.tenants) and (when.keys is None or key_id in when.keys)
    )


def matches(when: Conditions | None, feats: Features) -> bool:
    if when is None:
        return True
    if not admits(when, feats.tenant, feats.key_id):
        return False
    if when.metadata is not None and any(feats.metadata.get(k) != v for k, v in when.metadata.items()):
        return False
    if when.tags is not None and not set(when.tags) <= feats.tags:
        return False
    if when.min_prompt_tokens is not None and feats.prompt_tokens < when.min_prompt_tokens:
        return False
    if when.max_prompt_tokens is not None and feats.prompt_tokens > when.max_prompt_tokens:
        return False
    if when.tools is not None and feats.tools != when.tools:
        return False
    return when.images is None or feats.images == when.images


# An opened breaker is published to the shared state with its cooldown as the TTL, in whole
# milliseconds: one beyond what Redis holds read as Redis unreachable (every limit and budget then
# per process), beyond a float's range as an error in the request, and one under a millisecond
# (0 ms, which Redis refuses) as Redis unreachable too. A day is far past any cooldown that helps.
MIN_COOLDOWN_S = 0.001
MAX_COOLDOWN_S = 86_400.0
# Each probe round asks every backend the routes send to, one after another, with no pause but the
# interval: a microsecond asked them without pause. Ten rounds a second is past any health checker's
# usual rate (Kubernetes probes at most once a second), and tests run that fast.
MIN_PROBE_INTERVAL_S = 0.1
# Tries per candidate: the backoff doubles per retry, and past ~1,000 its 2**n overflowed a float (an
# error in the request); a hundred tries of one backend within one request is past any retry policy.
MAX_ATTEMPTS = 100
# A spend cap is counted in the shared state in whole micro-dollars: beyond ~1.8e302 USD converting it
# overflowed (an error in each request that would hedge or compare), beyond 9.2e12 USD it is more than
# a 64-bit counter holds. A million dollars an hour fits one even in pico-dollars (the ledger's unit)
# and is past any real cap on hedges or comparisons (`0` turns them off; there is no "unlimited").
MAX_SPEND_USD_PER_HOUR = 1_000_000.0
# Output tokens to expect: priced as a float by `cheapest` and for hedges and comparisons, which
# overflowed near 1e300 tokens. A 32-bit count, as the admin API's token limits.
MAX_EXPECTED_OUTPUT_TOKENS = 2**31 - 1


def _at_least(
    value: float | None, low: float, where: str, strict: bool = False, most: float = math.inf
) -> None:
    """RouteError unless `value` (when set) is a finite number >= low (> low with `strict`), <= most."""
    if value is None:
        return
    # An int is finite however large (and too large for math.isfinite, which converts it to a float).
    finite = isinstance(value, int) or math.isfinite(value)
    if not finite or value < low or (strict and value == low) or value > most:
        bound = f"greater than {low:,.15g}" if strict else f"at least {low:,.15g}"
        if most < math.inf:
            bound = f"{bound} and at most {most:,.15g}" if strict else f"from {low:,.15g} to {most:,.15g}"
        raise RouteError(f"{where}: must be a number {bound}")


def _within(value: float | None, where: str) -> None:
    if value is not None and not 0.0 <= value <= 1.0:  # NaN fails too
        raise RouteError(f"{where}: must be within [0, 1]")


def _check_settings(route: Route, where: str) -> None:
    """Numbers that only make sense in a range: a weight or interval of 0 or less, a share above 1, a
    window or token count below 1. Out of range they would be stored and then misroute (a negative
    cache hit share, a threshold no score reaches) or spin (a negative probe interval)."""
    if not fit_name(route.name):
        raise RouteError(f"{where}.name: {NAME_RULE}")
    for j, candidate in enumerate(route.candidates):
        at = f"{where}.candidates[{j}]"
        _at_least(candidate.weight, 0.0, f"{at}.weight", strict=True)
        _within(candidate.cache_hit_rate, f"{at}.cache_hit_rate")
        _at_least(candidate.context_window, 1, f"{at}.context_window")
        _at_least(candidate.max_output_tokens, 1, f"{at}.max_output_tokens")
    _within(route.threshold, f"{where}.threshold")
    _at_least(route.probe_interval, MIN_PROBE_INTERVAL_S, f"{where}.probe_interval")
    _at_least(route.ttft_timeout, 0.0, f"{where}.ttft_timeout", strict=True)
    _at_least(route.prefix_chars, 1, f"{where}.prefix_chars")
    _at_least(
        route.expected_output_tokens, 1, f"{where}.expected_output_tokens", most=MAX_EXPECTED_OUTPUT_TOKENS
    )
    retry = route.retry
    _at_least(retry.attempts, 1, f"{where}.retry.attempts", most=MAX_ATTEMPTS)
    for name in ("backoff", "max_backoff", "max_retry_after"):
        _at_least(getattr(retry, name), 0.0, f"{where}.retry.{name}")
    _within(retry.jitter, f"{where}.retry.jitter")
    if route.breaker is not None:
        _at_least(route.breaker.failures, 1, f"{where}.breaker.failures")
        _at_least(route.breaker.cooldown, MIN_COOLDOWN_S, f"{where}.breaker.cooldown", most=MAX_COOLDOWN_S)
    if route.hedge is not None:
        hedge = route.hedge
        if hedge.delay != "p95":
            _at_least(hedge.delay, 0.0, f"{where}.hedge.delay")
        _at_least(hedge.min_delay, 0.0, f"{where}.hedge.min_delay")
        spend = hedge.max_spend_usd_per_hour
        _at_least(spend, 0.0, f"{where}.hedge.max_spend_usd_per_hour", most=MAX_SPEND_USD_PER_HOUR)
    for j, status in enumerate(route.failover_on):
        if isinstance(status, int) and not 400 <= status <= 599:
            raise RouteError(
                f"{where}.failover_on[{j}]: a status from 400 to 599, '5xx' or 'context_length_exceeded'"
            )
    when = route.when
    if when is not None:
        for field in ("tenants", "keys"):
            if getattr(when, field) == []:
                raise RouteError(f"{where}.when.{field}: an empty list matches no request (omit it for any)")
        for j, tag in enumerate(when.tags or []):
            if not tag.strip() or tag != tag.strip() or "," in tag:
                raise RouteError(
                    f"{where}.when.tags[{j}]: {tag!r} can never match (tags are the request's "
                    "metadata.tags split at commas, spaces trimmed)"
                )
        _at_least(when.min_prompt_tokens, 0, f"{where}.when.min_prompt_tokens")
        _at_least(when.max_prompt_tokens, 0, f"{where}.when.max_prompt_tokens")
        if (
            when.min_prompt_tokens is not None
            and when.max_prompt_tokens is not None
            and when.min_prompt_tokens > when.max_prompt_tokens
        ):
            raise RouteError(
                f"{where}.when: min_prompt_tokens ({when.min_prompt_tokens}) is above max_prompt_tokens "
                f"({when.max_prompt_tokens}): no request can match"
            )


def validate(routes: Sequence[Route], models: ModelTable | Collection[str]) -> None:
    """Raise RouteError naming the first problem: unknown models, too few candidates, bad settings."""
    names = models.targets if isinstance(models, ModelTable) else models
    for i, route in enumerate(routes):
        where = f"routes[{i}] ({route.name})"
        _check_settings(route, where)
        if not route.candidates:
            raise RouteError(f"{where}.candidates: at least one candidate is required")
        if route.policy == "difficulty" and len(route.candidates) < 2:
            raise RouteError(f"{where}.candidates: the difficulty policy needs a weak and a strong candidate")
        if route.head is not None:
            if route.policy != "difficulty":
                raise RouteError(f"{where}.head: only the difficulty policy reads a difficulty head")
            if not HEAD_NAME.fullmatch(route.head):
                raise RouteError(f"{where}.head: {route.head!r} is not a head name")
        if route.compare is not None:
            compare = route.compare
            if route.policy != "difficulty":
                raise RouteError(f"{where}.compare: only the difficulty policy compares its candidates")
            if not 0.0 <= compare.share <= 1.0:
                raise RouteError(f"{where}.compare.share: must be within [0, 1]")
            # Finite, as the hedge's cap: a NaN cap compared below nothing, so it capped nothing.
            spend = compare.max_spend_usd_per_hour
            _at_least(spend, 0.0, f"{where}.compare.max_spend_usd_per_hour", most=MAX_SPEND_USD_PER_HOUR)
            if compare.max_in_flight < 1:
                raise RouteError(f"{where}.compare.max_in_flight: must be at least 1")
            if compare.judge not in names:
                raise RouteError(f"{where}.compare.judge: no model named {compare.judge!r}")
        if not 0.0 <= route.prefix_share <= 1.0:
            raise RouteError(f"{where}.prefix_share: must be within [0, 1]")
        if route.strong_share is not None and not 0.0 <= route.strong_share <= 1.0:
            raise RouteError(f"{where}.strong_share: must be within [0, 1]")
        for j, candidate in enumerate(route.candidates):
            for limit in ("max_in_flight", "max_waiting"):
                value = getattr(candidate, limit)
                if value is not None and value < 1:
                    raise RouteError(f"{where}.candidates[{j}].{limit}: must be at least 1")
        # Which entry, so a config's error names its key (the admin API's `param` is the list).
        listed = [(f"candidates[{j}].model", c.model) for j, c in enumerate(route.candidates)]
        listed += [(f"fallbacks[{j}]", name) for j, name in enumerate(route.fallbacks)]
        for at, name in listed:
            if name not in names:
                raise RouteError(f"{where}: no model named {name!r} ({at})")


class Router:
    def __init__(
        self,
        models: ModelTable,
        routes: Sequence[Route] = (),
        state: object | None = None,
        registry: CollectorRegistry | None = None,
        difficulty_head: HeadChoice = "auto",
    ) -> None:
        self.models = models
        self.stats = RoutingStats(self.in_force)
        self.breakers = Breakers(state)
        # What each backend's model list says of its models' context windows (the probes, the engine
        # supervisor) and what their 400s report: the executor fits output limits in them, and
        # policies fit candidates to a request in them.
        self.windows = ContextWindows()
        self.context = PolicyContext(
            self.stats,
            head=difficulty_head,
            breakers=self.breakers,
            in_force=self.in_force,
            windows=self.windows,
        )
        self.routes: dict[str, list[Route]] = {}
        self.version = 0
        self.seed = list(routes)
        self.store: RouteStore | None = None
        self.heads: HeadStore | None = None  # trained difficulty heads, with the admin DB
        self.prober: HealthProber | None = None
        self.sessions: object | None = None  # the admin DB's async_sessionmaker, when configured
        self.on_probe: ProbeListener | None = None
        self._warming: asyncio.Task[object] | None = None
        self._startup_warming: asyncio.Task[object] | None = None
        self._startup_heads: asyncio.Future[list[BaseException | None]] | None = None
        self._started = False
        self.metrics: RoutingMetrics | None = None
        self.listeners: list[RoutesListener] = []  # e.g. the gateway's metrics and comparisons
        self.set_routes(routes)
        self.metrics = RoutingMetrics(registry, self) if registry is not None else None

    def use_control_plane(
        self, sessions: object, state: object, on_probe: ProbeListener | None = None
    ) -> None:
        """Routes from the admin DB (seeded from the config), breakers shared through `state`, and
        with `on_probe` every backend probed for the uptime report (not only those routes probe)."""
        self.sessions = sessions
        self.on_probe = on_probe
        self.breakers.shared = state
        # Prefixes are remembered across replicas only where the state is shared (Redis).
        if not isinstance(state, MemoryState):
            self.context.prefixes.shared = state  # type: ignore[assignment]
        self.store = RouteStore(sessions, self.set_routes, self.seed, check=self._check_route)
        from routing.heads import HeadStore  # numpy and the classifier's modules: only with a DB

        # A route whose head is missing or unreadable is scored by the shipped head: load it then.
        self.heads = self.context.heads = HeadStore(
            sessions,  # type: ignore[arg-type]
            on_unavailable=lambda: self._warm_scorer(fallback=True),
        )

    def _check_route(self, route: Route) -> None:
        validate([route], self.models)

    async def start(self, transport: object) -> None:
        self._started = True
        if self.heads is not None:
            await self.heads.start()
        if self.store is not None:
            await self.store.start()
        if self.heads is not None and self.heads.pending():
            self._startup_heads = asyncio.gather(*self.heads.pending(), return_exceptions=True)
        # Always running, even with no probed route yet: a route added later through the admin API
        # is probed (and its breakers synced across replicas) as soon as it arrives.
        self.prober = HealthProber(
            transport,
            self.breakers,
            self._probe_interval(),
            on_result=self.on_probe,
            loads=self.context.loads,
            windows=self.windows,
        )
        self.prober.watch(self._probe_targets())
        self.prober.start()
        if self.heads is None and any(r.head for rs in self.routes.values() for r in rs):
            log.error("difficulty_head_without_database", detail="trained heads live in the admin DB")
        self._warm_scorer()
        self._startup_warming = self._warming

    @property
    def scorer_loading(self) -> bool:
        """The difficulty classifier that routes in force at start need is still loading (a second
        or two; for the first static head on a machine, its table is distilled too, 20-40 s). The
        gateway reports not-ready meanwhile, so a load balancer holds traffic back instead of letting
        requests wait. A route added later loads in the background without touching readiness: every
        replica gets it at once, and none should leave the pool for it."""
        if self._startup_heads is not None and not self._startup_heads.done():
            return True
        return self._startup_warming is not None and not self._startup_warming.done()

    async def stop(self) -> None:
        if self._warming is not None:  # a thread cannot be cancelled: let the load finish
            await asyncio.gather(self._warming, return_exceptions=True)
        if self.heads is not None:
            await self.heads.stop()
        if self.prober is not None:
            await self.prober.stop()
        if self.store is not None:
            await self.store.stop()

    def set_routes(self, routes: Sequence[Route], version: int | None = None) -> None:
        validate(routes, self.models)
        table: dict[str, list[Route]] = {}
        for route in routes:
            table.setdefault(route.name, []).append(route)
        guarded: list[tuple[Route, BreakerSettings, str]] = []  # (route, its breaker, a breaker key)
        for route in routes:
            if route.breaker is not None:
                for name in route.models():
                    target = self.models.targets[name]
                    guarded.append(
                        (route, route.breaker, Breakers.key(target.backend.name, target.upstream_model))
                    )
        patience: dict[str, float] = {}  # Breakers.patience
        asked: dict[str, list[BreakerSettings]] = {}  # per key, the breaker settings of routes there
        for route, settings, key in guarded:
            asked.setdefault(key, []).append(settings)
            patience[key] = max(patience.get(key, 0.0), route.ttft_timeout or math.inf)
        # Once per table, the same whatever order requests come in (see shared_settings).
        self.breakers.settle({key: shared_settings(settings) for key, settings in asked.items()})
        self.breakers.patience = patience
        # The routes' own latency breakers (Breakers.too_slow): where another route would wait longer.
        self.breakers.keep_latency(
            {
                (route_label(route), route.ttft_timeout, key): settings
                for route, settings, key in guarded
                if route.ttft_timeout and patience[key] > route.ttft_timeout
            }
        )
        gone = set(self.routes) - set(table)
        self.routes = table  # one assignment: requests see the old table or the new, never a mix
        self.context.forget(routes)  # windows and counts of routes deleted, renamed or re-conditioned
        if gone and self.metrics is not None:
            self.metrics.forget(gone)
        for listener in self.listeners:
            listener(routes, gone)
        self.version = self.version + 1 if version is None else version
        if self.heads is not None:
            self.heads.want({r.head for rs in table.values() for r in rs if r.head is not None})
        self._warm_scorer()
        if self.prober is not None:
            self.prober.interval = self._probe_interval()
            self.prober.watch(self._probe_targets())

    def _warm_scorer(self, fallback: bool = False) -> None:
        """Load the shipped difficulty classifier off the event loop as soon as a route needs it, so
        the first request it scores does not wait for the load. Routes with a trained head need it
        only when theirs cannot be loaded (`fallback`)."""
        if not self._started or self.context.scorer is not None or self._warming is not None:
            return  # before start(): whether a control plane (trained heads) comes is not known yet
        if not fallback and not any(
            r.policy == "difficulty" and (r.head is None or self.heads is None)
            for rs in self.routes.values()
            for r in rs
        ):
            return
        self._warming = asyncio.get_running_loop().create_task(asyncio.to_thread(self.context.warm))
        self._warming.add_done_callback(_log_warm_failure)

    def _probe_interval(self) -> float:
        intervals = [r.probe_interval for rs in self.routes.values() for r in rs if r.probe_interval]
        return min(intervals, default=IDLE_PROBE_INTERVAL_S)

    def _probe_targets(self) -> dict[str, tuple[Backend, list[str]]]:
        targets: dict[str, tuple[Backend, list[str]]] = {}
        if self.on_probe is not None:
            # Probed for availability only: no breaker keys unless a route below adds some.
            for target in self.models.targets.values():
                if target.backend.base_url or target.backend.url:
                    targets.setdefault(target.backend.name, (target.backend, []))
        for routes in self.routes.values():
            for route in routes:
                if route.breaker is None or route.probe_interval is None:
                    continue
                for name in route.models():
                    target = self.models.targets[name]
                    _, keys = targets.setdefault(target.backend.name, (target.backend, []))
                    key = Breakers.key(target.backend.name, target.upstream_model)
                    if key not in keys:
                        keys.append(key)
        return targets

    def names(self) -> list[str]:
        return list(self.routes)

    def in_force(self, name: str, does: Callable[[Route], bool] | None = None) -> bool:
        """Whether requests for `name` are served now: a route of that name, or a plain model; with
        `does`, whether a route of that name in force does what a row is kept for (uses prefix
        affinity, compares, ...). A request or comparison that began under an older table adds no row
        the table change let go of (`listeners`, `PolicyContext.forget`), or it would come back until
        the next change: none under a name deleted or renamed, none of a kind its route no longer
        keeps."""
        if does is None:
            return name in self.routes or name in self.models.targets
        return any(does(route) for route in self.routes.get(name, ()))

    def offers(self, name: str, principal: Principal) -> bool:
        """Whether some request of `principal` can use the route `name`: one of its routes has no
        tenant or key condition that rules the caller out (what the request itself carries, its tools
        or length, is not known here). A route limited to other tenants or keys answers them 404, so
        /v1/models must not list it for them (nor tell them its name)."""
        return principal.may_use(name) and any(
            admits(route.when, principal.tenant_name, principal.key_id) for route in self.routes.get(name, ())
        )

    async def plan(self, name: str, principal: Principal, feats: Features, record: bool = True) -> Plan:
        """The ordered candidates for a request (404 model_not_found when the name means nothing).
        What the policy learns from it is kept once the request is sent (`Plan.commit`, which the
        executor calls); `record=False`: a preview or a token count, which it learns nothing from."""
        routes = self.routes.get(name)
        if routes is not None and principal.may_use(name):
            for route in routes:
                if matches(route.when, feats):
                    return await self._plan(route, feats, record)
            if name not in self.models.targets and self.offers(name, principal):
                # The caller sees this route in /v1/models (a route for other tenants or keys only
                # stays hidden below): "does not exist" would send them looking for a typo, when it
                # is this request (its tools, images, length, metadata) that no route of it takes.
                raise ModelNotFound(
                    f"No route of `{name}` takes this request: its conditions (tools, images, prompt "
                    "length, metadata, tags) rule it out.",
                    param="model",
                )
        # No route (or none whose conditions hold): the plain model of that name, tried once.
        target = self.models.resolve(name, principal)[0]
        route = Route(
            name=name,
            candidates=[Candidate(model=name)],
            retry=Retry(attempts=1),
            failover_on=[],
            breaker=None,
        )
        return Plan(
            route,
            [Choice(target, route.candidates[0], reason="model")],
            output_limit=feats.requested_output_tokens,
            prompt_tokens=feats.prompt_tokens,
        )

    async def _plan(self, route: Route, feats: Features, record: bool = True) -> Plan:
        choices = [Choice(self.models.targets[c.model], c) for c in route.candidates]
        lessons: list[Lesson] | None = [] if record else None
        ordered, note, outcome = await order(route, choices, feats, self.context, lessons)
        for name in route.fallbacks:
            ordered.append(Choice(self.models.targets[name], Candidate(model=name), reason="fallback"))
        if not ordered:
            raise ModelNotFound(f"The route `{route.name}` has no candidates.", param="model")
        return Plan(
            route,
            ordered,
            note=note,
            lessons=lessons or [],
            outcome=outcome,
            output_limit=feats.requested_output_tokens,
            prompt_tokens=feats.prompt_tokens,
        )
