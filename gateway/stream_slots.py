"""Concurrent-stream slots per tenant: counted in process, or across replicas in Redis.

In Redis each tenant has a sorted set of leases scored by their expiry (Redis server time, so replica
clocks do not matter). A replica refreshes the leases it holds every `ttl_s / 3`, so the leases of a
replica that died vanish after `ttl_s` instead of holding the tenant's slots forever. A lease is given
back (RELEASE: removed, and recorded so no refresh arriving later adds it back) when its stream's HTTP
exchange ends. When Redis cannot be reached, the replica counts its
own streams instead (the limit then holds per replica) and says so in the log once per outage. Only
the request that finds Redis gone waits for it (at most `timeout_s`: a Redis that hangs, rather than
refusing connections, would otherwise cost every stream that long); until a background task hears
from Redis again (asked every `retry_s`), streams are counted here at once.
"""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis
import structlog

from gateway.aio import detached, retry_until, stop_if_cancelled
from gateway.ids import random_hex
from gateway.state.base import Outage

log = structlog.get_logger("weir.limits")

# KEYS[1]: the tenant's lease set; ARGV: limit, lease id, ttl in ms. 1: taken, 0: full.
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""
# KEYS: (lease set, given-back set) per lease; ARGV[1]: ttl in ms, ARGV[2..]: the lease id held in
# each set. Adds a lease the set lost (not XX): its holder still runs the stream. Never one given back
# (RELEASE): a refresh can reach Redis after the lease it carries was given back (one whose reply
# timed out here, or that was on its way), and it added that lease back, holding the ended stream's
# slot for the TTL.
REFRESH = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  local key, given_back = KEYS[i * 2 - 3], KEYS[i * 2 - 2]
  if not redis.call('ZSCORE', given_back, ARGV[i]) then
    redis.call('ZADD', key, expiry, ARGV[i])
    redis.call('PEXPIRE', key, tonumber(ARGV[1]))
  end
end
return 1
"""
# KEYS[1]: the tenant's lease set, KEYS[2]: its given-back set; ARGV: lease id, ttl in ms. Removes the
# lease and remembers it as given back for the TTL (scored by when it is forgotten): a refresh that
# reaches Redis later cannot add it back (REFRESH), whichever order the two arrive in.
RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]))
return 1
"""


class LocalSlots:
    """Streams open on this replica, per tenant."""

    def __init__(self) -> None:
        self.streams: dict[str, int] = {}

    def acquire(self, tenant: str, limit: int) -> bool:
        open_now = self.streams.get(tenant, 0)
        if open_now >= limit:
            return False
        self.streams[tenant] = open_now + 1
        return True

    def add(self, tenant: str) -> None:
        """One more stream open, granted elsewhere (by Redis)."""
        self.streams[tenant] = self.streams.get(tenant, 0) + 1

    def release(self, tenant: str) -> None:
        left = self.streams.get(tenant, 0) - 1
        if left > 0:
            self.streams[tenant] = left
        else:
            self.streams.pop(tenant, None)


class RedisSlots:
    """Streams open on every replica sharing the Redis namespace, per tenant. With `outage`, the slots
    and that state share what they learn: a hang one of them met is not waited out again by the other
    (a stream's first request of an outage paid both timeouts, the slot's and its limits')."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "weir:",
        ttl_s: float = 30.0,
        timeout_s: float = 1.0,
        retry_s: float = 1.0,
        outage: Outage | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_ms = int(ttl_s * 1000)
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.local = LocalSlots()  # every stream open here: the count while Redis is away
        self.held: dict[str, tuple[str, str]] = {}  # lease id -> (tenant, set key), for refreshes
        self.unshared: set[str] = set()  # held leases granted while Redis was away, not in Redis yet
        self.degraded = False
        self.outage = outage
        self._acquire = client.register_script(ACQUIRE)
        self._refresh = client.register_script(REFRESH)
        self._release = client.register_script(RELEASE)
        self._tasks: set[asyncio.Task[None]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None  # asks Redis again while it is away

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "weir:", ttl_s: float = 30.0, outage: Outage | None = None
    ) -> RedisSlots:
        client = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        return cls(client, prefix, ttl_s, outage=outage)

    @property
    def away(self) -> bool:
        """Redis is known not to answer: found so here, or by the limits' state (`outage`)."""
        return self.degraded or (self.outage is not None and self.outage.degraded)

    def key(self, tenant: str) -> str:
        return f"{self.prefix}streams:{tenant}"

    def given_back_key(self, tenant: str) -> str:
        """The tenant's leases given back in the last TTL, which no refresh may add back."""
        return f"{self.prefix}streams-given-back:{tenant}"

    async def acquire(self, tenant: str, limit: int) -> str | None:
        """A lease id, or None when the tenant has `limit` streams open already."""
        lease = random_hex(12)
        if self.away:
            return self._grant_locally(tenant, limit, lease)
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.unshared:  # streams opened while Redis was away count in it from now on
                    await self._add(list(self.unshared))
                taken = await self._acquire(keys=[self.key(tenant)], args=[limit, lease, self.ttl_ms])
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            if not self.degraded:
                self.degraded = True
                log.warning(
                    "stream_slots_degraded", detail="Redis unreachable; counting per replica", error=repr(exc)
                )
            if self._prober is None or self._prober.done():
                self._prober = detached(self._probe())  # not the request's that met the outage
            if self.outage is not None:
                self.outage.lost(exc)
            return self._grant_locally(tenant, limit, lease)
        if not taken:
            return None
        self.held[lease] = (tenant, self.key(tenant))
        self.local.add(tenant)
        return lease

    def _grant_locally(self, tenant: str, limit: int, lease: str) -> str | None:
        """A lease counted against the streams open here (Redis is away), added to Redis once it is
        back: until then the other replicas cannot see it."""
        if not self.local.acquire(tenant, limit):
            return None
        lease = "local:" + lease
        self.held[lease] = (tenant, self.key(tenant))
        self.unshared.add(lease)
        return lease

    async def _add(self, leases: list[str]) -> None:
        """Put held leases in Redis with a fresh expiry, whether Redis still has them or not (unless
        given back meanwhile: see REFRESH)."""
        keys = []
        for lease in leases:
            tenant, key = self.held[lease]
            keys += [key, self.given_back_key(tenant)]
        await self._refresh(keys=keys, args=[self.ttl_ms, *leases])
        self.unshared.difference_update(leases)

    async def _probe(self) -> None:
        """Ask Redis every `retry_s` until it answers, off every request's path."""
        await retry_until(
            self.client.ping, self.retry_s, self.timeout_s, (aioredis.RedisError, OSError, TimeoutError)
        )
        self.degraded = False
        log.info("stream_slots_recovered")

    def release(self, tenant: str, lease: str) -> None:
        """Give a lease back without waiting (called as the exchange ends, maybe while cancelled).
        It leaves `held` at once, so no later refresh carries it; one already sent cannot add it
        back in Redis (RELEASE)."""
        if self.held.pop(lease, None) is None:
            return
        self.local.release(tenant)
        if lease in self.unshared:
            self.unshared.discard(lease)
            if self.away:
                # Not in Redis, unless an add of it failed here after Redis ran it: then it expires
                # after `ttl_s`, no refresh keeping it (a lease given back while Redis is away is too).
                return
        task = asyncio.get_running_loop().create_task(self._remove(tenant, lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _remove(self, tenant: str, lease: str) -> None:
        # On failure it expires after ttl_s: no refresh keeps it alive.
        with contextlib.suppress(aioredis.RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.timeout_s):
                await self._release(
                    keys=[self.key(tenant), self.given_back_key(tenant)], args=[lease, self.ttl_ms]
                )

    def start(self) -> None:
        self._heartbeat = asyncio.get_running_loop().create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        while True:
            stop_if_cancelled()  # a cancel that library code swallowed last round
            await asyncio.sleep(self.ttl_ms / 3000)
            if not self.held or self.away:  # once Redis is back, the next round adds them all
                continue
            try:
                await self._add(list(self.held))
            except (aioredis.RedisError, OSError) as exc:
                log.warning("stream_slots_refresh_failed", error=str(exc))

    async def close(self) -> None:
        for task in (self._heartbeat, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._tasks:
            if self.away:
                # Not waited for while Redis is away (each would wait out `timeout_s` on a hanging
                # one): the leases they give back expire after `ttl_s` without a refresh.
                for task in self._tasks:
                    task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()
