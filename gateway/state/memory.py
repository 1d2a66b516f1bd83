"""In-process shared state: exact within one process, which is all there is without Redis."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.state.base import (
    BUCKETS,
    Admission,
    Budget,
    Limit,
    RevocationCallback,
    Settlement,
    Shortcuts,
    retry_after,
)


@dataclass
class _Budget:
    spent: int = 0
    spent_known: bool = False  # seeded from the ledger or settled at least once
    reservations: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (amount, expires)

    def reserved(self, now: float) -> int:
        for rid in [rid for rid, (_, exp) in self.reservations.items() if exp <= now]:
            del self.reservations[rid]
        return sum(amount for amount, _ in self.reservations.values())


class MemoryState(Shortcuts):
    def __init__(self) -> None:
        self._windows: dict[str, dict[int, int]] = {}
        self._budgets: dict[str, _Budget] = {}
        self._kv: dict[str, tuple[bytes, float | None]] = {}
        self._callbacks: list[RevocationCallback] = []
        # All methods run on one event loop without awaiting inside, so each is atomic; the lock
        # keeps that true if a future change adds an await.
        self._lock = asyncio.Lock()

    @staticmethod
    def _now() -> float:
        return time.time()

    def _window(self, limit_key: str, window_s: float, now: float) -> tuple[dict[int, int], float, int]:
        bucket_s = window_s / BUCKETS
        current = int(now // bucket_s)
        buckets = self._windows.setdefault(limit_key, {})
        for index in [i for i in buckets if i <= current - BUCKETS]:
            del buckets[index]
        return buckets, bucket_s, current

    async def admit(
        self,
        limits: Sequence[Limit],
        budgets: Sequence[Budget] = (),
        amount_micro_usd: int = 0,
        ttl_s: float = 600.0,
    ) -> Admission:
        async with self._lock:
            now = self._now()
            for limit in limits:
                buckets, bucket_s, _ = self._window(limit.key, limit.window_s, now)
                total = sum(buckets.values())
                if total + limit.cost > limit.limit:
                    if limit.cost > limit.limit:
                        return Admission(False, limit.window_s, limit.key)
                    need = total + limit.cost - limit.limit
                    wait = retry_after(sorted(buckets.items()), need, bucket_s, now, limit.window_s)
                    return Admission(False, wait, limit.key)
            for budget in budgets:
                state = self._budgets.setdefault(budget.key, _Budget())
                if state.spent + state.reserved(now) + amount_micro_usd > budget.limit_micro_usd:
                    return Admission(False, blocked_by=budget.key)
            for limit in limits:
                buckets, _, current = self._window(limit.key, limit.window_s, now)
                buckets[current] = buckets.get(current, 0) + limit.cost
            reservation_id = uuid.uuid4().hex if budgets else None
            for budget in budgets:
                self._budgets[budget.key].reservations[reservation_id] = (amount_micro_usd, now + ttl_s)
            return Admission(True, reservation_id=reservation_id)

    async def settle_many(self, settlements: Sequence[Settlement]) -> dict[str, tuple[int, int]]:
        async with self._lock:
            now = self._now()
            touched: set[str] = set()
            for settlement in settlements:
                for adjustment in settlement.adjustments:
                    if adjustment.delta:
                        buckets, _, current = self._window(adjustment.key, adjustment.window_s, now)
                        # This state never grants leases; one handed back here came from Redis
                        # before it became unreachable and has nothing to return to.
                        if adjustment.bucket is None:
                            buckets[current] = buckets.get(current, 0) + adjustment.delta
                for i, key in enumerate(settlement.budget_keys):
                    state = self._budgets.setdefault(key, _Budget())
                    rid, release = (
                        settlement.releases[i] if settlement.releases else (settlement.reservation_id, 0)
                    )
                    held = state.reservations.get(rid)
                    if held is not None:
                        if 0 < release < held[0]:
                            state.reservations[rid] = (held[0] - release, held[1])
                        else:
                            del state.reservations[rid]
                    state.spent += settlement.actual_micro_usd
                    state.spent_known = True
                    touched.add(key)
            return {key: (self._budgets[key].spent, self._budgets[key].reserved(now)) for key in touched}

    async def budget_seed(self, key: str, spent_micro_usd: int) -> None:
        async with self._lock:
            state = self._budgets.setdefault(key, _Budget())
            if not state.spent_known:  # as Redis's HSETNX: a reservation alone does not count as known
                state.spent, state.spent_known = spent_micro_usd, True

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
        self._kv[key] = (value, self._now() + ttl_s if ttl_s else None)

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, ttl_s: float | None = None
    ) -> bool:
        async with self._lock:
            if await self.kv_get(key) != expected:
                return False
            await self.kv_set(key, value, ttl_s)
            return True

    async def close(self) -> None:
        self._callbacks.clear()
