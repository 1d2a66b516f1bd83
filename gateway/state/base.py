"""The shared-state interface and its value types.

Rate limits are sliding windows counted in `BUCKETS` sub-buckets (one second each for a one-minute
window): a unit counts until its bucket leaves the window, 59 to 60 s after it was counted, so no
59 s ever admit more than the limit. Budgets are money counters in integer pico-dollars, the
ledger's unit, so they add up to exactly what the ledger bills: `spent` (settled) plus `reserved`
(in flight); a reservation that is never settled (a crashed replica) expires after its TTL.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

BUCKETS = 60
LIMIT_WINDOW_S = 60.0  # the window of RPM and TPM limits (Limit and Adjustment default to it)
# A budget's seed tells the state which events its ledger spend holds among those created this long
# before it (`budget_seed`'s `in_ledger`); a settlement of one of them that arrives after the seed is
# counted once, by the seed. A settlement comes within seconds of its event while Redis answers.
LATE_SETTLE_S = 60.0


class Outage(Protocol):
    """What one client of a Redis knows about it that its other clients in this process should too:
    whether it answers (the limits' and budgets' state, gateway.state.degradable.DegradableState).
    A hang one of them met is not waited out again by the others."""

    @property
    def degraded(self) -> bool:
        """Redis was found away and has not answered since."""
        ...

    def lost(self, exc: BaseException) -> None:
        """Redis did not answer (`exc`)."""
        ...


@dataclass(frozen=True, slots=True)
class Limit:
    key: str  # e.g. "rpm:tenant:<id>"; the caller names it, the state only counts
    limit: int
    cost: int = 1  # 1 for a request limit, the estimated tokens for a token limit
    window_s: float = LIMIT_WINDOW_S
    # Extra units to count for the caller's later requests in the current bucket (a lease), granted
    # only while the window stays at most half full with them. 0: none. See Admission.leases.
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Lease:
    """Units of a limit counted in the shared state for the caller, usable until its bucket ends."""

    units: int
    bucket: int  # the bucket they were counted in (unused ones are handed back to it)
    ms_left: float  # of that bucket when the state counted them (its clock; caller's: from sending)


@dataclass(frozen=True, slots=True)
class Admission:
    allowed: bool
    retry_after_s: float = 0.0  # when a rate limit refused
    blocked_by: str | None = None  # key of the limit or budget that refused
    reservation_id: str | None = None  # when budgets were reserved
    leases: tuple[Lease, ...] = ()  # per limit, in order, when any was asked for and granted
    pools: tuple[int, ...] = ()  # per budget: extra money reserved under reservation_id (a pool)
    # Per budget, in order, as far as the state looked (up to the one that refused): its `spent`
    # before this admission. Redis says, so the in-process fallback starts from it during an outage.
    spent: tuple[int, ...] = ()
    # Per limit, in order, when admitted: the bucket it was counted in (the index of its window's
    # buckets since the epoch, by the state's clock). A correction of that count goes there
    # (`Adjustment.bucket`), never to a later bucket that would keep it after the count has left.
    buckets: tuple[int, ...] = ()
    # Per limit, in order, when admitted: (units its window holds with this admission's, leases
    # included; seconds until all of them have left the window). When a limit refused: that limit's
    # alone (one entry), before this request. When a budget refused: every limit's, in order, before
    # this request (nothing was counted). What the client's x-ratelimit-* headers say
    # (gateway.accounting.admission.rate_headers); the state's own count and clock, so every replica
    # says the same.
    windows: tuple[tuple[int, float], ...] = ()
    # Refused because the state holds no seed for these budgets, which the caller had seeded: it
    # lost them (Redis restarted empty, failed over to a replica behind it, evicted the key). Nothing
    # was counted; the caller seeds them again from the ledger and asks once more.
    unseeded: tuple[str, ...] = ()
    # Refused by this replica's share of the budget `blocked_by` while Redis is away
    # (gateway.state.degradable): the whole budget has room for the request as far as this replica
    # knows, which no replica can confirm then, so another replica may admit it where this one won't.
    share_spent: bool = False


@dataclass(frozen=True, slots=True)
class Budget:
    key: str  # e.g. "budget:pico:tenant:<id>:2026-11"
    limit_pico_usd: int
    # Extra money to reserve beyond the request's amount, for the caller's later requests (a pool),
    # granted only while spent + reserved stays at most half the limit with it. 0: none.
    pool_pico_usd: int = 0
    # The caller seeded it (`budget_seed`): a state that holds no seed for it lost its data, and
    # refuses the admission as `unseeded` rather than count from zero.
    seeded: bool = False


BudgetDecision = Admission


@dataclass(frozen=True, slots=True)
class Adjustment:
    key: str  # a limit's key
    delta: int
    window_s: float = LIMIT_WINDOW_S
    # None: the current bucket. Else that one (a lease handed back, a token estimate corrected where
    # it was counted); dropped if it has left the window, where its units no longer count either.
    bucket: int | None = None


def admitted_mark(admission_id: str) -> str:
    """The key of the mark a state that may lose answers (Redis) keeps of an admission that counted
    its limits (`SharedState.admit`'s `admission_id`): read with `kv_get_many`."""
    return f"admitted:{admission_id}"


def correction_bucket(delta: int, counted_in: int | None) -> int | None:
    """Where a correction of units counted in bucket `counted_in` goes (`Adjustment.bucket`; None:
    the current one). Units the count was over by are given back in its own bucket, so both leave the
    window together (the state drops the correction once that bucket has left: given back in a later
    one, it would free room the window never held). Units beyond the count go to the current bucket:
    used by the time they are known, they count a full window from then."""
    return counted_in if delta < 0 else None


@dataclass(frozen=True, slots=True)
class Settlement:
    """What one finished attempt changes: limit corrections, and its cost on its budgets."""

    adjustments: Sequence[Adjustment] = ()
    budget_keys: Sequence[str] = ()
    reservation_id: str = ""  # released if still held; "" for an attempt after the first
    actual_pico_usd: int = 0
    # Per budget key, in order: (reservation id, amount to release from it; 0 releases all of it).
    # When given it replaces `reservation_id` (money drawn from pools is released piece by piece).
    releases: Sequence[tuple[str, int]] = ()
    # The attempt's usage event (its ledger row's id): a budget settled while it holds no seed
    # remembers which events its `spent` holds, so that the seed does not count them again once the
    # ledger has them too (`budget_seed`). "" for what no event stands for (a lease handed back).
    event_id: str = ""


RevocationCallback = Callable[[str], Awaitable[None] | None]


class SharedState(Protocol):
    async def admit(
        self,
        limits: Sequence[Limit],
        budgets: Sequence[Budget] = (),
        amount_pico_usd: int = 0,
        ttl_s: float = 600.0,
        admission_id: str | None = None,
    ) -> Admission:
        """One atomic step, all or nothing: count one use against every limit and reserve `amount` on
        every budget (spent + reserved + amount <= limit on each). Refused: nothing is counted.
        `admission_id`: the caller's id for it (unique), the budgets' reservation id, and a state
        that may be asked again about an admission whose answer was lost (Redis) keeps a mark that
        it counted the limits (`admitted_mark`, a `kv_get` key), for as long as they count."""
        ...

    async def settle_many(self, settlements: Sequence[Settlement]) -> dict[str, tuple[int, int]]:
        """For each: correct limits once the real cost is known (actual - estimated tokens), release
        the reservation (if still held) and add the actual cost to `spent` on every budget. Many at
        once share one round trip. Returns (spent, reserved) of every budget touched, afterwards."""
        ...

    async def settle(
        self,
        adjustments: Sequence[Adjustment] = (),
        budget_keys: Sequence[str] = (),
        reservation_id: str = "",
        actual_pico_usd: int = 0,
    ) -> None: ...

    async def acquire(self, limits: Sequence[Limit]) -> Admission: ...

    async def adjust(self, key: str, delta: int, window_s: float = 60.0) -> None: ...

    async def budget_reserve(
        self, budgets: Sequence[Budget], amount_pico_usd: int, ttl_s: float = 600.0
    ) -> Admission: ...

    async def budget_settle(self, keys: Sequence[str], reservation_id: str, actual_pico_usd: int) -> None: ...

    async def budget_unseeded(self, key: str) -> list[str]:
        """The usage events settled on a budget since the state last lost it (or before its first
        seed): those its `spent` holds without the ledger's spend. For `budget_seed`."""
        ...

    async def budget_seed(
        self, key: str, spent_pico_usd: int, unseeded: Sequence[str] = (), in_ledger: Sequence[str] = ()
    ) -> bool:
        """Add the ledger's spend to a budget's `spent`, unless some replica seeded it already (since
        the state last lost it): what was settled meanwhile stays counted, less the costs of those
        events (`unseeded`, as `budget_unseeded` read them) that the ledger's spend holds already
        (`in_ledger`). False, with nothing changed, when events were settled on the budget since
        `unseeded` was read: the ledger may hold them too, so read both again. `in_ledger` also
        names the ledger's events of the last LATE_SETTLE_S not settled here yet: their
        settlements, should they come after the seed, are counted by the seed alone."""
        ...

    async def budget_usage(self, key: str) -> tuple[int, int]:
        """(spent, reserved) in pico-dollars."""
        ...

    async def publish_revocation(self, key_hash: str) -> None: ...

    async def subscribe_revocations(self, callback: RevocationCallback) -> None:
        """Call `callback(key_hash)` for every revocation published by any replica from now on."""
        ...

    async def kv_get(self, key: str) -> bytes | None:
        """Small shared values, e.g. a circuit breaker's state."""
        ...

    async def kv_set(self, key: str, value: bytes, ttl_s: float | None = None) -> None: ...

    async def kv_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`kv_get` of each key, in one round trip."""
        ...

    async def kv_set_many(self, items: Mapping[str, bytes], ttl_s: float | None = None) -> None:
        """`kv_set` of each item, in one round trip."""
        ...

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, ttl_s: float | None = None
    ) -> bool:
        """Set `value` only if the current value is `expected` (None: absent); True if it was set."""
        ...

    async def kv_set_if_absent(self, key: str, value: bytes, ttl_s: float) -> tuple[bool, float]:
        """Set `value` for `ttl_s` seconds unless the key holds a value, atomically: (True, ttl_s)
        when this call set it, else (False, the seconds the value it holds has left; inf: no TTL).
        A claim only one caller gets, which lapses on its own if its holder goes away."""
        ...

    async def announce_replica(self, replica: str, ttl_s: float) -> int:
        """Say that gateway replica `replica` is alive for the next `ttl_s` seconds; how many are (each
        that said so within its own TTL, this one included). What the outage fallback shares each
        limit among (gateway.state.degradable)."""
        ...

    async def replica_left(self, replica: str) -> None:
        """`replica` stops: it no longer counts among the live ones."""
        ...

    async def drop_idle_connections(self) -> None:
        """Close the connections no call holds now (a store without connections: nothing)."""
        ...

    async def close(self) -> None: ...


class Shortcuts:
    """The single-purpose calls, in terms of `admit` and `settle` (mixed into both implementations)."""

    async def admit(
        self,
        limits: Sequence[Limit],
        budgets: Sequence[Budget] = (),
        amount_pico_usd: int = 0,
        ttl_s: float = 600.0,
        admission_id: str | None = None,
    ) -> Admission:
        raise NotImplementedError

    async def settle_many(self, settlements: Sequence[Settlement]) -> dict[str, tuple[int, int]]:
        raise NotImplementedError

    async def settle(
        self,
        adjustments: Sequence[Adjustment] = (),
        budget_keys: Sequence[str] = (),
        reservation_id: str = "",
        actual_pico_usd: int = 0,
    ) -> None:
        await self.settle_many([Settlement(adjustments, budget_keys, reservation_id, actual_pico_usd)])

    async def acquire(self, limits: Sequence[Limit]) -> Admission:
        return await self.admit(limits)

    async def adjust(self, key: str, delta: int, window_s: float = 60.0) -> None:
        await self.settle([Adjustment(key, delta, window_s)])

    async def budget_reserve(
        self, budgets: Sequence[Budget], amount_pico_usd: int, ttl_s: float = 600.0
    ) -> Admission:
        return await self.admit((), budgets, amount_pico_usd, ttl_s)

    async def budget_settle(self, keys: Sequence[str], reservation_id: str, actual_pico_usd: int) -> None:
        await self.settle((), keys, reservation_id, actual_pico_usd)


def retry_after(
    buckets: list[tuple[int, int]], need: int, bucket_s: float, now: float, window_s: float
) -> float:
    """Seconds until enough old buckets leave the window to free `need` units.

    `buckets` is [(bucket index, count)] oldest first; a bucket leaves the window `BUCKETS` buckets
    after it started.
    """
    freed = 0
    for index, count in buckets:
        freed += count
        if freed >= need:
            return max(0.0, (index + BUCKETS) * bucket_s - now)
    return window_s  # more than the whole limit: it never fits; say "a window from now"
