"""In-process shared state: exact within one process, which is all there is without Redis."""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.state.base import (
    BUCKETS,
    LIMIT_WINDOW_S,
    Admission,
    Budget,
    Limit,
    RevocationCallback,
    Settlement,
    Shortcuts,
    retry_after,
)

# How often (seconds of the state's clock) `MemoryState` starts a round of dropping what has lapsed:
# windows with no live bucket, expired kv values and reservations. Between rounds a call pays one
# comparison.
SWEEP_S = LIMIT_WINDOW_S
# Entries one call visits at most while a round is under way (tens of microseconds): a round over
# everything held is spread over the calls that follow, where one call walking it all paid 5-10 ms at
# 10,000 keys and 50-170 ms at 100,000.
SWEEP_CHUNK = 256
_LAPSED = 2 * BUCKETS - 1  # lo + this: the bucket index from which nothing a window counted is left


class _Window:
    """One limit's buckets (index -> count) with their running total: admission is O(1) instead of
    summing every live bucket, and buckets that left the window are removed as time passes."""

    __slots__ = ("bucket_s", "buckets", "lo", "total")

    def __init__(self, bucket_s: float) -> None:
        # Its window's length / BUCKETS, for the sweep to tell when it lapsed (a key names one limit,
        # so one length).
        self.bucket_s = bucket_s
        self.buckets: dict[int, int] = {}
        self.total = 0
        self.lo = 0  # no bucket older than this index is left

    def advance(self, current: int) -> None:
        first_live = current - BUCKETS + 1
        if first_live <= self.lo:
            return
        buckets = self.buckets
        if first_live - self.lo > len(buckets):  # a long pause: fewer buckets than indexes skipped
            gone = [i for i in buckets if i < first_live]
        else:
            gone = [i for i in range(self.lo, first_live) if i in buckets]
        for index in gone:
            self.total -= buckets.pop(index)
        self.lo = first_live

    def add(self, index: int, units: int) -> None:
        self.buckets[index] = self.buckets.get(index, 0) + units
        self.total += units

    def correct(self, index: int | None, current: int, units: int) -> None:
        """`add` a correction (after `advance(current)`): to the bucket counted in, `index`, or to
        the current one when None. A bucket that has left the window no longer counts, so neither
        does a correction of it: added to another bucket it would free room that was never held."""
        if index is None:
            self.add(current, units)
        elif index >= self.lo:
            self.add(index, units)


class _Budget:
    """Spent money plus reservations, with their running total; expired reservations leave in order
    of expiry (a heap, pruned lazily of reservations settled meanwhile).

    A new reservation joins the heap only later (`_file_recent`), if it is still held then: most are
    released milliseconds after they were made, and a heap entry each (a tuple the collector tracks,
    kept until the heap is rebuilt) was most of what a request left behind in this state. Expiry stays
    exact: `reserved` files them first once the earliest of them could have expired."""

    __slots__ = (
        "_expiries",
        "_recent",
        "_recent_expiry",
        "reservations",
        "seeded",
        "spent",
        "total_reserved",
        "unseeded",
    )

    RECENT_MAX = 256  # reservations kept out of the heap at most

    def __init__(self) -> None:
        self.spent = 0
        self.seeded = False  # `spent` includes the ledger's (seeded, or told by a state that was)
        # Usage events settled before the seed (event id -> cost), as Redis keeps them (SETTLE): the
        # seed does not count again those the ledger's spend holds too. None: none.
        self.unseeded: dict[str, int] | None = None
        self.reservations: dict[str, tuple[int, float]] = {}  # id -> (amount, expires)
        self.total_reserved = 0
        self._expiries: list[tuple[float, str]] = []
        self._recent: list[str] = []  # reservation ids not yet in the heap, in the order made
        self._recent_expiry = math.inf  # the earliest expiry among them

    def reserve(self, rid: str, amount: int, expires: float) -> None:
        self.reservations[rid] = (amount, expires)
        self.total_reserved += amount
        self._recent.append(rid)
        if expires < self._recent_expiry:
            self._recent_expiry = expires
        if len(self._recent) >= self.RECENT_MAX:
            self._file_recent()

    def _file_recent(self) -> None:
        """Move the recent reservations still held into the heap."""
        held = self.reservations
        for rid in self._recent:
            entry = held.get(rid)
            if entry is not None:
                heapq.heappush(self._expiries, (entry[1], rid))
        self._recent = []
        self._recent_expiry = math.inf
        if len(self._expiries) > 2 * len(held) + 1024:
            # Mostly settled ones: rebuild from what is still held.
            self._expiries = [(exp, r) for r, (_, exp) in held.items()]
            heapq.heapify(self._expiries)

    def release(self, rid: str, amount: int) -> None:
        """Release `amount` of a reservation (all of it when 0 or at least what it holds)."""
        held = self.reservations.get(rid)
        if held is None:
            return
        if 0 < amount < held[0]:
            self.reservations[rid] = (held[0] - amount, held[1])
            self.total_reserved -= amount
        else:
            del self.reservations[rid]
            self.total_reserved -= held[0]

    def reserved(self, now: float) -> int:
        if now >= self._recent_expiry:
            self._file_recent()
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expires, rid = heapq.heappop(expiries)
            held = self.reservations.get(rid)
            if held is not None and held[1] == expires:
                del self.reservations[rid]
                self.total_reserved -= held[0]
        return self.total_reserved


def _emptied_in(buckets: list[tuple[int, int]], bucket_s: float, now: float) -> float:
    """Seconds until the newest bucket that holds units (of `buckets`, oldest first) leaves the window."""
    newest = next((index for index, count in reversed(buckets) if count > 0), None)
    return 0.0 if newest is None else max(0.0, (newest + BUCKETS) * bucket_s - now)


def _window_lapsed(window: _Window, now: float) -> bool:
    # Every call that counts advances the window first (`lo` = its bucket then - BUCKETS + 1), so no
    # bucket is newer than lo + BUCKETS - 1: once that left the window, they all did.
    return now // window.bucket_s >= window.lo + _LAPSED


def _kv_lapsed(item: tuple[bytes, float | None], now: float) -> bool:
    return item[1] is not None and item[1] <= now


def _budget_lapsed(budget: _Budget, now: float) -> bool:
    budget.reserved(now)  # drops its expired reservations; its spend stays (for the month)
    return False


class MemoryState(Shortcuts):
    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}
        self._budgets: dict[str, _Budget] = {}
        self._kv: dict[str, tuple[bytes, float | None]] = {}
        self._callbacks: list[RevocationCallback] = []
        self._replicas: dict[str, float] = {}  # replica id -> when its announcement lapses
        # All methods run on one event loop without awaiting inside, so each is atomic; the lock
        # keeps that true if a future change adds an await.
        self._lock = asyncio.Lock()
        self._id_prefix = f"m{os.urandom(8).hex()}-"
        self._ids = itertools.count(1)
        self._next_sweep = 0.0  # the state's clock at which the next round of `_sweep` is due
        # The round under way: per map, the keys it has yet to visit (`_next_sweep` stays due meanwhile,
        # so every call that counts or stores carries it on).
        self._round: list[tuple[dict[str, Any], list[str], Callable[[Any, float], bool]]] = []

    @staticmethod
    def _now() -> float:
        return time.time()

    def _sweep(self, now: float) -> None:
        """Drop what has lapsed: windows with no live bucket left (a new one in its place counts the
        same), expired kv values, and expired reservations. Otherwise each limit key, kv key and budget
        ever used stayed for as long as the process ran, read or not: API keys created and revoked,
        per-user keys, a prefix per prompt, or everything a replica counted here during a long Redis
        outage.

        A round starts every SWEEP_S, from a call that counts or stores, and visits every entry held
        then, at most SWEEP_CHUNK per call: the calls after it carry it on until it is done. So no call
        pays more than a chunk, whatever is held (one walk over everything paid 50-170 ms at 100,000
        keys); what lapsed is gone by the end of the first round that starts after it lapsed (SWEEP_S
        after the round then under way ended; a round takes entries held / SWEEP_CHUNK calls); and
        what is held stays bounded under churn, since a call adds a few entries and visits up to
        SWEEP_CHUNK."""
        if not self._round:  # a round starts: it visits what is held now (a copy of the keys is cheap)
            self._round = [
                (self._windows, list(self._windows), _window_lapsed),
                (self._kv, list(self._kv), _kv_lapsed),
                (self._budgets, list(self._budgets), _budget_lapsed),
            ]
        quota = SWEEP_CHUNK
        while self._round and quota > 0:
            entries, keys, lapsed = self._round[-1]
            taken = keys[-quota:]
            del keys[-quota:]  # each call frees the keys it visited, not a round's worth at its end
            quota -= len(taken)
            for key in taken:
                entry = entries.get(key)
                if entry is not None and lapsed(entry, now):  # (None: dropped meanwhile)
                    del entries[key]
            if not keys:
                self._round.pop()
        if not self._round:
            self._next_sweep = now + SWEEP_S

    def _window(self, limit_key: str, window_s: float, now: float) -> tuple[_Window, float, int]:
        bucket_s = window_s / BUCKETS
        current = int(now // bucket_s)
        window = self._windows.get(limit_key)
        if window is None:
            window = self._windows[limit_key] = _Window(bucket_s)
        window.advance(current)
        return window, bucket_s, current

    async def admit(
        self,
        limits: Sequence[Limit],
        budgets: Sequence[Budget] = (),
        amount_pico_usd: int = 0,
        ttl_s: float = 600.0,
        admission_id: str | None = None,
    ) -> Admission:
        async with self._lock:
            return self.admit_now(limits, budgets, amount_pico_usd, ttl_s, admission_id)

    def admit_now(
        self,
        limits: Sequence[Limit],
        budgets: Sequence[Budget] = (),
        amount_pico_usd: int = 0,
        ttl_s: float = 600.0,
        admission_id: str | None = None,
    ) -> Admission:
        """`admit`, synchronously: nothing in it awaits, so it is as atomic as under the lock (which
        no method holds across a suspension). Admission calls this at once, without a coroutine."""
        now = self._now()
        if now >= self._next_sweep:
            self._sweep(now)
        counted = []
        windows = self._windows
        for limit in limits:
            # _window inlined (as in settle_attempt): every request counts four limits here, and the
            # call and its tuple were a measurable part of the in-process admission.
            bucket_s = limit.window_s / BUCKETS
            current = int(now // bucket_s)
            window = windows.get(limit.key)
            if window is None:
                window = windows[limit.key] = _Window(bucket_s)
            window.advance(current)
            if window.total + limit.cost > limit.limit:
                buckets = sorted(window.buckets.items())
                refused_by = ((window.total, _emptied_in(buckets, bucket_s, now)),)
                if limit.cost > limit.limit:
                    return Admission(False, limit.window_s, limit.key, windows=refused_by)
                need = window.total + limit.cost - limit.limit
                wait = retry_after(buckets, need, bucket_s, now, limit.window_s)
                return Admission(False, wait, limit.key, windows=refused_by)
            counted.append((window, current, limit.cost))
        states: list[_Budget] = []
        for budget in budgets:
            state = self._budgets.get(budget.key)
            if state is None:
                state = self._budgets[budget.key] = _Budget()
            if budget.seeded and not state.seeded:
                # The caller's seed is not here (as Redis answers when it lost one): nothing counted.
                held = self._budgets
                lost = (b.key for b in budgets if b.seeded and not held.setdefault(b.key, _Budget()).seeded)
                return Admission(False, unseeded=tuple(lost))
            if state.spent + state.reserved(now) + amount_pico_usd > budget.limit_pico_usd:
                # `spent` up to this budget, as Redis answers: whether the refusal is for good.
                spent = (*(held.spent for held in states), state.spent)
                # The limits' windows as they stand (nothing counted), as Redis answers.
                held_now = tuple(
                    (window.total, _emptied_in(sorted(window.buckets.items()), window.bucket_s, now))
                    for window, _, _ in counted
                )
                return Admission(False, blocked_by=budget.key, spent=spent, windows=held_now)
            states.append(state)
        counted_in = []
        windows_now = []
        for window, current, cost in counted:
            window.add(current, cost)
            counted_in.append(current)
            # This bucket, just counted in, is the window's newest: all of it has left with it.
            windows_now.append((window.total, (current + BUCKETS) * window.bucket_s - now))
        # Unique within this state, which is the only one that ever sees it: a counter after a
        # random prefix (another state's ids, e.g. Redis's before an outage, never collide).
        # (The caller's id where it gives one: the outage fallback's, which Redis may hold too.)
        reservation_id = (admission_id or f"{self._id_prefix}{next(self._ids)}") if budgets else None
        expires = now + ttl_s
        for state in states:
            state.reserve(reservation_id, amount_pico_usd, expires)  # type: ignore[arg-type]
        return Admission(
            True, reservation_id=reservation_id, buckets=tuple(counted_in), windows=tuple(windows_now)
        )

    async def settle_many(self, settlements: Sequence[Settlement]) -> dict[str, tuple[int, int]]:
        async with self._lock:
            return self.settle_now(settlements)

    def settle_now(self, settlements: Sequence[Settlement]) -> dict[str, tuple[int, int]]:
        """`settle_many`, synchronously: nothing in it awaits, so it is as atomic as under the lock
        (which no method holds across a suspension)."""
        now = self._now()
        if now >= self._next_sweep:
            self._sweep(now)
        touched: set[str] = set()
        for settlement in settlements:
            for adjustment in settlement.adjustments:
                if adjustment.delta:
                    window, _, current = self._window(adjustment.key, adjustment.window_s, now)
                    # A bucket is this state's, or Redis's before it became unreachable (a lease
                    # handed back, an estimate it counted; gateway.state.degradable): numbered alike,
                    # by the time, so that lands in this state's bucket of the same second.
                    window.correct(adjustment.bucket, current, adjustment.delta)
            self._spend(
                settlement.budget_keys,
                settlement.reservation_id,
                settlement.actual_pico_usd,
                settlement.releases,
                touched,
                settlement.event_id,
            )
        return {key: (self._budgets[key].spent, self._budgets[key].reserved(now)) for key in touched}

    def settle_attempt(
        self,
        limit_keys: Sequence[str],
        delta: int,
        budget_keys: Sequence[str],
        reservation_id: str,
        actual_pico_usd: int,
        releases: Sequence[tuple[str, int]] = (),
        report: bool = True,
        bucket: int | None = None,
        event_id: str = "",
    ) -> dict[str, tuple[int, int]]:
        """`settle_now` of one Settlement whose adjustments are `delta` on each of `limit_keys` (in
        `bucket`, or the current one when None; LIMIT_WINDOW_S windows), without building it:
        Admission settles every attempt through this at once, instead of a task and an event-loop
        turn per batch. With `report=False` it returns {} instead of each budget's (spent, reserved):
        Admission reads those when /metrics asks (`budget_usage_now`), not after every attempt."""
        now = self._now()
        if now >= self._next_sweep:
            self._sweep(now)
        if delta:
            bucket_s = LIMIT_WINDOW_S / BUCKETS
            current = int(now // bucket_s)
            windows = self._windows
            for key in limit_keys:
                window = windows.get(key)
                if window is None:
                    window = windows[key] = _Window(bucket_s)
                window.advance(current)
                window.correct(bucket, current, delta)
        touched: set[str] = set()
        self._spend(budget_keys, reservation_id, actual_pico_usd, releases, touched, event_id)
        if not report:
            return {}
        return {key: (self._budgets[key].spent, self._budgets[key].reserved(now)) for key in touched}

    def budget_usage_now(self, key: str) -> tuple[int, int] | None:
        """(spent, reserved) of a budget this state holds, else None; synchronous (see settle_attempt)."""
        state = self._budgets.get(key)
        return (state.spent, state.reserved(self._now())) if state is not None else None

    def _spend(
        self,
        budget_keys: Sequence[str],
        reservation_id: str,
        actual_pico_usd: int,
        releases: Sequence[tuple[str, int]],
        touched: set[str],
        event_id: str = "",
    ) -> None:
        for i, key in enumerate(budget_keys):
            state = self._budgets.get(key)
            if state is None:
                state = self._budgets[key] = _Budget()
            rid, release = releases[i] if releases else (reservation_id, 0)
            state.release(rid, release)
            state.spent += actual_pico_usd
            if not state.seeded and event_id and actual_pico_usd:
                if state.unseeded is None:
                    state.unseeded = {}
                state.unseeded[event_id] = state.unseeded.get(event_id, 0) + actual_pico_usd
            touched.add(key)

    async def budget_unseeded(self, key: str) -> list[str]:
        state = self._budgets.get(key)
        return list(state.unseeded) if state is not None and state.unseeded and not state.seeded else []

    async def budget_seed(
        self, key: str, spent_pico_usd: int, unseeded: Sequence[str] = (), in_ledger: Sequence[str] = ()
    ) -> bool:
        async with self._lock:
            state = self._budgets.setdefault(key, _Budget())
            if state.seeded:  # as in Redis: once, added to what was settled before it
                return True
            held = state.unseeded or {}
            if len(held) != len(unseeded) or any(event_id not in held for event_id in unseeded):
                return False  # settled on since the caller read them: read again (see SEED)
            state.spent += spent_pico_usd - sum(held.get(event_id, 0) for event_id in in_ledger)
            state.seeded = True
            state.unseeded = None
            return True

    def budget_spent_at_least(self, usage: Mapping[str, tuple[int, int]]) -> None:
        """Raise each budget's `spent` to the (spent, reserved) pair's spent, never lowering it: what
        the shared state (Redis) last said was spent, for this state to start from if it takes over
        (gateway.state.degradable)."""
        budgets = self._budgets
        for key, (spent, _) in usage.items():
            state = budgets.get(key)
            if state is None:
                state = budgets[key] = _Budget()
            if spent > state.spent:
                state.spent = spent
            state.seeded = True
            state.unseeded = None

    def seed_windows(self, seeds: Mapping[str, tuple[float, int, int]]) -> None:
        """Start each limit's window from what the shared state (Redis) last said it held: key ->
        (window length, the newest bucket it had counted in, the units the window held then), for this
        state to take over from (gateway.state.degradable). Which buckets held those units is not
        known, so all of them count in the newest: they leave the window no sooner than they would
        have there (refusing too much for a while, never admitting more than the limit). A window whose
        newest bucket has left is left as it is."""
        now = self._now()
        for key, (window_s, bucket, units) in seeds.items():
            window = _Window(window_s / BUCKETS)
            current = int(now // window.bucket_s)
            window.advance(current)
            if units > 0 and window.lo <= bucket:
                window.add(min(bucket, current), units)  # (a later one: the other clock ran ahead)
                self._windows[key] = window

    def forget_budgets(self, keep: Callable[[str], bool]) -> None:
        """Drop the budgets `keep` says no for: Admission's of months gone by, at a month's turn (in
        Redis they expire; here they were kept for as long as the process ran)."""
        self._budgets = {key: state for key, state in self._budgets.items() if keep(key)}

    def made(self, reservation_id: str) -> bool:
        """Whether this state made the reservation (another state's ids never start like its own)."""
        return reservation_id.startswith(self._id_prefix)

    async def budget_usage(self, key: str) -> tuple[int, int]:
        state = self._budgets.get(key)
        return (state.spent, state.reserved(self._now())) if state else (0, 0)

    async def publish_revocation(self, key_hash: str) -> None:
        for callback in list(self._callbacks):
            result = callback(key_hash)
            if inspect.isawaitable(result):
                await result

    async def subscribe_revocations(self, callback: RevocationCallback) -> None:
        self._callbacks.append(callback)

    async def kv_get(self, key: str) -> bytes | None:
        item = self._kv.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and expires <= self._now():
            del self._kv[key]
            return None
        return value

    async def kv_set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        now = self._now()
        if now >= self._next_sweep:
            self._sweep(now)
        self._kv[key] = (value, now + ttl_s if ttl_s else None)

    async def kv_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [await self.kv_get(key) for key in keys]

    async def kv_set_many(self, items: Mapping[str, bytes], ttl_s: float | None = None) -> None:
        for key, value in items.items():
            await self.kv_set(key, value, ttl_s)

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, ttl_s: float | None = None
    ) -> bool:
        async with self._lock:
            if await self.kv_get(key) != expected:
                return False
            await self.kv_set(key, value, ttl_s)
            return True

    async def kv_set_if_absent(self, key: str, value: bytes, ttl_s: float) -> tuple[bool, float]:
        async with self._lock:
            if await self.kv_get(key) is None:  # (which drops an expired value)
                await self.kv_set(key, value, ttl_s)
                return True, ttl_s
            expires = self._kv[key][1]
            return False, math.inf if expires is None else max(0.0, expires - self._now())

    async def announce_replica(self, replica: str, ttl_s: float) -> int:
        now = self._now()
        self._replicas[replica] = now + ttl_s
        self._replicas = {r: lapses for r, lapses in self._replicas.items() if lapses > now}
        return len(self._replicas)

    async def replica_left(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    async def drop_idle_connections(self) -> None:
        pass

    async def close(self) -> None:
        self._callbacks.clear()
