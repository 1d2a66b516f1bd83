"""Shared state in Redis. Every check-and-count is one Lua script, so it is atomic across replicas,
and every script reads Redis's own clock (TIME), so replicas with skewed clocks still agree."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Sequence

import redis.asyncio as aioredis

from gateway.state.base import BUCKETS, Admission, Budget, BudgetDecision, Limit, RevocationCallback

log = logging.getLogger(__name__)

BUDGET_KEY_TTL_MS = 40 * 24 * 3600 * 1000  # budgets are per month; let last month's keys expire

_NOW_MS = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: one per limit. ARGV: BUCKETS, then (limit, cost, window_ms) per key.
# Returns {1} when admitted, else {0, index of the refusing limit, retry-after ms}.
ACQUIRE = (
    _NOW_MS
    + """
local buckets = tonumber(ARGV[1])
local currents = {}
for i = 1, #KEYS do
  local limit = tonumber(ARGV[(i - 1) * 3 + 2])
  local cost = tonumber(ARGV[(i - 1) * 3 + 3])
  local window_ms = tonumber(ARGV[(i - 1) * 3 + 4])
  local bucket_ms = window_ms / buckets
  local current = math.floor(now_ms / bucket_ms)
  currents[i] = current
  local flat = redis.call('HGETALL', KEYS[i])
  local total = 0
  local live = {}
  for j = 1, #flat, 2 do
    local index = tonumber(flat[j])
    local count = tonumber(flat[j + 1])
    if index <= current - buckets then
      redis.call('HDEL', KEYS[i], flat[j])
    else
      total = total + count
      live[#live + 1] = {index, count}
    end
  end
  if total + cost > limit then
    local wait_ms = window_ms
    if cost <= limit then
      table.sort(live, function(a, b) return a[1] < b[1] end)
      local need = total + cost - limit
      local freed = 0
      for _, bucket in ipairs(live) do
        freed = freed + bucket[2]
        if freed >= need then
          wait_ms = (bucket[1] + buckets) * bucket_ms - now_ms
          break
        end
      end
    end
    return {0, i, string.format('%d', math.max(0, math.ceil(wait_ms)))}
  end
end
for i = 1, #KEYS do
  local window_ms = tonumber(ARGV[(i - 1) * 3 + 4])
  redis.call('HINCRBY', KEYS[i], string.format('%d', currents[i]), ARGV[(i - 1) * 3 + 3])
  redis.call('PEXPIRE', KEYS[i], math.ceil(window_ms + window_ms / buckets))
end
return {1}
"""
)

# KEYS[1]: limit key. ARGV: BUCKETS, delta, window_ms.
ADJUST = (
    _NOW_MS
    + """
local window_ms = tonumber(ARGV[3])
local current = math.floor(now_ms / (window_ms / tonumber(ARGV[1])))
redis.call('HINCRBY', KEYS[1], string.format('%d', current), ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(window_ms + window_ms / tonumber(ARGV[1])))
return 1
"""
)

# KEYS: (budget, budget:res, budget:exp) per budget. ARGV: amount, ttl_ms, reservation id, key ttl,
# then one limit per budget. Returns 0 when reserved, else the 1-based index of the refusing budget.
RESERVE = (
    _NOW_MS
    + """
local amount = tonumber(ARGV[1])
local n = #KEYS / 3
for i = 0, n - 1 do
  local k, res, exp = KEYS[i * 3 + 1], KEYS[i * 3 + 2], KEYS[i * 3 + 3]
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', exp, '-inf', now_ms)) do
    local stale = redis.call('HGET', res, id)
    if stale then
      redis.call('HINCRBY', k, 'reserved', string.format('%d', -tonumber(stale)))
      redis.call('HDEL', res, id)
    end
    redis.call('ZREM', exp, id)
  end
  local spent = tonumber(redis.call('HGET', k, 'spent') or '0')
  local reserved = tonumber(redis.call('HGET', k, 'reserved') or '0')
  if spent + reserved + amount > tonumber(ARGV[5 + i]) then
    return i + 1
  end
end
for i = 0, n - 1 do
  local k, res, exp = KEYS[i * 3 + 1], KEYS[i * 3 + 2], KEYS[i * 3 + 3]
  redis.call('HINCRBY', k, 'reserved', ARGV[1])
  redis.call('HSET', res, ARGV[3], ARGV[1])
  redis.call('ZADD', exp, now_ms + tonumber(ARGV[2]), ARGV[3])
  redis.call('PEXPIRE', k, ARGV[4])
  redis.call('PEXPIRE', res, ARGV[4])
  redis.call('PEXPIRE', exp, ARGV[4])
end
return 0
"""
)

# KEYS: as RESERVE. ARGV: reservation id, actual amount, key ttl.
SETTLE = """
for i = 0, #KEYS / 3 - 1 do
  local k, res, exp = KEYS[i * 3 + 1], KEYS[i * 3 + 2], KEYS[i * 3 + 3]
  local held = redis.call('HGET', res, ARGV[1])
  if held then
    redis.call('HINCRBY', k, 'reserved', string.format('%d', -tonumber(held)))
    redis.call('HDEL', res, ARGV[1])
    redis.call('ZREM', exp, ARGV[1])
  end
  redis.call('HINCRBY', k, 'spent', ARGV[2])
  redis.call('PEXPIRE', k, ARGV[3])
end
return 1
"""

# KEYS[1]. ARGV: expect-absent flag, expected, new value, ttl ms ('' for none).
COMPARE_AND_SET = """
local current = redis.call('GET', KEYS[1])
if (ARGV[1] == '1' and current == false) or (ARGV[1] == '0' and current == ARGV[2]) then
  if ARGV[4] ~= '' then
    redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
  else
    redis.call('SET', KEYS[1], ARGV[3])
  end
  return 1
end
return 0
"""


class RedisState:
    def __init__(self, client: aioredis.Redis, prefix: str = "weir:") -> None:
        self._redis = client
        self._prefix = prefix
        self._acquire = client.register_script(ACQUIRE)
        self._adjust = client.register_script(ADJUST)
        self._reserve = client.register_script(RESERVE)
        self._settle = client.register_script(SETTLE)
        self._cas = client.register_script(COMPARE_AND_SET)
        self._listeners: list[asyncio.Task[None]] = []

    @classmethod
    def from_url(cls, url: str, prefix: str = "weir:") -> RedisState:
        return cls(aioredis.from_url(url), prefix=prefix)

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _budget_keys(self, keys: Sequence[str]) -> list[str]:
        return [self._k(k) + suffix for k in keys for suffix in ("", ":res", ":exp")]

    async def acquire(self, limits: Sequence[Limit]) -> Admission:
        if not limits:
            return Admission(True)
        args: list[int | str] = [BUCKETS]
        for limit in limits:
            args += [limit.limit, limit.cost, int(limit.window_s * 1000)]
        result = await self._acquire(keys=[self._k(limit.key) for limit in limits], args=args)
        if int(result[0]) == 1:
            return Admission(True)
        return Admission(False, int(result[2]) / 1000, limits[int(result[1]) - 1].key)

    async def adjust(self, key: str, delta: int, window_s: float = 60.0) -> None:
        if delta:
            await self._adjust(keys=[self._k(key)], args=[BUCKETS, delta, int(window_s * 1000)])

    async def budget_seed(self, key: str, spent_micro_usd: int) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(self._k(key), "spent", spent_micro_usd)
            pipe.pexpire(self._k(key), BUDGET_KEY_TTL_MS)
            await pipe.execute()

    async def budget_reserve(
        self, budgets: Sequence[Budget], amount_micro_usd: int, ttl_s: float = 600.0
    ) -> BudgetDecision:
        if not budgets:
            return BudgetDecision(True, reservation_id=uuid.uuid4().hex)
        reservation_id = uuid.uuid4().hex
        args: list[int | str] = [amount_micro_usd, int(ttl_s * 1000), reservation_id, BUDGET_KEY_TTL_MS]
        args += [b.limit_micro_usd for b in budgets]
        refused = int(await self._reserve(keys=self._budget_keys([b.key for b in budgets]), args=args))
        if refused:
            return BudgetDecision(False, blocked_by=budgets[refused - 1].key)
        return BudgetDecision(True, reservation_id=reservation_id)

    async def budget_settle(self, keys: Sequence[str], reservation_id: str, actual_micro_usd: int) -> None:
        if keys:
            await self._settle(
                keys=self._budget_keys(keys), args=[reservation_id, actual_micro_usd, BUDGET_KEY_TTL_MS]
            )

    async def budget_usage(self, key: str) -> tuple[int, int]:
        spent, reserved = await self._redis.hmget(self._k(key), "spent", "reserved")
        return int(spent or 0), int(reserved or 0)

    async def publish_revocation(self, key_hash: str) -> None:
        await self._redis.publish(self._k("revocations"), key_hash)

    async def subscribe_revocations(self, callback: RevocationCallback) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self._k("revocations"))
        self._listeners.append(asyncio.create_task(self._listen(pubsub, callback)))

    async def _listen(self, pubsub: aioredis.client.PubSub, callback: RevocationCallback) -> None:
        # Runs for the life of the process; a dropped connection is retried, and the authenticator's
        # cache TTL bounds how stale a key can be while the link is down.
        while True:
            try:
                message = await pubsub.get_message(timeout=5.0)
                if message and message["type"] == "message":
                    data = message["data"]
                    result = callback(data.decode() if isinstance(data, bytes) else data)
                    if inspect.isawaitable(result):
                        await result
            except asyncio.CancelledError:
                await pubsub.aclose()
                raise
            except Exception:
                log.warning("revocation subscription failed; retrying", exc_info=True)
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await pubsub.subscribe(self._k("revocations"))

    async def kv_get(self, key: str) -> bytes | None:
        return await self._redis.get(self._k(key))

    async def kv_set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        await self._redis.set(self._k(key), value, px=int(ttl_s * 1000) if ttl_s else None)

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, ttl_s: float | None = None
    ) -> bool:
        args = ["1" if expected is None else "0", expected or b"", value, int(ttl_s * 1000) if ttl_s else ""]
        return int(await self._cas(keys=[self._k(key)], args=args)) == 1

    async def close(self) -> None:
        for task in self._listeners:
            task.cancel()
        for task in self._listeners:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._listeners.clear()
        await self._redis.aclose()
