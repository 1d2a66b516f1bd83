"""Failed authentications per client address: a token bucket of `per_minute` failures, refilled at
`per_minute` a minute. Once an address has spent it, the caller answers 429 with `retry-after` until a
failure's worth has refilled. Kept in process, so each replica counts on its own (with R replicas an
address gets up to R x the allowance); the load balancer is the place for a global limit.

The address is the ASGI peer (`scope["client"]`): behind a proxy, uvicorn replaces it with the
`X-Forwarded-For` client only when the proxy is in `FORWARDED_ALLOW_IPS` (127.0.0.1 and ::1 by
default), so set that to the proxy's address, or every client behind it shares one bucket (granian,
as `weir serve` runs it, never does). IPv6 addresses count per /64, the block one host is usually
given (per address, one host could rotate through 2^64 of them).
"""

from __future__ import annotations

import functools
import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

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


class FailureThrottle:
    """Token buckets of failures per address; `per_minute` 0 turns the throttle off."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, at)

    def _tokens(self, address: str, now: float) -> float:
        entry = self._buckets.get(address)
        if entry is None:
            return float(self.per_minute)
        tokens, at = entry
        return min(float(self.per_minute), tokens + (now - at) * self.per_minute / WINDOW_S)

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may fail again, or None while it still may."""
        if self.per_minute <= 0 or address not in self._buckets:
            return None  # no failures (a full bucket): every request with a key asks, so no clock read
        tokens = self._tokens(address, self.clock())
        if tokens >= 1.0:
            return None
        return max(1, math.ceil((1.0 - tokens) * WINDOW_S / self.per_minute))

    def failed(self, address: str) -> None:
        if self.per_minute <= 0:
            return
        now = self.clock()
        self._buckets[address] = (max(0.0, self._tokens(address, now) - 1.0), now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > MAX_ADDRESSES:
            self._buckets.popitem(last=False)
