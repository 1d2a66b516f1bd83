"""Circuit breakers per backend and upstream model: closed, open, half-open.

Fed by request outcomes (the executor) and by active health probes (routing.health). Consecutive
failures open a breaker; after `cooldown` one trial request is let through (half-open): its success
closes the breaker, its failure opens it again. When shared state is configured (Redis), an opening
is published with the cooldown as TTL so every replica stops sending there, and a recovery clears it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import structlog

from routing.routes import Breaker as BreakerSettings

log = structlog.get_logger("weir.routing")
HISTORY = 1000  # latest transitions kept in memory (tests read them); all of them are in the log

PREFIX = "weir:breaker:"
# What an opening publishes: why it opened. Probes that could not reach the backend say "probe", so
# a replica adopting it lets its own probes half-open it as soon as they reach the backend, as the
# replica that opened it does (an adopted opening that forgot this refused a backend its probes
# reached for a whole cooldown). Bad answers say "open": they wait out the cooldown everywhere.
OPENED = b"open"
OPENED_BY_PROBE = b"open:probe"


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    settings: BreakerSettings
    state: State = State.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False
    trial_started: float = 0.0  # monotonic time the half-open trial in flight was let through
    # Opened because health probes could not reach the backend: a probe that reaches it again may
    # half-open it early. Openings for bad answers wait out the cooldown (a probe cannot see those).
    by_probe: bool = False

    def current(self, now: float | None = None) -> State:
        if self.state is State.OPEN:
            now = time.monotonic() if now is None else now
            if now - self.opened_at >= self.settings.cooldown:
                self.state, self.trial_in_flight = State.HALF_OPEN, False
        return self.state

    def admits(self, now: float | None = None) -> bool:
        """Would a request go there now? Closed, or half-open with no trial under way. A trial that
        has not reported back within a cooldown (a stream its client left: neither success nor
        failure) no longer holds the breaker."""
        now = time.monotonic() if now is None else now
        state = self.current(now)
        if state is State.HALF_OPEN:
            return not self.trial_in_flight or now - self.trial_started >= self.settings.cooldown
        return state is State.CLOSED

    def allow(self, now: float | None = None) -> bool:
        """May a request go there now? Half-open lets exactly one trial through at a time: this one."""
        now = time.monotonic() if now is None else now
        if not self.admits(now):
            return False
        if self.state is State.HALF_OPEN:
            self.trial_in_flight, self.trial_started = True, now
        return True

    def success(self) -> bool:
        """Record a success; True when this closed a breaker that was not closed."""
        changed = self.state is not State.CLOSED
        self.state, self.failures, self.trial_in_flight = State.CLOSED, 0, False
        return changed

    def failure(self, probe: bool = False) -> bool:
        """Record a failure; True when this opened the breaker."""
        self.failures += 1
        state = self.current()
        if state is State.HALF_OPEN or (state is State.CLOSED and self.failures >= self.settings.failures):
            self.trip()
            self.by_probe = probe
            return True
        return False

    def release(self) -> None:
        """A half-open trial ended without saying anything about the backend (cancelled, refused by
        the gateway itself): let the next request be the trial."""
        self.trial_in_flight = False

    def trip(self, now: float | None = None) -> None:
        self.state, self.trial_in_flight, self.by_probe = State.OPEN, False, False
        self.opened_at = time.monotonic() if now is None else now


class Breakers:
    """Every breaker of the process, keyed "backend/model"; optionally mirrored in shared state."""

    def __init__(self, state: Any | None = None) -> None:
        self.breakers: dict[str, CircuitBreaker] = {}
        self.shared = state  # gateway.state.SharedState (kv_get/kv_set) or None
        # (key, new state), the latest only: a list grew for ever on a gateway whose breakers flap.
        self.transitions: deque[tuple[str, State]] = deque(maxlen=HISTORY)

    @staticmethod
    def key(backend: str, model: str) -> str:
        return f"{backend}/{model}"

    def get(self, key: str, settings: BreakerSettings | None = None) -> CircuitBreaker:
        breaker = self.breakers.get(key)
        if breaker is None:
            breaker = self.breakers[key] = CircuitBreaker(settings or BreakerSettings())
        elif settings is not None:
            breaker.settings = settings
        return breaker

    def state(self, key: str) -> State:
        breaker = self.breakers.get(key)
        return State.CLOSED if breaker is None else breaker.current()

    def moved(self, key: str, state: State, cause: str | None = None) -> None:
        """Note a transition, and log it: an opening between two scrapes of the state gauge would
        otherwise leave no trace. `cause` of an opening: `requests` (failed answers), `probe` (the
        health probes could not reach it) or `replica` (adopted from another replica)."""
        self.transitions.append((key, state))
        if state is State.OPEN:
            log.warning("breaker_opened", breaker=key, cause=cause)
        elif state is State.HALF_OPEN:
            log.info("breaker_half_open", breaker=key)
        else:
            log.info("breaker_closed", breaker=key)

    async def success(self, key: str) -> None:
        if self.get(key).success():
            self.moved(key, State.CLOSED)
            if self.shared is not None:
                await self.shared.kv_set(PREFIX + key, b"closed", ttl_s=1.0)

    async def failure(self, key: str, probe: bool = False) -> None:
        breaker = self.get(key)
        if breaker.failure(probe):
            self.moved(key, State.OPEN, "probe" if probe else "requests")
            if self.shared is not None:
                value = OPENED_BY_PROBE if probe else OPENED
                await self.shared.kv_set(PREFIX + key, value, ttl_s=breaker.settings.cooldown)

    async def sync(self) -> None:
        """Adopt openings published by other replicas (called by the health loop)."""
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
            if value in (OPENED, OPENED_BY_PROBE) and breaker.current() is State.CLOSED:
                breaker.trip()
                breaker.by_probe = value == OPENED_BY_PROBE
                self.moved(key, State.OPEN, "replica")
