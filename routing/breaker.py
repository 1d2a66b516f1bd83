"""Circuit breakers per backend and upstream model: closed, open, half-open.

Fed by request outcomes (the executor) and by active health probes (routing.health). Consecutive
failures open a breaker; after `cooldown` one trial request is let through (half-open): its success
closes the breaker (a stream's, at its first token: the backend answered), its failure opens it
again. Only that trial's success closes it, and only if it was let through since the latest opening: a
request let through while it was closed that answers after it opened closes nothing, nor does a trial
let through before the trial whose failure opened it again (`Breakers.success`). An opening for a backend that could not be
reached half-opens early once a probe reaches it (`Breakers.reached`); where a trial the probes let
through (so, or by contesting another replica's opening) fails, their word counts for nothing there
until a request succeeds (`CircuitBreaker.refuted`: a backend that answers its model list but fails
requests). When shared state is configured (Redis), an opening is published with the cooldown as
TTL, and with its cause (the backend unreachable, or bad answers), so every replica stops sending
there; a recovery is published too, and moves the other replicas' open breakers to half-open
(`Breakers.sync`). A replica that saw the backend answer within a cooldown
(`CircuitBreaker.answered_lately`) does not take another's opening on trust: it half-opens, and its
next request there decides for it (`Breakers.sync`), since the replica that opened may be the only
one cut off from the backend. A half-open trial that only the cooldown let through is the fleet's
one: a replica claims it in the shared state first (`Breakers.allow`), so N replicas send one trial
per cooldown to a dead backend, not N; once that trial succeeds, the replicas it kept waiting read
its recovery within TRIAL_RECHECK_S. Routes that send to one backend/model share its breaker, with
settings decided once per route table from theirs (`shared_settings`: the fewest failures, the
longest cooldown).

A route's `ttft_timeout` is that route's latency preference: it counts against the backend's breaker
only where no route in force that uses the breaker would wait longer (`Breakers.too_slow`). Where
another route would, it feeds a latency breaker of that route's own there instead (`Breakers.latency`,
with the route's breaker settings): after `failures` timeouts in a row that route's streams skip the
model (`tried=model:slow`) for a cooldown, then one trial goes; its first token in time closes it
(as for the backend's breaker, only the trial's: `Breakers.in_time`). It is a preference, not a
verdict on the backend: each replica keeps its own, and other routes keep sending there.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec
import structlog

from routing.routes import Breaker as BreakerSettings
from routing.routes import Route

log = structlog.get_logger("weir.routing")
HISTORY = 1000  # latest transitions kept in memory (tests read them); all of them are in the log

PREFIX = "weir:breaker:"
# What an opening publishes: why it opened. A backend this replica could not reach (its probes, or
# requests that got no connection or lost it before any answer) says "open:probe" (the name is the
# older replicas', which read it so too), so a replica adopting it lets its own probes half-open it as
# soon as they reach the backend, as the replica that opened it does (an adopted opening that forgot
# this refused a backend its probes reached for a whole cooldown), and a replica whose probes reached
# it lately contests it (`answered_lately`). Bad answers (5xx, 429) say "open": they wait out the
# cooldown everywhere, as does an opening for a backend unreachable whose probes' word a failed trial
# refuted (`CircuitBreaker.refuted`).
OPENED = b"open"
OPENED_UNREACHABLE = b"open:probe"
# What a recovery publishes: b"closed:<token>", for a cooldown. A token of its own per recovery, so a
# replica acts on each once (one it read again, or its own, is not news). Replicas before it wrote
# b"closed" alone, which reads as a recovery too.
RECOVERED = b"closed"
# The fleet's half-open trial of a breaker: held by the replica that claimed it, for a cooldown.
TRIAL_PREFIX = "weir:breaker-trial:"
# A replica refused the fleet's trial asks again after this long at most (or when the claim lapses,
# if sooner) whether that trial succeeded (its recovery published): otherwise it learnt so only at its
# next health-loop round or when the claim lapsed, refusing a backend the fleet had seen answer.
TRIAL_RECHECK_S = 1.0
# The trial identity (see `CircuitBreaker.trial`) of a success that names none (`Breakers.success`:
# tests and tools, which let no request through themselves): a trial let through after every opening.
LATEST_TRIAL = math.inf


# A route's own latency breaker on one backend/model: (`route_label`, its ttft_timeout, `Breakers.key`).
# The timeout is part of it: a route edited to wait longer (or less) starts afresh.
LatencyKey = tuple[str, float, str]


def route_label(route: Route) -> str:
    """The route as an admin names it: its name, and for one with conditions those too (routes sharing
    a name keep their own latency breakers)."""
    if route.when is None:
        return route.name
    return f"{route.name} when {msgspec.json.encode(route.when).decode()}"


def shared_settings(asked: Sequence[BreakerSettings]) -> BreakerSettings:
    """The settings of a breaker that routes with these `breaker` settings share: the fewest
    `failures` and the longest `cooldown` any of them asks for (each setting on its own). The
    breaker is one verdict on the backend for every route there, so it cannot keep each route's
    own; the most protective gives the backend the rest that the most careful route asked for, and
    depends neither on the order of the routes nor on that of their requests (every replica with
    the same table publishes openings with the same TTL). A route's own latency breakers, which only
    its timeouts feed, keep its settings (`Breakers.latency_settings`)."""
    return BreakerSettings(
        failures=min(settings.failures for settings in asked),
        cooldown=max(settings.cooldown for settings in asked),
    )


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


OPENNESS = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}  # also the state gauges' values


@dataclass(slots=True)
class CircuitBreaker:
    settings: BreakerSettings
    state: State = State.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False
    # Monotonic time the half-open trial in flight was let through: that trial's identity (`trial`),
    # which its end without a verdict must match to free the breaker (`release`).
    trial_started: float = 0.0
    # Opened because the backend could not be reached (by health probes, or by requests that got no
    # connection or lost it before any answer): a probe that reaches it again may half-open it early.
    # Openings for bad answers wait out the cooldown (a probe cannot see those).
    unreachable: bool = False
    # Half-open because the cooldown passed, with no sign that the backend is back: with shared
    # state its trial is the fleet's one (Breakers.allow). Not after this replica's probe reached the
    # backend, nor after another replica's request succeeded there, nor when another replica's
    # opening met this replica's own recent success (Breakers.sync): a trial then is one request to a
    # backend seen up, each replica's own.
    fleet_trial: bool = False
    # Half-open on the probes' word: a probe of this replica reached the backend of an opening for one
    # unreachable, or this replica contested another's such opening on a probe's reach alone, no
    # request having answered here lately (`Breakers.reached`, `Breakers.sync`). A request's failure
    # then refutes that word (`refuted`).
    probed: bool = False
    # A trial the probes' word let through failed: the backend answers its model list but fails
    # requests (one that crashes on them, its connection reset before any answer, reads as unreachable
    # too). Until a request succeeds here (closing the breaker), an opening for a backend unreachable is
    # a plain one: the probes do not half-open it early, and it is published as OPENED, which the other
    # replicas' probes do not contest. Else every probe round sent one more request to fail there, not
    # one per cooldown.
    refuted: bool = False
    claimed_until: float = 0.0  # monotonic: this replica holds the fleet's trial until then
    trial_elsewhere_until: float = 0.0  # monotonic: another replica holds it until then
    # Monotonic: until then a request is refused here without asking whether that trial is over (at
    # most TRIAL_RECHECK_S after it was last asked; never after trial_elsewhere_until).
    trial_recheck_at: float = 0.0
    recovery_seen: bytes | None = None  # the latest recovery record read or written here
    # Monotonic: when this replica last saw the backend answer a request, and when it last reached it
    # (that, or a health probe it answered). A failure since forgets both: they are this replica's
    # latest word on the backend, which another replica's opening meets (`answered_lately`).
    last_success: float | None = None
    last_reached: float | None = None

    def current(self, now: float | None = None) -> State:
        if self.state is State.OPEN:
            now = time.monotonic() if now is None else now
            if now - self.opened_at >= self.settings.cooldown:
                self.state, self.trial_in_flight, self.fleet_trial = State.HALF_OPEN, False, True
        return self.state

    def half_open(self, probed: bool = False) -> None:
        """Half-open now on a sign that the backend is back (see `fleet_trial`; `probed`: the probes'
        word, see `probed`): the next request is this replica's trial."""
        self.state, self.trial_in_flight, self.fleet_trial = State.HALF_OPEN, False, False
        self.probed = probed
        self.trial_elsewhere_until = self.trial_recheck_at = 0.0

    def contested(self, probed: bool, now: float | None = None) -> None:
        """Another replica's opening, contested here (`Breakers._opened_elsewhere`): half-open, the next
        request this replica's own trial (`probed`: let through on the probes' word alone). It is an
        opening all the same (`opened_at`): a trial this replica let through before it (one silent for
        a cooldown, whose answer comes late) says nothing of what failed on the other replica, and
        closes nothing (`success`); the trial let through since does."""
        self.half_open(probed)
        self.opened_at = time.monotonic() if now is None else now

    def admits(self, now: float | None = None) -> bool:
        """Would a request go there now? Closed, or half-open with no trial under way, here or (the
        fleet's trial) on another replica, until it is time to ask again whether that one is over
        (`Breakers.allow`). A trial that has not reported back within a cooldown (one still waiting
        for its answer or first token, with no timeout to end it) no longer holds the breaker."""
        now = time.monotonic() if now is None else now
        state = self.current(now)
        if state is State.HALF_OPEN:
            if now < self.trial_recheck_at:
                return False
            return not self.trial_in_flight or now - self.trial_started >= self.settings.cooldown
        return state is State.CLOSED

    def reached(self, now: float | None = None) -> None:
        """A health probe reached the backend (it answered, even 401)."""
        self.last_reached = time.monotonic() if now is None else now

    def answered_lately(self, unreachable: bool, now: float | None = None) -> bool:
        """Whether this replica's latest word on the backend, within a cooldown, is that it answers:
        a request's success, or, against an opening for a backend unreachable (to probes, or to
        requests' connections), a probe that reached it too. A model list cannot show that an
        opening's bad answers are over."""
        seen = self.last_reached if unreachable else self.last_success
        now = time.monotonic() if now is None else now
        return seen is not None and now - seen < self.settings.cooldown

    def available_in(self, now: float | None = None) -> float:
        """Seconds until this breaker would let a request through (0: now): the rest of its cooldown,
        or of the trial under way here or on another replica (a trial that has not reported back
        within a cooldown no longer holds it)."""
        now = time.monotonic() if now is None else now
        state = self.current(now)
        if state is State.OPEN:
            return max(0.0, self.opened_at + self.settings.cooldown - now)
        if state is State.HALF_OPEN:
            trial = self.trial_started + self.settings.cooldown - now if self.trial_in_flight else 0.0
            return max(0.0, trial, self.trial_elsewhere_until - now)
        return 0.0

    def allow(self, now: float | None = None) -> bool:
        """May a request go there now? Half-open lets exactly one trial through at a time: this one."""
        now = time.monotonic() if now is None else now
        if not self.admits(now):
            return False
        if self.state is State.HALF_OPEN:
            self.trial_in_flight, self.trial_started = True, now
        return True

    def trial(self) -> float | None:
        """The identity of the half-open trial in flight here (when it was let through: read it right
        after `allow` let a request through, to know whether that request is the trial), or None."""
        return self.trial_started if self.state is State.HALF_OPEN and self.trial_in_flight else None

    def success(self, trial: float | None) -> bool:
        """Record a success; True when this closed a breaker that was not closed. `trial`: the
        identity (`trial`) of the half-open trial this breaker let the request through as, None for a
        request it let through while closed. Only a trial let through since the breaker's latest
        opening closes one that is not closed; any other's success changes nothing there, and resets a
        closed one's count of failures (see `Breakers.success`). Any such trial: also one that no
        longer holds the breaker (silent for a cooldown, another trial let through since, see
        `admits`), whose verdict still comes at its answer or first token, as recent as the new
        trial's would be. Not one let through before the latest opening: silent for a cooldown, it
        let another trial go whose failure opened the breaker again, and its answer says no more of
        that opening than a request's let through while the breaker was closed."""
        if self.current() is not State.CLOSED and (trial is None or trial < self.opened_at):
            return False
        changed = self.state is not State.CLOSED
        self.state, self.failures, self.trial_in_flight = State.CLOSED, 0, False
        self.probed = self.refuted = False
        self.claimed_until = self.trial_elsewhere_until = self.trial_recheck_at = 0.0
        self.last_success = self.last_reached = time.monotonic()
        return changed

    def failure(self, unreachable: bool = False, probe: bool = False) -> bool:
        """Record a failure (`unreachable`: the backend could not be reached, see `unreachable`;
        `probe`: a health probe's, which says the probes' word changed, not that it was wrong); True
        when this opened the breaker."""
        self.failures += 1
        self.last_success = self.last_reached = None
        state = self.current()
        if state is State.HALF_OPEN or (state is State.CLOSED and self.failures >= self.settings.failures):
            self.refuted = self.refuted or (state is State.HALF_OPEN and self.probed and not probe)
            self.trip()
            self.unreachable = unreachable and not self.refuted
            return True
        return False

    def release(self, trial: float) -> None:
        """The half-open trial `trial` (its identity, see `trial`) ended without saying anything about
        the backend (cancelled, refused by the gateway itself): let the next request be the trial, if
        that trial still holds the breaker. One silent for a cooldown no longer does once another
        request went as the trial (`admits`): freeing the breaker at its end let a third go beside
        that one."""
        if self.trial_in_flight and self.trial_started == trial:
            self.trial_in_flight = False

    def trip(self, now: float | None = None) -> None:
        self.state, self.trial_in_flight, self.unreachable, self.probed = State.OPEN, False, False, False
        self.claimed_until = self.trial_elsewhere_until = self.trial_recheck_at = 0.0
        self.opened_at = time.monotonic() if now is None else now


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request `Breakers.allow` let through. `trial`: its identity as the breaker's half-open trial
    (`CircuitBreaker.trial`), None where the breaker was closed."""

    trial: float | None = None


def _recovery_news(value: bytes | None, breaker: CircuitBreaker) -> bool:
    """Whether `value`, read from the shared state, is a recovery `breaker` has not acted on (nor
    written) yet."""
    return value is not None and value.startswith(RECOVERED) and value != breaker.recovery_seen


class Breakers:
    """Every breaker of the process, keyed "backend/model"; optionally mirrored in shared state."""

    def __init__(self, state: Any | None = None) -> None:
        self.breakers: dict[str, CircuitBreaker] = {}
        self.shared = state  # gateway.state.SharedState (kv_get/kv_set) or None
        # (key, new state), the latest only: a list grew for ever on a gateway whose breakers flap.
        self.transitions: deque[tuple[str, State]] = deque(maxlen=HISTORY)
        # Per key: the longest any route in force with a breaker waits for a stream's first token
        # there (inf: one waits as long as it takes). Router.set_routes keeps it; see too_slow.
        self.patience: dict[str, float] = {}
        # Per key: the settings of its breaker, decided once per route table (Router.set_routes, see
        # `settle`); a breaker made later (after a reset) takes them too, never the settings of
        # whichever route's request happened to come last.
        self.settings: dict[str, BreakerSettings] = {}
        # Whether a route table decides which keys have breakers (`settle` was called): then a key it
        # has none for gets none (see `get`). A Breakers on its own (tests, tools) makes any on use.
        self.routed = False
        # Routes' own latency breakers (see too_slow), created on a route's first timeout there, and
        # the settings of those the routes in force may have (Router.set_routes keeps both: one of a
        # route deleted or edited, or of a model it no longer waits less for than another, goes).
        self.latency: dict[LatencyKey, CircuitBreaker] = {}
        self.latency_settings: dict[LatencyKey, BreakerSettings] = {}

    @staticmethod
    def key(backend: str, model: str) -> str:
        return f"{backend}/{model}"

    def get(self, key: str, settings: BreakerSettings | None = None) -> CircuitBreaker:
        """`key`'s breaker, made on first use with the settings `settle` decided for it. `settings`
        replaces them (a Breakers used on its own, without a router: tests, tools); requests never
        pass any, or the routes sharing the breaker would flip its settings per request.

        Where the route table in force has no breaker on `key` (a request or probe of a route deleted
        or edited since asks), a closed breaker that is not kept: what it is told goes nowhere. A
        late verdict brought back the breaker `settle` had dropped, with default settings and maybe
        open, on /metrics and met by a route added later there, until the next table change."""
        breaker = self.breakers.get(key)
        if breaker is None:
            if settings is None and not self._kept(key):
                return CircuitBreaker(BreakerSettings())
            chosen = settings or self.settings.get(key) or BreakerSettings()
            breaker = self.breakers[key] = CircuitBreaker(chosen)
        elif settings is not None:
            breaker.settings = settings
        return breaker

    def _kept(self, key: str) -> bool:
        """Whether `key` has a breaker kept here: where no route table decides (`routed`), any key;
        else one the table in force has a breaker on."""
        return not self.routed or key in self.settings

    def _judged(self, key: str) -> CircuitBreaker | None:
        """The breaker a verdict on `key` goes to: none where the route table has none (see `get`)."""
        breaker = self.breakers.get(key)
        if breaker is None and self._kept(key):
            breaker = self.get(key)
        return breaker

    def settle(self, settings: dict[str, BreakerSettings]) -> None:
        """The settings of each key's shared breaker under the route table now in force
        (`shared_settings`), applied to the breakers there are and kept for those made later. The
        breakers of keys no route with a breaker uses any more go: what is kept stays bounded by the
        table, and a route that uses one again starts with its own settings, closed, not with the
        state and settings a route long gone left there."""
        self.settings, self.routed = settings, True
        for key in [key for key in self.breakers if key not in settings]:
            del self.breakers[key]
        for key, chosen in settings.items():
            self.get(key, chosen)

    def state(self, key: str) -> State:
        breaker = self.breakers.get(key)
        return State.CLOSED if breaker is None else breaker.current()

    def moved(self, key: str, state: State, cause: str | None = None) -> None:
        """Note a transition, and log it: an opening between two scrapes of the state gauge would
        otherwise leave no trace. `cause` of an opening: `requests` (failed answers), `unreachable`
        (requests that got no connection, or lost it before any answer), `probe` (the health probes
        could not reach it), `refuted` (it could not be reached, but a trial the probes' word let
        through failed there since the breaker last closed: a plain opening, see
        `CircuitBreaker.refuted`) or `replica` (adopted from another replica); of a half-open:
        `replica` (another replica's request succeeded there), `contested` (another replica opened it,
        but this one saw it answer within a cooldown: see `sync`), else none (a probe reached it)."""
        self.transitions.append((key, state))
        if state is State.OPEN:
            log.warning("breaker_opened", breaker=key, cause=cause)
        elif state is State.HALF_OPEN:
            log.info("breaker_half_open", breaker=key, cause=cause)
        else:
            log.info("breaker_closed", breaker=key)

    async def allow(self, key: str) -> Admitted | None:
        """May a request go to `key` now? None: no; else how it goes (`Admitted`: its identity as the
        half-open trial, if it is that, read as the breaker lets it through: after the awaits below,
        `sync` or other requests' verdicts may have moved the breaker, and the trial in flight then
        may be another request's). As `CircuitBreaker.allow`; with shared state, a trial that
        only the cooldown let through (`fleet_trial`) must also be claimed for the fleet: refused
        while another replica holds it, until its success is published (read here first, every
        TRIAL_RECHECK_S at most while refused, and by `sync`: this replica's trial then goes, as
        after `sync` read it) or its claim lapses (a cooldown after it was taken, even if its holder
        died). Shared state that fails leaves the trial to this replica, as without it: never a
        backend refused for that."""
        breaker = self.get(key)
        now = time.monotonic()
        if not breaker.allow(now):
            return None
        admitted = Admitted(breaker.trial())
        if self.shared is None or breaker.state is not State.HALF_OPEN or not breaker.fleet_trial:
            return admitted
        if now < breaker.claimed_until:  # this replica's claim: a trial that ended without a verdict
            return admitted
        cooldown = breaker.settings.cooldown
        try:
            # A recovery published since this replica last looked: the backend was seen up, so this
            # is no fleet trial (whoever holds the claim, its trial answered).
            published = await self.shared.kv_get(PREFIX + key)
            if _recovery_news(published, breaker):
                breaker.recovery_seen = published
                breaker.half_open()
                return Admitted(breaker.trial()) if breaker.allow(now) else None
            claimed, left = await self.shared.kv_set_if_absent(TRIAL_PREFIX + key, b"1", cooldown)
        except Exception as exc:  # a state without a fallback (DegradableState answers from memory)
            log.warning("breaker_trial_unshared", breaker=key, error=str(exc))
            return admitted
        if claimed:
            breaker.claimed_until = now + cooldown
            return admitted
        if breaker.state is State.HALF_OPEN and breaker.fleet_trial:  # (unless sync moved it meanwhile)
            breaker.release(now)  # the trial `breaker.allow(now)` let through
            breaker.trial_elsewhere_until = now + min(left, cooldown)
            breaker.trial_recheck_at = now + min(left, cooldown, TRIAL_RECHECK_S)
        return None

    async def success(self, key: str, trial: float | None = LATEST_TRIAL) -> None:
        """A request at `key` succeeded (the backend answered). A breaker that is not closed closes
        only on the success of a half-open trial it let through since its latest opening (`trial`:
        that trial's identity, see `CircuitBreaker.trial`; tests and tools, without an executor, need
        not say). Any other (`trial` None: a request let through while the breaker was closed that
        answers after it opened, or a stream's end, whose first token gave its verdict; or a trial let
        through before the latest opening) resets a closed breaker's count of failures and closes no
        other: let through before the opening, it says nothing of the requests the opening keeps off
        the backend. Closing on it, and publishing
        that recovery to the fleet, sent every request back to a backend that failed the latest ones
        (a long stream ending after the opening, above all). So only the cooldown, a probe or another
        replica's recovery moves an open breaker (Polly and resilience4j ignore a late success there
        too), and the trial then let through decides. The rule is `CircuitBreaker.success`'s, which
        routes' latency breakers keep too (`in_time`)."""
        breaker = self._judged(key)
        if breaker is not None and breaker.success(trial):
            self.moved(key, State.CLOSED)
            if self.shared is not None:
                # For a cooldown: every opening it can end, adopted or this replica's own, ends by
                # itself within a cooldown of it, however seldom the other replicas sync (their probe
                # interval, often longer than a second).
                recovered = breaker.recovery_seen = RECOVERED + b":" + os.urandom(8).hex().encode()
                await self.shared.kv_set(PREFIX + key, recovered, ttl_s=breaker.settings.cooldown)

    def reached(self, key: str) -> None:
        """A health probe reached `key`'s backend (it answered, even 401). An opening for a backend
        unreachable half-opens at once, on the probes' word (`CircuitBreaker.probed`): a backend that
        came back gets its trial without waiting out the cooldown."""
        breaker = self.get(key)
        breaker.reached()
        if breaker.current() is State.OPEN and breaker.unreachable:
            breaker.half_open(probed=True)
            self.moved(key, State.HALF_OPEN)

    async def failure(self, key: str, probe: bool = False, unreachable: bool = False) -> None:
        """A failure at `key`: a health probe's (`probe`: it could not reach the backend), or a
        request's, `unreachable` where it got no connection or lost it before any answer. Both open
        the breaker as unreachable, which a replica that reached the backend lately contests (see
        `OPENED_UNREACHABLE`), unless the probes' word on it was refuted (`CircuitBreaker.refuted`);
        a request's bad answer (5xx, 429) opens it for its cooldown."""
        unreachable = unreachable or probe
        breaker = self._judged(key)
        if breaker is not None and breaker.failure(unreachable, probe):
            cause = "probe" if probe else "unreachable" if unreachable else "requests"
            self.moved(key, State.OPEN, "refuted" if unreachable and breaker.refuted else cause)
            if self.shared is not None:
                value = OPENED_UNREACHABLE if breaker.unreachable else OPENED
                await self.shared.kv_set(PREFIX + key, value, ttl_s=breaker.settings.cooldown)

    async def too_slow(
        self, key: str, waited: float, route: Route | None = None, trial: float | None = None
    ) -> None:
        """A route gave up on a stream after `waited` seconds without its first token (its
        `ttft_timeout`). That is a failure of the backend only where no route in force with a breaker
        there would have waited longer: a tighter route's latency preference must not open the
        breaker that routes with no timeout, or a longer one, share, and take a model that would
        answer them away from them. It says nothing about the backend to them either (the half-open
        trial it was, `trial`: its identity, lets the next request be the trial), but it counts
        against `route`'s own latency breaker there, so that route stops paying its timeout on every
        request while the model is slow. Its 504 still counts as the backend's error in the metrics,
        as every TTFT timeout does."""
        if waited >= self.patience.get(key, waited):
            await self.failure(key)
            return
        if trial is not None:
            self.get(key).release(trial)
        if route is None:
            return
        latency = (route_label(route), waited, key)
        settings = self.latency_settings.get(latency)
        if settings is None:  # a route no longer in force (an edit while this request ran)
            return
        breaker = self.latency.get(latency)
        if breaker is None:
            breaker = self.latency[latency] = CircuitBreaker(settings)
        if breaker.failure():
            log.info("latency_breaker_opened", route=latency[0], breaker=key, ttft_timeout=waited)

    def latency_breaker(self, route: Route, key: str) -> CircuitBreaker | None:
        """`route`'s own latency breaker on `key`, where its timeouts there made one."""
        if not self.latency or not route.ttft_timeout:
            return None
        return self.latency.get((route_label(route), route.ttft_timeout, key))

    def in_time(self, route: Route, key: str, trial: float | None) -> None:
        """`route`'s stream had its first token from `key` within its `ttft_timeout`: its latency
        breaker there, if any, closes if that stream was its half-open trial let through since its
        latest opening (`trial`: that trial's identity, None for no trial), and a closed one's count
        of timeouts in a row starts again. As for `success`, a stream let through before it opened
        (other streams' timeouts opened it meanwhile, one of them perhaps a trial let through after
        this one) closes nothing: the route's streams it would send back to the model are those the
        timeouts say are too slow there."""
        breaker = self.latency_breaker(route, key)
        if breaker is not None and breaker.success(trial):
            log.info("latency_breaker_closed", route=route_label(route), breaker=key)

    def keep_latency(self, wanted: dict[LatencyKey, BreakerSettings]) -> None:
        """The latency breakers the routes now in force may have, with their settings: the others
        go, so a gateway whose routes are edited for weeks holds only those of the routes it has."""
        self.latency_settings = wanted
        for latency in [latency for latency in self.latency if latency not in wanted]:
            del self.latency[latency]
        for latency, breaker in self.latency.items():
            breaker.settings = wanted[latency]

    def latency_states(self) -> dict[str, dict[str, State]]:
        """Each route's latency breakers by backend/model, as the admin (`routes/status`) and
        /metrics show them. Routes of one name and the same conditions but different timeouts have
        one label there: it shows the most open of their breakers, so an operator is never told a
        model is in use for a route whose requests some of its breakers skip."""
        states: dict[str, dict[str, State]] = {}
        for (label, _, key), breaker in list(self.latency.items()):
            by_key = states.setdefault(label, {})
            state = breaker.current()
            by_key[key] = max(state, by_key.get(key, state), key=OPENNESS.__getitem__)
        return states

    async def sync(self) -> None:
        """Adopt openings and recoveries published by other replicas (called by the health loop)."""
        if self.shared is None:
            return
        # The keys as they are now, read in one round trip: a route added while it is under way
        # (set_routes, from the route store's task) creates breakers, and changing the dict under a
        # loop that awaits per key aborted the round, adopting none of the openings after it.
        keys = list(self.breakers)
        if not keys:  # MGET of nothing is an error in Redis
            return
        values = await self.shared.kv_get_many([PREFIX + key for key in keys])
        for key, value in zip(keys, values, strict=True):
            breaker = self.breakers.get(key)
            if breaker is None:
                continue
            if value in (OPENED, OPENED_UNREACHABLE) and breaker.current() is State.CLOSED:
                self._opened_elsewhere(key, breaker, unreachable=value == OPENED_UNREACHABLE)
            elif _recovery_news(value, breaker):
                breaker.recovery_seen = value
                self._recovered_elsewhere(key, breaker)

    def _opened_elsewhere(self, key: str, breaker: CircuitBreaker, unreachable: bool) -> None:
        """Another replica opened a breaker this replica has closed: adopted (open for a cooldown,
        with its cause), unless this replica saw the backend answer within a cooldown
        (`answered_lately`). Then it half-opens, and its next request there is its own trial. The
        opening shows the backend failing that replica, which may be the only one cut off from it (a
        partition, its own DNS or egress): adopted outright, it took a backend that answered every
        other replica away from the whole fleet for a cooldown, and again each time the cut-off
        replica failed anew. The trial costs one request, a failed one failing over as any: its
        failure opens the breaker here and publishes that, its success closes it and publishes a
        recovery (a trial let through here before the opening closes nothing: adopted or contested,
        the opening moves `opened_at`, see `CircuitBreaker.success`), which also ends the opening's
        record (read again, it would be adopted again) and half-opens the replicas that adopted it.
        No fleet trial: the backend was seen up here. A replica with no such word of its own has
        nothing to set against the opening, and a real outage costs it no request. Contested on a
        probe's reach alone (no request answered here lately), the trial is one the probes' word let
        through: its failure refutes that word (`CircuitBreaker.refuted`), and the opening it
        publishes is a plain one, which replicas cannot contest on their probes either."""
        if breaker.answered_lately(unreachable):
            breaker.contested(probed=not breaker.answered_lately(False))
            self.moved(key, State.HALF_OPEN, "contested")
        else:
            breaker.trip()
            breaker.unreachable = unreachable
            self.moved(key, State.OPEN, "replica")

    def _recovered_elsewhere(self, key: str, breaker: CircuitBreaker) -> None:
        """Another replica's request succeeded on a backend this replica has open: half-open, so the
        next request here is this replica's own trial, rather than closed. The success shows the
        backend answering that replica, not this one (a partition, or this replica's own failures,
        which opened it), and one trial costs at most one request, where closing would send every
        request until `failures` of them failed again. It is no fleet trial (one that waits on
        another replica's claim stops waiting): the backend was seen up, and each replica's one
        request there is ordinary traffic. A trial of this replica's under way decides on its own."""
        state = breaker.current()
        if state is State.OPEN:
            breaker.half_open()
            self.moved(key, State.HALF_OPEN, "replica")
        elif state is State.HALF_OPEN and not breaker.trial_in_flight:
            breaker.half_open()
