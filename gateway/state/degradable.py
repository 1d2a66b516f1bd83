"""Shared state that survives its Redis going away: in-process limits meanwhile, Redis again after.

A gateway must keep serving when Redis is down. While it is unreachable, every call goes to a
`MemoryState` in this process: each replica admits its share of every limit and spends its share of
what was left of every budget instead of the replicas counting together (below), a revocation
reaches only this replica at once (the others within the key-cache TTL), and
`weir_shared_state_degraded` is 1 so an alert fires.

A Redis that hangs (accepts connections, never answers) costs each call `timeout_s`, where a refused
connection fails at once; a request makes several calls. So only the call that finds Redis gone waits
for it: from then on every call is answered here at once, and a background task alone asks Redis
again, every `retry_s` (each ask bounded by `timeout_s`), switching back once it answers.

Rate limits carry over both ways. Each replica says in Redis every ANNOUNCE_S that it is alive and
counts the live ones, R (one script call off the request path, `_announce`). While Redis is away each
admits 1/R of every limit (`_share`), starting from 1/R of what Redis last said the window held (every
admission's answer, this replica's and every other's units in it): together the R replicas admit
about the limit less what was used, where each admitted all of that on its own (R times it; and R x
the limit in every later minute), and a limit a replica never asked Redis about starts at limit / R,
not a whole limit each. R is as last counted (one announcement stale; a replica that starts during
the outage has counted none: the config's `replicas` hint, else 1). And what the fallback counted
meanwhile (admissions, and the corrections settled here, those of requests Redis counted before the
outage included) is added to Redis's windows, in the buckets it was counted in, once it answers.
Without it a minute spanning the recovery admitted the limit again on top of what every replica
admitted during the outage.

Budgets carry over both ways. The fallback knows each budget's spend as Redis last reported it (the
ledger's seed, then every admission's and settlement's answer), so a tenant that spent its budget
stays refused while Redis is away instead of starting the month again from zero on every replica.
What was settled here meanwhile (the money spent, reservations Redis made that it can release) goes
to Redis once it answers, or its books would miss the outage's spend for the rest of the month.
And each replica spends its share of what was left (`_budget_share`): from the spend Redis last
reported when the outage began (or when this replica first met the budget during it), spend0, up to
spend0 + (limit - spend0) / R, so R replicas together spend about the remainder, not R times it. A
request this replica's share refuses but the whole budget (as far as it knows) would take is refused
as `share_spent` (a 429 the client retries, which may reach another replica), not as over budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from redis.exceptions import RedisError

from gateway.aio import detached, retry_until, stop_if_cancelled
from gateway.ids import random_hex
from gateway.state.base import (
    BUCKETS,
    Adjustment,
    Admission,
    Budget,
    Limit,
    RevocationCallback,
    Settlement,
    SharedState,
    Shortcuts,
    admitted_mark,
)
from gateway.state.memory import MemoryState

log = logging.getLogger(__name__)

_UNREACHABLE = (RedisError, OSError, TimeoutError)
_degraded: set[int] = set()  # ids of this process's states now running without Redis
PROBE_KEY = "probe"  # read (never written) to learn whether Redis answers again
COUNTED_MAX = 10_000  # limit buckets owed to Redis before those out of their window are dropped
ANNOUNCE_S = 10.0  # how often a replica says in Redis that it is alive, and counts the live ones
ANNOUNCE_LAPSES = 3  # announcements a replica may miss (a slow loop, a blip) before it stops counting


def degraded_states() -> int:
    """How many shared states in this process run without Redis now (the metric's value)."""
    return len(_degraded)


class DegradableState(Shortcuts):
    def __init__(
        self,
        primary: SharedState,
        *,
        timeout_s: float = 1.0,
        retry_s: float = 1.0,
        replicas: int | None = None,
        announce_s: float = ANNOUNCE_S,
    ) -> None:
        self.primary = primary
        self.fallback = MemoryState()
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._prober: asyncio.Task[None] | None = None  # asks Redis again while it is away
        self._subscribers: list[asyncio.Task[None]] = []  # subscribe to revocations in Redis
        # For Redis once it answers again: spend settled here per budget ((usage event id, cost) per
        # attempt: Redis tells them from the ledger's if it lost the budget, see SETTLE), reservations
        # it made that were settled here (budget key, reservation id, amount), and seeds it never got
        # (the ledger's spend, and the ledger's recent events it holds: `budget_seed`'s `in_ledger`).
        self._owed: dict[str, list[tuple[str, int]]] = {}
        self._releases: list[tuple[str, str, int]] = []
        self._seeds: dict[str, tuple[int, tuple[str, ...]]] = {}
        # For Redis once it answers again: units counted on limits here, per (key, window, bucket).
        self._counted: dict[tuple[str, float, int], int] = {}
        # Admissions whose call to Redis failed after it was sent (a timeout, a connection lost): Redis
        # may have run it and lost only the answer. Per admission id, the units the fallback counted
        # on limits, owed to Redis only if its mark says it did not count them (`_catch_up`).
        self._in_doubt: dict[str, list[tuple[str, float, int, int]]] = {}
        # Their reservation ids (the admission id, the same in Redis and here), while held here:
        # settled, they are released on both sides (`settle_many`, `_release_fallbacks`).
        self._shared_reservations: set[str] = set()
        # What Redis last said of each limit's window: key -> (window, newest bucket, units), for the
        # fallback to start from when Redis goes away (MemoryState.seed_windows).
        self._last_read: dict[str, tuple[float, int, int]] = {}
        self._last_read_max = COUNTED_MAX  # pruned past this, which doubles with what stays live
        # How many replicas share Redis: while it is away each admits 1/replicas of every limit
        # (`_share`). Counted in Redis every `announce_s` once started (`_announce`), and left as last
        # counted while Redis is away; until the first count, the config's hint (`replicas`), else 1.
        self.replicas = replicas or 1
        self.announce_s = announce_s
        self._replica = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._announcer: asyncio.Task[None] | None = None
        # While Redis is away: each budget's spend when this replica first met it in the outage (as
        # Redis last reported it), which its share of the budget starts from (`_budget_share`).
        self._spent_at_outage: dict[str, int] = {}

    @property
    def degraded(self) -> bool:
        return id(self) in _degraded

    async def _call(self, name: str, *args: Any) -> Any:
        reached, result = await self._try_primary(name, *args)
        return result if reached else await getattr(self.fallback, name)(*args)

    async def _try_primary(self, name: str, *args: Any) -> tuple[bool, Any]:
        """(True, Redis's answer), or (False, None) when Redis is unreachable (or known to be, until
        the prober hears from it again): the caller asks the fallback then."""
        if self.degraded:
            return False, None
        try:
            result = await self._ask(name, *args)
        except _UNREACHABLE as exc:
            self.lost(exc)
            return False, None
        return True, result

    def lost(self, exc: BaseException) -> None:
        """Redis did not answer (`exc`), this state or another client of the same Redis in this
        process (the stream slots, gateway.stream_slots; the usage queue, gateway.accounting.queue):
        from now on every call is answered here at once, until the prober hears from Redis again. A
        request that met the hang in its stream slot then does not wait it out a second time for its
        limits."""
        if not self.degraded:
            log.warning(
                "Redis unreachable (%r): limits and budgets now per process (1/%d of each limit here)",
                exc,
                self.replicas,
            )
            _degraded.add(id(self))
            # Read before the outage: once Redis is back, what it says replaces them. This replica's
            # share of what was used, as it admits its share of each limit (`_share`).
            r = self.replicas
            self.fallback.seed_windows(
                {key: (w, b, -(-n // r)) for key, (w, b, n) in self._last_read.items()}
            )
            self._last_read = {}
            self._spent_at_outage = {}  # this outage's shares start from what Redis says now
        if self._prober is None or self._prober.done():
            self._prober = detached(self._probe())  # not the request's that met the outage

    async def _ask(self, name: str, *args: Any) -> Any:
        async with asyncio.timeout(self.timeout_s):
            if self._owed or self._releases or self._seeds or self._counted or self._in_doubt:
                await self._catch_up()  # before anything else Redis is asked (see there)
            return await getattr(self.primary, name)(*args)

    def start(self) -> None:
        """Count the live replicas in Redis from now on (`_announce`), off every request's path."""
        if self._announcer is None:
            self._announcer = detached(self._announce())

    async def _announce(self) -> None:
        """Every `announce_s`: say in Redis that this replica is alive, and learn how many are. Not
        while Redis is away: the count of when it went holds until it is back."""
        ttl_s = ANNOUNCE_LAPSES * self.announce_s
        while True:
            stop_if_cancelled()  # a cancel that library code swallowed last round
            reached, live = await self._try_primary("announce_replica", self._replica, ttl_s)
            if reached:
                self.replicas = live
            await asyncio.sleep(self.announce_s)

    async def _probe(self) -> None:
        """Ask Redis every `retry_s` until it answers (off every request's path: a hanging Redis
        would make the asking call wait `timeout_s`), then switch back to it."""
        # The pool's idle connections are from before the outage, and Redis (or a proxy between) has
        # closed them: the first ask on one would fail and cost a round of `retry_s` after Redis is
        # back, more with several (the replica announcer keeps one of its own).
        with contextlib.suppress(*_UNREACHABLE):
            await self.primary.drop_idle_connections()
        await retry_until(lambda: self._ask("kv_get", PROBE_KEY), self.retry_s, self.timeout_s, _UNREACHABLE)
        log.warning("Redis reachable again: limits and budgets shared across replicas")
        _degraded.discard(id(self))

    async def _catch_up(self) -> None:
        """Hand Redis what was counted and settled here while it was away: seeds first (a seed only
        applies to a budget Redis holds nothing of yet, so it must land before any settlement does),
        then the limits' counts, the spend and the releases. Taken first, so concurrent calls send
        it once; put back when Redis fails again (a reply lost after Redis applied it would count
        them twice: the error that refuses too much, not too little)."""
        seeds, owed, releases = self._seeds, self._owed, self._releases
        self._seeds, self._owed, self._releases = {}, {}, []
        counted, self._counted = self._counted, {}
        in_doubt, self._in_doubt = self._in_doubt, {}
        try:
            # An admission Redis ran before its answer was lost holds its mark: its units count there
            # already, and owed again they counted twice.
            ids = [admitted_mark(admission_id) for admission_id in in_doubt]
            marks = await self.primary.kv_get_many(ids) if ids else []
        except BaseException:
            self._put_back(seeds, owed, releases, counted, in_doubt)
            raise
        for units, mark in zip(in_doubt.values(), marks, strict=True):
            if mark is None:
                for key, window_s, bucket, cost in units:
                    counted[(key, window_s, bucket)] = counted.get((key, window_s, bucket), 0) + cost
        # Limits first: one settlement of every bucket counted here (units 0 are left out by it).
        counts = [
            Adjustment(key, units, window_s, bucket) for (key, window_s, bucket), units in counted.items()
        ]
        catch_up = [Settlement(counts)] if counts else []
        catch_up += [
            Settlement((), [key], actual_pico_usd=cost, event_id=event_id)
            for key, events in owed.items()
            for event_id, cost in events
        ]
        catch_up += [Settlement((), [key], releases=[(rid, amount)]) for key, rid, amount in releases]
        try:
            for key, (spent, in_ledger) in seeds.items():
                # Refused (False) where Redis holds attempts settled since it lost the budget: the
                # ledger may hold them too, which this outage's spend does not say. Left unseeded
                # then: the next admission finds that and seeds it from the ledger (Admission).
                # With the ledger's events it held when read: a settlement of one of them that
                # comes after this (another replica's, or one owed below) is counted by the seed
                # alone, as on a seed Redis took at once (budget:counted).
                await self.primary.budget_seed(key, spent, (), in_ledger)
            if catch_up:
                await self.primary.settle_many(catch_up)
        except BaseException:
            self._put_back(seeds, owed, releases, counted, {})
            raise
        if owed or releases or counted:
            log.warning(
                "Redis caught up with %d budgets and %d limits counted while it was away",
                len(owed),
                len({key for key, _, _ in counted}),
            )

    def _put_back(
        self,
        seeds: dict[str, tuple[int, tuple[str, ...]]],
        owed: dict[str, list[tuple[str, int]]],
        releases: list[tuple[str, str, int]],
        counted: dict[tuple[str, float, int], int],
        in_doubt: dict[str, list[tuple[str, float, int, int]]],
    ) -> None:
        """What a catch-up took, back for the next one (Redis failed again meanwhile)."""
        for key, seed in seeds.items():
            self._seeds.setdefault(key, seed)
        for key, events in owed.items():
            self._owed.setdefault(key, []).extend(events)
        self._releases += releases
        for where, units in counted.items():
            self._count(*where, units)
        self._in_doubt.update(in_doubt)

    async def admit(
        self,
        limits: Sequence[Limit],
        budgets: Sequence[Budget] = (),
        amount_pico_usd: int = 0,
        ttl_s: float = 600.0,
        admission_id: str | None = None,
    ) -> Admission:
        # One id for Redis and the fallback: an admission whose answer Redis lost (a timeout after
        # the script ran) is then one reservation, released on both sides, not two.
        admission_id = admission_id or random_hex(16)
        sent = not self.degraded  # asked of Redis, which may run it even if its answer never comes
        reached, decision = await self._try_primary(
            "admit", limits, budgets, amount_pico_usd, ttl_s, admission_id
        )
        if not reached:
            shares = [self._share(limit) for limit in limits]
            budget_shares = [self._budget_share(budget) for budget in budgets]
            decision = await self.fallback.admit(shares, budget_shares, amount_pico_usd, ttl_s, admission_id)
            if decision.allowed:
                counted = [
                    (limit.key, limit.window_s, bucket, limit.cost)
                    for limit, bucket in zip(limits, decision.buckets, strict=False)
                ]
                if sent:
                    self._in_doubt[admission_id] = counted
                    if budgets:
                        self._shared_reservations.add(admission_id)
                else:
                    for where in counted:
                        self._count(*where)
            for key in decision.unseeded:  # its spend is not known yet: its share starts once it is
                self._spent_at_outage.pop(key, None)
            if decision.blocked_by in self._spent_at_outage:
                decision = self._of_whole_budgets(budgets, amount_pico_usd, decision)
            return self._of_whole_limits(limits, shares, decision)
        self._read(limits, decision)
        if decision.spent:
            # What every replica spent so far, where the fallback starts from. A refusal says it for
            # the budgets up to the one that refused (not strict).
            spent = zip(budgets, decision.spent, strict=False)
            self.fallback.budget_spent_at_least({budget.key: (s, 0) for budget, s in spent})
        return decision

    async def settle_many(self, settlements: Sequence[Settlement]) -> dict[str, tuple[int, int]]:
        reached, usage = await self._try_primary("settle_many", settlements)
        if reached:
            # What Redis says is spent (every replica's settlements): where the fallback starts from.
            self.fallback.budget_spent_at_least(usage)
            self._release_fallbacks(settlements)
            return usage
        now = time.time()
        for settlement in settlements:
            for adjustment in settlement.adjustments:
                if adjustment.delta:
                    window_s = adjustment.window_s
                    bucket = adjustment.bucket
                    if bucket is None:  # the current one, numbered as the fallback and Redis do
                        bucket = int(now // (window_s / BUCKETS))
                    self._count(adjustment.key, window_s, bucket, adjustment.delta)
            for i, key in enumerate(settlement.budget_keys):
                if settlement.actual_pico_usd:
                    owed = self._owed.setdefault(key, [])
                    owed.append((settlement.event_id, settlement.actual_pico_usd))
                rid, amount = (
                    settlement.releases[i] if settlement.releases else (settlement.reservation_id, 0)
                )
                if rid and not self.fallback.made(rid):
                    # Redis's own, or one it may hold too (`_shared_reservations`): it holds the
                    # money until released (a release of what it does not hold changes nothing).
                    self._releases.append((key, rid, amount))
        usage = await self.fallback.settle_many(settlements)
        self._forget_shared(settlements)
        return usage

    def _release_fallbacks(self, settlements: Sequence[Settlement]) -> None:
        """Release in the fallback the reservations it made (requests admitted while Redis was away)
        that settle now that Redis answers: Redis never held them, so settling there releases
        nothing of them, and the fallback kept them for their TTL. A second outage within it started
        with that money held on top of the spend Redis reports (which holds their cost): counted
        twice, and the tenant refused early."""
        released = []
        for settlement in settlements:
            for i, key in enumerate(settlement.budget_keys):
                rid, amount = (
                    settlement.releases[i] if settlement.releases else (settlement.reservation_id, 0)
                )
                if rid and (self.fallback.made(rid) or rid in self._shared_reservations):
                    released.append(Settlement((), [key], releases=[(rid, amount)]))
        if released:
            self.fallback.settle_now(released)
            self._forget_shared(settlements)

    def _forget_shared(self, settlements: Sequence[Settlement]) -> None:
        """Reservations held on both sides that these settlements released whole."""
        if not self._shared_reservations:
            return
        for settlement in settlements:
            for rid, amount in settlement.releases or [(settlement.reservation_id, 0)]:
                if amount == 0:
                    self._shared_reservations.discard(rid)

    def _share(self, limit: Limit) -> Limit:
        """This replica's part of a limit while Redis is away: 1/replicas of it, so that together the
        replicas admit about the limit, not each all of it. At least 1 (a limit below the replica
        count still admits on each), and a request larger than the part but within the limit fits an
        empty window, where it would be refused for the whole outage."""
        if self.replicas <= 1:
            return limit
        share = max(1, limit.limit // self.replicas, limit.cost if limit.cost <= limit.limit else 0)
        return replace(limit, limit=min(share, limit.limit))

    def _budget_share(self, budget: Budget) -> Budget:
        """This replica's part of a budget while Redis is away: the spend Redis last reported when this
        replica first met the budget in the outage (spend0, the fallback's then) and 1/replicas of
        what was left of it, so that together the replicas spend about what was left, not each all of
        it. Fixed for the outage: recomputed from the spend as it grows, each replica's share would
        creep up towards the whole budget again."""
        if self.replicas <= 1:
            return budget
        spent = self._spent_at_outage.get(budget.key)
        if spent is None:
            usage = self.fallback.budget_usage_now(budget.key)
            spent = self._spent_at_outage[budget.key] = usage[0] if usage is not None else 0
        left = max(0, budget.limit_pico_usd - spent)
        return replace(budget, limit_pico_usd=min(budget.limit_pico_usd, spent + left // self.replicas))

    def _of_whole_budgets(
        self, budgets: Sequence[Budget], amount_pico_usd: int, refused: Admission
    ) -> Admission:
        """The fallback refused a request by a budget's share (`_budget_share`): over budget if it does
        not fit what this replica knows is left of one of the whole budgets (the refusal clients
        do not retry), else `share_spent`: the tenant has money left, which this replica cannot
        confirm is not spent on the others, and a retry may reach one whose share takes it."""
        spents: list[int] = []
        for budget in budgets:
            spent, reserved = self.fallback.budget_usage_now(budget.key) or (0, 0)
            spents.append(spent)
            if spent + reserved + amount_pico_usd > budget.limit_pico_usd:
                return replace(refused, blocked_by=budget.key, spent=tuple(spents))
        return replace(refused, share_spent=True)

    def _of_whole_limits(
        self, limits: Sequence[Limit], shares: Sequence[Limit], decision: Admission
    ) -> Admission:
        """The fallback's answer with its windows said of the whole limits, as the rate-limit headers
        give them: what is left of a limit is what this replica has left of its share."""
        if self.replicas <= 1 or not decision.windows:
            return decision
        pairs = list(zip(limits, shares, strict=True))
        refused_by = [(limit, share) for limit, share in pairs if limit.key == decision.blocked_by]
        if refused_by:  # the window of the limit that refused alone (a budget's refusal: all of them)
            pairs = refused_by
        windows = tuple(
            (limit.limit - max(0, share.limit - units), emptied_in)
            for (limit, share), (units, emptied_in) in zip(pairs, decision.windows, strict=False)
        )
        return replace(decision, windows=windows)

    def _read(self, limits: Sequence[Limit], decision: Admission) -> None:
        """Keep what Redis said of the limits' windows (Admission.windows), for the fallback to start
        from: a dict entry per limit, no round trip."""
        if decision.allowed:
            for limit, bucket, (units, _) in zip(limits, decision.buckets, decision.windows, strict=False):
                self._last_read[limit.key] = (limit.window_s, bucket, units)
        elif decision.windows:  # the limit that refused, full: the other replicas' traffic fills it
            by = next((limit for limit in limits if limit.key == decision.blocked_by), None)
            units, emptied_in = decision.windows[0]
            if by is not None and units > 0:
                # Its newest bucket leaves the window `emptied_in` from now (Redis's clock).
                bucket_s = by.window_s / BUCKETS
                newest = round((time.time() + emptied_in) / bucket_s) - BUCKETS
                self._last_read[by.key] = (by.window_s, newest, units)
        if len(self._last_read) > self._last_read_max:
            # Keys no longer used (their bucket has left); the bound grows with the live ones, so a
            # fleet with more live keys than it does not walk them all on every admission.
            now = time.time()
            self._last_read = {
                key: (w, b, n)
                for key, (w, b, n) in self._last_read.items()
                if b > now // (w / BUCKETS) - BUCKETS
            }
            self._last_read_max = max(COUNTED_MAX, 2 * len(self._last_read))

    def _count(self, key: str, window_s: float, bucket: int, units: int) -> None:
        """Owe Redis `units` on a limit's bucket. Buckets that have left their window count for
        nothing there (SETTLE drops them), so they go once there are many: a long outage keeps
        about a window's worth per key."""
        where = (key, window_s, bucket)
        self._counted[where] = self._counted.get(where, 0) + units
        if len(self._counted) > COUNTED_MAX:
            now = time.time()
            self._counted = {
                (k, w, b): n for (k, w, b), n in self._counted.items() if b > now // (w / BUCKETS) - BUCKETS
            }

    async def budget_unseeded(self, key: str) -> list[str]:
        result: list[str] = await self._call("budget_unseeded", key)
        return result

    async def budget_seed(
        self, key: str, spent_pico_usd: int, unseeded: Sequence[str] = (), in_ledger: Sequence[str] = ()
    ) -> bool:
        # From the ledger's spend, as Redis is (never lowering what Redis reported since).
        self.fallback.budget_spent_at_least({key: (spent_pico_usd, 0)})
        reached, seeded = await self._try_primary("budget_seed", key, spent_pico_usd, unseeded, in_ledger)
        if not reached:
            # `unseeded` is the fallback's (Admission read it here): Redis's, when it answers, must
            # be empty for the seed to apply, so only the ledger's events travel with it.
            self._seeds.setdefault(key, (spent_pico_usd, tuple(in_ledger)))
            return True
        return bool(seeded)

    def forget_budgets(self, keep: Callable[[str], bool]) -> None:
        """The fallback's budgets of months gone by (Admission, at a month's turn): it learns every
        budget Redis reports, outage or not, so without this it held every budget of every month."""
        self.fallback.forget_budgets(keep)
        self._spent_at_outage = {key: spent for key, spent in self._spent_at_outage.items() if keep(key)}

    async def budget_usage(self, key: str) -> tuple[int, int]:
        result: tuple[int, int] = await self._call("budget_usage", key)
        return result

    async def publish_revocation(self, key_hash: str) -> None:
        # This replica drops the key at once either way (the memory state calls its subscribers).
        await self.fallback.publish_revocation(key_hash)
        await self._call("publish_revocation", key_hash)

    async def subscribe_revocations(self, callback: RevocationCallback) -> None:
        """This replica's own revocations reach `callback` at once (through the fallback); the other
        replicas' once Redis holds the subscription, which a background task makes (`_subscribe`):
        a gateway that starts while Redis is down or hangs starts at once, where it waited out
        redis-py's 5 s socket timeout and then never subscribed at all."""
        await self.fallback.subscribe_revocations(callback)
        self._subscribers.append(detached(self._subscribe(callback)))

    async def _subscribe(self, callback: RevocationCallback) -> None:
        """Subscribe `callback` in Redis, each try bounded by `timeout_s`, every `retry_s` until one
        succeeds (the subscription then retries on its own, RedisState._listen). Revocations published
        before that reach this replica within the key-cache TTL, as during any outage."""
        subscribe = functools.partial(self.primary.subscribe_revocations, callback)
        try:
            async with asyncio.timeout(self.timeout_s):
                await subscribe()
            return
        except _UNREACHABLE as exc:
            log.warning("cannot subscribe to revocations in Redis (%r); retrying", exc)
        await retry_until(subscribe, self.retry_s, self.timeout_s, _UNREACHABLE)
        log.info("subscribed to revocations in Redis")

    async def kv_get(self, key: str) -> bytes | None:
        result: bytes | None = await self._call("kv_get", key)
        return result

    async def kv_set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        await self._call("kv_set", key, value, ttl_s)

    async def kv_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        result: list[bytes | None] = await self._call("kv_get_many", keys)
        return result

    async def kv_set_many(self, items: Mapping[str, bytes], ttl_s: float | None = None) -> None:
        await self._call("kv_set_many", items, ttl_s)

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, ttl_s: float | None = None
    ) -> bool:
        result: bool = await self._call("kv_compare_and_set", key, expected, value, ttl_s)
        return result

    async def kv_set_if_absent(self, key: str, value: bytes, ttl_s: float) -> tuple[bool, float]:
        # While Redis is away the claim is this process's own: one holder per replica, not per fleet.
        claim: tuple[bool, float] = await self._call("kv_set_if_absent", key, value, ttl_s)
        return claim

    async def announce_replica(self, replica: str, ttl_s: float) -> int:
        live: int = await self._call("announce_replica", replica, ttl_s)
        return live

    async def replica_left(self, replica: str) -> None:
        await self._call("replica_left", replica)

    async def drop_idle_connections(self) -> None:
        await self.primary.drop_idle_connections()

    async def close(self) -> None:
        for task in [self._prober, self._announcer, *self._subscribers]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._announcer is not None and not self.degraded:
            # The others' count drops at their next announcement, not after this one's TTL.
            with contextlib.suppress(*_UNREACHABLE):
                async with asyncio.timeout(self.timeout_s):
                    await self.primary.replica_left(self._replica)
        _degraded.discard(id(self))
        await self.fallback.close()
        await self.primary.close()
