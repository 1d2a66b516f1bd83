"""The shared-state interface and its value types.

Rate limits are sliding windows counted in `BUCKETS` sub-buckets (one second each for a one-minute
window): no window of that length ever admits more than the limit. Budgets are money counters in
integer micro-dollars: `spent` (settled) plus `reserved` (in flight); a reservation that is never
settled (a crashed replica) expires after its TTL.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

BUCKETS = 60


@dataclass(frozen=True, slots=True)
class Limit:
    key: str  # e.g. "rpm:tenant:<id>"; the caller names it, the state only counts
    limit: int
    cost: int = 1  # 1 for a request limit, the estimated tokens for a token limit
    window_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Admission:
    allowed: bool
    retry_after_s: float = 0.0
    blocked_by: str | None = None  # key of the first limit that refused


@dataclass(frozen=True, slots=True)
class Budget:
    key: str  # e.g. "budget:tenant:<id>:2026-11"
    limit_micro_usd: int


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    allowed: bool
    reservation_id: str | None = None
    blocked_by: str | None = None


RevocationCallback = Callable[[str], Awaitable[None] | None]


class SharedState(Protocol):
    async def acquire(self, limits: Sequence[Limit]) -> Admission:
        """Count one use against every limit, all or none: if any would go over, none is counted."""
        ...

    async def adjust(self, key: str, delta: int, window_s: float = 60.0) -> None:
        """Correct a limit's current bucket once the real cost is known (actual - estimated tokens)."""
        ...

    async def budget_seed(self, key: str, spent_micro_usd: int) -> None:
        """Start a budget's `spent` from the ledger, unless some replica already did."""
        ...

    async def budget_reserve(
        self, budgets: Sequence[Budget], amount_micro_usd: int, ttl_s: float = 600.0
    ) -> BudgetDecision:
        """Reserve `amount` on every budget, all or none, if spent + reserved + amount <= limit on each."""
        ...

    async def budget_settle(self, keys: Sequence[str], reservation_id: str, actual_micro_usd: int) -> None:
        """Release the reservation and add the actual cost to `spent`."""
        ...

    async def budget_usage(self, key: str) -> tuple[int, int]:
        """(spent, reserved) in micro-dollars."""
        ...

    async def publish_revocation(self, key_hash: str) -> None: ...

    async def subscribe_revocations(self, callback: RevocationCallback) -> None:
        """Call `callback(key_hash)` for every revocation published by any replica from now on."""
        ...

    async def kv_get(self, key: str) -> bytes | None:
        """Small shared values, e.g. a circuit breaker's state."""
        ...

    async def kv_set(self, key: str, value: bytes, ttl_s: float | None = None) -> None: ...

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, ttl_s: float | None = None
    ) -> bool:
        """Set `value` only if the current value is `expected` (None: absent); True if it was set."""
        ...

    async def close(self) -> None: ...


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
