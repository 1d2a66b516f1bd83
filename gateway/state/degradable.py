"""Shared state that survives its Redis going away: in-process limits meanwhile, Redis again after.

A gateway must keep serving when Redis is down. While it is unreachable, every call goes to a
`MemoryState` in this process: limits and budgets hold per replica instead of across replicas (N
replicas may admit up to N times a limit), a revocation reaches only this replica at once (the others
within the key-cache TTL), and `weir_shared_state_degraded` is 1 so an alert fires. Redis is tried
again every `retry_s`; the first call that succeeds switches back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError

from gateway.state.base import (
    Admission,
    Budget,
    Limit,
    RevocationCallback,
    Settlement,
    SharedState,
    Shortcuts,
)
from gateway.state.memory import MemoryState

log = logging.getLogger(__name__)

_UNREACHABLE = (RedisError, OSError, TimeoutError)
_degraded: set[int] = set()  # ids of this process's states now running without Redis


def degraded_states() -> int:
    """How many shared states in this process run without Redis now (the metric's value)."""
    return len(_degraded)


class DegradableState(Shortcuts):
    def __init__(self, primary: SharedState, *, timeout_s: float = 1.0, retry_s: float = 1.0) -> None:
        self.primary = primary
        self.fallback = MemoryState()
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._retry_at = 0.0

    @property
    def degraded(self) -> bool:
        return id(self) in _degraded

    async def _call(self, name: str, *args: Any) -> Any:
        if self.degraded and time.monotonic() < self._retry_at:
            return await getattr(self.fallback, name)(*args)
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await getattr(self.primary, name)(*args)
        except _UNREACHABLE as exc:
            if not self.degraded:
                log.warning("Redis unreachable (%s): limits and budgets now per process", exc)
                _degraded.add(id(self))
            self._retry_at = time.monotonic() + self.retry_s
            return await getattr(self.fallback, name)(*args)
        if self.degraded:
            log.warning("Redis reachable again: limits and budgets shared across replicas")
            _degraded.discard(id(self))
        return result

    async def admit(
        self,
        limits: Sequence[Limit],
        budgets: Sequence[Budget] = (),
        amount_micro_usd: int = 0,
        ttl_s: float = 600.0,
    ) -> Admission:
        return await self._call("admit", limits, budgets, amount_micro_usd, ttl_s)

    async def settle_many(self, settlements: Sequence[Settlement]) -> dict[str, tuple[int, int]]:
        result: dict[str, tuple[int, int]] = await self._call("settle_many", settlements)
        return result

    async def budget_seed(self, key: str, spent_micro_usd: int) -> None:
        await self._call("budget_seed", key, spent_micro_usd)

    async def budget_usage(self, key: str) -> tuple[int, int]:
        result: tuple[int, int] = await self._call("budget_usage", key)
        return result

    async def publish_revocation(self, key_hash: str) -> None:
        # This replica drops the key at once either way (the memory state calls its subscribers).
        await self.fallback.publish_revocation(key_hash)
        await self._call("publish_revocation", key_hash)

    async def subscribe_revocations(self, callback: RevocationCallback) -> None:
        await self.fallback.subscribe_revocations(callback)
        try:
            await self.primary.subscribe_revocations(callback)  # retries on its own once started
        except _UNREACHABLE as exc:
            log.warning("cannot subscribe to revocations in Redis (%s); this replica only", exc)

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

    async def close(self) -> None:
        _degraded.discard(id(self))
        await self.fallback.close()
        await self.primary.close()
