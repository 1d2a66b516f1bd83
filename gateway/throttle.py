"""Failed authentications per client address: a token bucket of `per_minute` failures, refilled at
`per_minute` a minute. Once an address has spent it, the caller answers 429 with `retry-after` until a
failure's worth has refilled. `FailureThrottle` keeps the buckets in process, so each replica counts on
its own (with R replicas an address gets up to R x the allowance); `SharedFailureThrottle` keeps them
in the shared state, so with Redis every replica counts against one bucket per address (per replica
again while Redis is away: gateway.state.degradable answers from the process then).

The address is the ASGI peer (`scope["client"]`): behind a proxy, `weir serve` replaces it with the
`X-Forwarded-For` client only when the proxy is in `server.forwarded_allow_ips` (uvicorn's own
setting; for granian its proxy-headers wrapper, gateway/cli.py), so set that to the proxy's address,
or every client behind it shares one bucket. IPv6 addresses count per /64, the block one host is
usually given (per address, one host could rotate through 2^64 of them).
"""

from __future__ import annotations

import functools
import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.state.base import SharedState

# Addresses tracked at once, the least recently failing dropped beyond it: the table must not grow
# with every address an attacker can send from. A dropped address starts again with a full bucket.
MAX_ADDRESSES = 10_000
WINDOW_S = 60.0


def client_address(scope: Mapping[str, Any]) -> str:
    """The bucket of this request's peer: its IPv4 address, its IPv6 /64, or "unknown"."""
    client = scope.get("client")
    host = client[0] if client else None
    if not host:
        return "unknown"
    return _bucket(host)


# Every authenticated request asks, mostly for the same few peers, and ipaddress's parse costs several
# microseconds: once per address. Bounded, so a flood of addresses only turns the cache over.
@functools.lru_cache(maxsize=4096)
def _bucket(host: str) -> str:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return str(host)  # a unix socket path or a test client's name: one bucket each
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


Bucket = tuple[float, float]  # (tokens, when they were counted)


class FailureThrottle:
    """Token buckets of failures per address, in this process; `per_minute` 0 turns the throttle off."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()  # address -> bucket

    def _tokens(self, bucket: Bucket | None, now: float) -> float:
        if bucket is None:
            return float(self.per_minute)
        tokens, at = bucket
        # (now < at: another replica's clock runs ahead of this one's; nothing refilled yet)
        return min(float(self.per_minute), tokens + max(0.0, now - at) * self.per_minute / WINDOW_S)

    def _wait(self, bucket: Bucket | None) -> int | None:
        if self.per_minute <= 0 or bucket is None:
            return None  # no failures (a full bucket): every request with a key asks, so no clock read
        tokens = self._tokens(bucket, self.clock())
        if tokens >= 1.0:
            return None
        return max(1, math.ceil((1.0 - tokens) * WINDOW_S / self.per_minute))

    def _spent(self, bucket: Bucket | None) -> Bucket:
        """The bucket after one more failure."""
        now = self.clock()
        return max(0.0, self._tokens(bucket, now) - 1.0), now

    async def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may fail again, or None while it still may."""
        return self._wait(self._buckets.get(address))

    async def failed(self, address: str) -> None:
        if self.per_minute <= 0:
            return
        self._buckets[address] = self._spent(self._buckets.get(address))
        self._buckets.move_to_end(address)
        while len(self._buckets) > MAX_ADDRESSES:
            self._buckets.popitem(last=False)


class SharedFailureThrottle(FailureThrottle):
    """The buckets in the shared state (Redis), under `auth-failures:<scope>:<address>` (scope "api"
    or "admin"), so every replica counts against the same one. Each expires WINDOW_S after its last
    failure, by when it has refilled (an absent bucket is a full one), so Redis holds only addresses
    that failed in the last minute. The clock is the wall clock: the replicas' must agree."""

    def __init__(
        self, per_minute: int, state: SharedState, scope: str, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(per_minute, clock)
        self.state = state
        self.scope = scope

    def _key(self, address: str) -> str:
        return f"auth-failures:{self.scope}:{address}"

    async def retry_after(self, address: str) -> int | None:
        if self.per_minute <= 0:
            return None
        return self._wait(_decode(await self.state.kv_get(self._key(address))))

    async def failed(self, address: str) -> None:
        if self.per_minute <= 0:
            return
        key = self._key(address)
        for _ in range(10):  # compare-and-set: concurrent failures on other replicas all count
            raw = await self.state.kv_get(key)
            tokens, at = self._spent(_decode(raw))
            if await self.state.kv_compare_and_set(key, raw, f"{tokens!r} {at!r}".encode(), WINDOW_S):
                return


def _decode(raw: bytes | None) -> Bucket | None:
    """A shared bucket as `SharedFailureThrottle` wrote it; None (a full one) for what it cannot read."""
    if raw is None:
        return None
    try:
        tokens, at = raw.split()
        return float(tokens), float(at)
    except ValueError:
        return None
