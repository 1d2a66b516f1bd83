"""Shared state in Redis. Every check-and-count is one Lua script, so it is atomic across replicas,
and every script reads Redis's own clock (TIME), so replicas with skewed clocks still agree."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    import hiredis
except ImportError:  # optional: redis-py's own packing then
    hiredis = None  # type: ignore[assignment]

from gateway.aio import stop_if_cancelled
from gateway.ids import random_hex
from gateway.state.base import (
    BUCKETS,
    LATE_SETTLE_S,
    Admission,
    Budget,
    Lease,
    Limit,
    RevocationCallback,
    Settlement,
    Shortcuts,
    admitted_mark,
)

log = logging.getLogger(__name__)

BUDGET_KEY_TTL_MS = 40 * 24 * 3600 * 1000  # budgets are per month; let last month's keys expire
# A seed remembers this long the events its ledger spend holds whose settlement had not reached Redis
# (budget:counted): a settlement comes within seconds of its event, unless Redis was unreachable.
LATE_SETTLE_MS = int(LATE_SETTLE_S * 1000)
# Events a budget without its seed records for the seed (budget:unseeded): one per attempt settled
# while the database stays down, for the key's 40 days, without this bound. Also within the bound
# parameters of one statement (SQLite's is 32,766) when the seed asks the ledger about them.
UNSEEDED_MAX = 10_000

_NOW_MS = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Budgets count pico-dollars, past 2^53 (about USD 9,007) for a large month: more than a Lua number
# (a double) holds exactly. So amounts are added by HINCRBY from their decimal text, never through a
# Lua number, and `spent` and `reserved` are returned as text; only the comparisons with a limit
# read them as numbers (within 2^-52 of the total, at most a thousandth of a micro-dollar).
_NEGATED = """
local function negated(text)
  if text == '0' then return '0' end
  return '-' .. text
end
"""

# A limit's hash holds one field per bucket (its index) plus 't', the sum of the live buckets, and
# 'lo', the oldest bucket index not yet removed. Admission then reads two fields and removes the
# buckets that left the window since the last call (about one a second), instead of reading and
# summing all of them on every request; a hash without 't'/'lo' (new, or older than this layout) is
# summed once from its buckets. Refusals read all buckets, to say when enough of them expire.
_WINDOW = """
local function window(key, current, buckets)
  local first_live = current - buckets + 1
  local state = redis.call('HMGET', key, 'lo', 't')
  local lo, total = tonumber(state[1]), tonumber(state[2])
  if lo == nil or total == nil or first_live - lo > buckets then
    total = 0
    local flat = redis.call('HGETALL', key)
    for j = 1, #flat, 2 do
      local index = tonumber(flat[j])
      if index ~= nil then
        if index < first_live then
          redis.call('HDEL', key, flat[j])
        else
          total = total + tonumber(flat[j + 1])
        end
      end
    end
    redis.call('HSET', key, 'lo', string.format('%d', first_live), 't', string.format('%d', total))
  elseif lo < first_live then
    for index = lo, first_live - 1 do
      local field = string.format('%d', index)
      local count = redis.call('HGET', key, field)
      if count then
        total = total - tonumber(count)
        redis.call('HDEL', key, field)
      end
    end
    redis.call('HSET', key, 'lo', string.format('%d', first_live), 't', string.format('%d', total))
  end
  return total
end

local function live_buckets(key)
  local live = {}
  local flat = redis.call('HGETALL', key)
  for j = 1, #flat, 2 do
    local index = tonumber(flat[j])
    if index ~= nil then
      live[#live + 1] = {index, tonumber(flat[j + 1])}
    end
  end
  table.sort(live, function(a, b) return a[1] < b[1] end)
  return live
end

-- ms until the newest bucket of `live` (live_buckets) that holds units has left the window.
local function emptied_in(live, buckets, bucket_ms, now_ms)
  for j = #live, 1, -1 do
    if live[j][2] > 0 then
      return math.max(0, math.ceil((live[j][1] + buckets) * bucket_ms - now_ms))
    end
  end
  return 0
end
"""

# KEYS: the limit keys, then (budget, budget:res, budget:exp) per budget.
# ARGV: BUCKETS, number of limits, (limit, cost, window_ms, lease) per limit, then amount, reservation
# ttl ms, reservation id, budget key ttl ms, then (limit, pool, seeded: 1 or 0) per budget, then the
# ms to keep the admission's mark (0: none; else its key is the last of KEYS): set when admitted, it
# says that the limits were counted, to a caller that lost the answer (DegradableState).
# Returns {1, then (leased units, bucket, ms left in it, units the window holds now, ms until they
# have all left it) per limit, then the pool per budget, then `spent` per budget} when admitted,
# {0, 1, limit index, retry-after ms, units its window holds, ms until they have all left it} or
# {0, 2, budget index, then (units its window holds, ms until they have all left it) per limit, then
# `spent` per budget up to that one} when refused (the windows: for the rate-limit headers of a
# budget's 429; `spent`: for the in-process fallback to start from during an outage,
# gateway.state.degradable), or {0, 3, then the index of each budget the
# caller seeded that holds no seed: Redis lost it}; nothing is counted or reserved unless everything
# fits. A lease or pool is granted only while the window (the budget) stays at most half used with
# it, so near a limit every request is decided here, one by one.
ADMIT = (
    _NOW_MS
    + _NEGATED
    + _WINDOW
    + """
local buckets = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local currents, totals = {}, {}
for i = 1, n do
  local limit = tonumber(ARGV[(i - 1) * 4 + 3])
  local cost = tonumber(ARGV[(i - 1) * 4 + 4])
  local window_ms = tonumber(ARGV[(i - 1) * 4 + 5])
  local bucket_ms = window_ms / buckets
  local current = math.floor(now_ms / bucket_ms)
  currents[i] = current
  local total = window(KEYS[i], current, buckets)
  totals[i] = total
  if total + cost > limit then
    local wait_ms = window_ms
    local live = live_buckets(KEYS[i])
    local emptied_ms = emptied_in(live, buckets, bucket_ms, now_ms)
    if cost <= limit then
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
    return {0, 1, i, string.format('%d', math.max(0, math.ceil(wait_ms))), string.format('%d', total),
      string.format('%d', emptied_ms)}
  end
end
local b0 = 3 + n * 4
local amount = tonumber(ARGV[b0])
local nb = math.floor((#KEYS - n) / 3)
local mark_ms = tonumber(ARGV[b0 + 4 + nb * 3])
local pools, spents, lost = {}, {}, {}
for i = 0, nb - 1 do
  local k, res, exp = KEYS[n + i * 3 + 1], KEYS[n + i * 3 + 2], KEYS[n + i * 3 + 3]
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', exp, '-inf', now_ms)) do
    local stale = redis.call('HGET', res, id)
    if stale then
      redis.call('HINCRBY', k, 'reserved', negated(stale))
      redis.call('HDEL', res, id)
    end
    redis.call('ZREM', exp, id)
  end
  local spent_text = redis.call('HGET', k, 'spent') or '0'
  local spent = tonumber(spent_text)
  spents[i + 1] = spent_text
  local reserved = tonumber(redis.call('HGET', k, 'reserved') or '0')
  local limit = tonumber(ARGV[b0 + 4 + i * 3])
  if ARGV[b0 + 6 + i * 3] == '1' and redis.call('HEXISTS', k, 'seeded') == 0 then
    lost[#lost + 1] = i + 1
  end
  if spent + reserved + amount > limit then
    local out = {0, 2, i + 1}
    -- The limits' windows as they stand (nothing counted): a budget's 429 carries the rate-limit
    -- headers of a tenant that has limits too, as every other answer does.
    for j = 1, n do
      local bucket_ms = tonumber(ARGV[(j - 1) * 4 + 5]) / buckets
      out[#out + 1] = string.format('%d', totals[j])
      out[#out + 1] = string.format('%d', emptied_in(live_buckets(KEYS[j]), buckets, bucket_ms, now_ms))
    end
    for j = 1, i + 1 do out[#out + 1] = spents[j] end
    return out
  end
  local pool = ARGV[b0 + 5 + i * 3]
  if tonumber(pool) <= 0 or spent + reserved + amount + tonumber(pool) > math.floor(limit / 2) then
    pool = '0'
  end
  pools[i + 1] = pool
end
if #lost > 0 then
  local out = {0, 3}
  for _, i in ipairs(lost) do out[#out + 1] = i end
  return out
end
local out = {1}
for i = 1, n do
  local limit = tonumber(ARGV[(i - 1) * 4 + 3])
  local cost = tonumber(ARGV[(i - 1) * 4 + 4])
  local window_ms = tonumber(ARGV[(i - 1) * 4 + 5])
  local lease = tonumber(ARGV[(i - 1) * 4 + 6])
  if lease <= 0 or totals[i] + cost + lease > math.floor(limit / 2) then
    lease = 0
  end
  local counted = string.format('%d', cost + lease)
  redis.call('HINCRBY', KEYS[i], string.format('%d', currents[i]), counted)
  redis.call('HINCRBY', KEYS[i], 't', counted)
  redis.call('PEXPIRE', KEYS[i], math.ceil(window_ms + window_ms / buckets))
  local bucket_ms = window_ms / buckets
  out[#out + 1] = lease
  out[#out + 1] = string.format('%d', currents[i])
  out[#out + 1] = string.format('%d', math.floor((currents[i] + 1) * bucket_ms - now_ms))
  out[#out + 1] = string.format('%d', totals[i] + cost + lease)
  out[#out + 1] = string.format('%d', math.ceil((currents[i] + buckets) * bucket_ms - now_ms))
end
for i = 0, nb - 1 do
  local k, res, exp = KEYS[n + i * 3 + 1], KEYS[n + i * 3 + 2], KEYS[n + i * 3 + 3]
  redis.call('HINCRBY', k, 'reserved', ARGV[b0])
  redis.call('HSET', res, ARGV[b0 + 2], ARGV[b0])
  if pools[i + 1] ~= '0' then
    redis.call('HINCRBY', k, 'reserved', pools[i + 1])
    redis.call('HINCRBY', res, ARGV[b0 + 2], pools[i + 1])
  end
  redis.call('ZADD', exp, now_ms + tonumber(ARGV[b0 + 1]), ARGV[b0 + 2])
  redis.call('PEXPIRE', k, ARGV[b0 + 3])
  redis.call('PEXPIRE', res, ARGV[b0 + 3])
  redis.call('PEXPIRE', exp, ARGV[b0 + 3])
  out[#out + 1] = pools[i + 1]
end
for i = 1, nb do out[#out + 1] = spents[i] end
if mark_ms > 0 then
  redis.call('SET', KEYS[#KEYS], '1', 'PX', mark_ms)
end
return out
"""
)

# Many finished attempts at once, summed per key by the caller.
# KEYS: the limit keys to adjust, then (budget, budget:res, budget:exp, budget:unseeded, budget:counted)
# per budget.
# ARGV: BUCKETS, number of limit keys, (delta, window_ms, bucket or -1 for the current one) per limit
# key, budget key ttl ms, UNSEEDED_MAX, then per budget: the actual amount to add to `spent`, the number of
# reservations to release, (id, amount; 0 for all of it) per reservation, the number of usage events
# in the amount, (event id, cost) per event.
# A delta for a bucket that already left the window is dropped (it no longer counts anyway).
# A budget that holds no seed (Redis lost it, or it was never seeded) also records its events in
# budget:unseeded, for the seed to tell which of them the ledger's spend holds already (SEED), at most
# UNSEEDED_MAX of them: beyond that (the database down for long while attempts settle) an attempt
# counts in `spent` alone, and the seed counts it again if the ledger holds it by then (too much,
# never too little), where the hash grew by one entry per attempt for the key's 40 days. A seeded
# budget whose seed counted events the ledger held before their settlement came (budget:counted,
# for LATE_SETTLE_MS after the seed) takes those out of the amount instead of counting them twice;
# nearly always it only checks its mark and that set's existence.
# Returns (spent, reserved) per budget, afterwards.
SETTLE = (
    _NOW_MS
    + _NEGATED
    + """
local buckets = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
for i = 1, n do
  local delta = ARGV[(i - 1) * 3 + 3]
  local window_ms = tonumber(ARGV[(i - 1) * 3 + 4])
  local bucket = tonumber(ARGV[(i - 1) * 3 + 5])
  local current = math.floor(now_ms / (window_ms / buckets))
  local live = true
  if bucket < 0 then
    bucket = current
  else
    local lo = tonumber(redis.call('HGET', KEYS[i], 'lo'))
    live = bucket > current - buckets and (lo == nil or bucket >= lo)
  end
  if live then
    redis.call('HINCRBY', KEYS[i], string.format('%d', bucket), delta)
    redis.call('HINCRBY', KEYS[i], 't', delta)
    redis.call('PEXPIRE', KEYS[i], math.ceil(window_ms + window_ms / buckets))
  end
end
local ttl = ARGV[3 + n * 3]
local unseeded_max = tonumber(ARGV[4 + n * 3])
local a = 5 + n * 3
local usage = {}
for i = 0, (#KEYS - n) / 5 - 1 do
  local k, res, exp = KEYS[n + i * 5 + 1], KEYS[n + i * 5 + 2], KEYS[n + i * 5 + 3]
  local actual = ARGV[a]
  local count = tonumber(ARGV[a + 1])
  for j = 0, count - 1 do
    local id = ARGV[a + 2 + j * 2]
    local release = ARGV[a + 3 + j * 2]
    local held = redis.call('HGET', res, id)
    if held then
      if tonumber(release) <= 0 or tonumber(release) >= tonumber(held) then
        release = held
        redis.call('HDEL', res, id)
        redis.call('ZREM', exp, id)
      else
        redis.call('HINCRBY', res, id, negated(release))
      end
      redis.call('HINCRBY', k, 'reserved', negated(release))
    end
  end
  a = a + 2 + count * 2
  local events = tonumber(ARGV[a])
  if events > 0 and redis.call('HEXISTS', k, 'seeded') == 0 then
    local unseeded = KEYS[n + i * 5 + 4]
    local room = unseeded_max - redis.call('HLEN', unseeded)
    for j = 0, events - 1 do
      local id = ARGV[a + 1 + j * 2]
      local known = redis.call('HEXISTS', unseeded, id) == 1
      if known or room > 0 then
        redis.call('HINCRBY', unseeded, id, ARGV[a + 2 + j * 2])
        if not known then room = room - 1 end
      end
    end
    redis.call('PEXPIRE', unseeded, ttl)
  elseif events > 0 and redis.call('EXISTS', KEYS[n + i * 5 + 5]) == 1 then
    local counted = KEYS[n + i * 5 + 5]
    for j = 0, events - 1 do
      if redis.call('SREM', counted, ARGV[a + 1 + j * 2]) == 1 then
        redis.call('HINCRBY', k, 'spent', negated(ARGV[a + 2 + j * 2]))
      end
    end
  end
  a = a + 1 + events * 2
  redis.call('HINCRBY', k, 'spent', actual)
  redis.call('PEXPIRE', k, ttl)
  usage[#usage + 1] = redis.call('HGET', k, 'spent')
  usage[#usage + 1] = redis.call('HGET', k, 'reserved') or '0'
end
return usage
"""
)

# KEYS: a budget, budget:unseeded, budget:counted. ARGV: the ledger's spend this month, the key's ttl
# ms, LATE_SETTLE_MS, the number of events the caller read from budget:unseeded, those event ids, then
# the events the ledger's spend holds among them and among those created in the last LATE_SETTLE_MS.
# Added to `spent` once (`seeded` marks it), on top of whatever was settled since Redis lost the
# budget (or before its first seed): a replica that seeds it again then still counts those attempts,
# but those the ledger already holds only once (their recorded cost comes off `spent`). The ledger's
# recent events not settled here yet go to budget:counted, where their settlement, when it comes,
# finds them counted already (SETTLE).
# Returns 1, or 0 with nothing changed when budget:unseeded is no longer what the caller read (events
# settled since: the ledger may hold them too, so the caller reads both again).
SEED = (
    _NEGATED
    + """
if redis.call('HEXISTS', KEYS[1], 'seeded') == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
local read = tonumber(ARGV[4])
if redis.call('HLEN', KEYS[2]) ~= read then return 0 end
for j = 5, 4 + read do
  if redis.call('HEXISTS', KEYS[2], ARGV[j]) == 0 then return 0 end
end
local counted = 0
for j = 5 + read, #ARGV do
  local cost = redis.call('HGET', KEYS[2], ARGV[j])
  if cost then
    redis.call('HINCRBY', KEYS[1], 'spent', negated(cost))
  else
    redis.call('SADD', KEYS[3], ARGV[j])
    counted = counted + 1
  end
end
if counted > 0 then redis.call('PEXPIRE', KEYS[3], ARGV[3]) end
redis.call('HSET', KEYS[1], 'seeded', '1')
redis.call('HINCRBY', KEYS[1], 'spent', ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

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

# KEYS[1]: the live replicas (a sorted set: a replica's id -> when its announcement lapses, ms of
# Redis's clock). ARGV: the caller's id, ttl ms. Marks the caller alive for the TTL, drops those whose
# announcement lapsed (stopped or crashed), and returns how many are left, the caller included. The
# set outlives the longest announcement in it.
ANNOUNCE = (
    _NOW_MS
    + """
local ttl_ms = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now_ms + ttl_ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('PTTL', KEYS[1]) < ttl_ms then redis.call('PEXPIRE', KEYS[1], ttl_ms) end
return redis.call('ZCARD', KEYS[1])
"""
)

# KEYS[1]. ARGV: value, ttl ms. {1, ttl ms} when set, else {0, ms the value held has left (-1: none)}.
SET_IF_ABSENT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, tonumber(ARGV[2])}
end
return {0, redis.call('PTTL', KEYS[1])}
"""


class HiredisConnection(aioredis.Connection):
    """redis-py parses replies with hiredis when it is installed, but packs commands in Python on
    asyncio connections (its hiredis packer serves only the sync client): a script call with 60
    arguments cost more to pack than to run. This packs them with hiredis, byte for byte the same."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if hiredis is None:
            return super().pack_command(*args)
        first = args[0]
        # As redis-py: a command name with spaces (b"CONFIG GET") goes as separate arguments.
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a memoryview, a bool (an error there too)...: redis-py decides
            return super().pack_command(*args)


def client_from_url(url: str, **kwargs: Any) -> aioredis.Redis:
    """A Redis client whose TCP connections pack commands with hiredis (a rediss:// or unix:// URL
    picks its own connection class, as redis-py's from_url does)."""
    return aioredis.from_url(url, connection_class=HiredisConnection, **kwargs)


RESUBSCRIBE_S = 1.0  # how often a lost revocation subscription is made again
LINK_TIMEOUT_S = 5.0  # connect, and wait for a reply, at most this long (redis-py's default too)


class ScriptLink(asyncio.Protocol):
    """One TCP connection to Redis for the state's script pipelines, written and read directly:
    commands packed by hiredis go out in one `transport.write`, replies are parsed by a hiredis
    reader in `data_received` and handed, in order, to the pipeline that asked for them.

    redis-py's asyncio connection spent about 150 us of CPU per round trip here (a pool checkout
    and release, a task for `wait_for` around every write, its stream reader and per-reply
    coroutines, health checks and observability hooks), on every admission that reaches Redis and
    every settlement batch. Replies are matched to pipelines first in, first out, so several
    pipelines can be in flight on one connection; a pipeline whose caller gave up still takes its
    replies off the connection, which stays in step. A connection that closes, or gives no reply
    for LINK_TIMEOUT_S, fails every pipeline waiting on it (RedisConnectionError / RedisTimeoutError,
    as redis-py would) and the next call opens a new one."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(protocolError=InvalidResponse, replyError=ResponseError)
        # (future, replies so far, replies expected, when sent), oldest first.
        self._waiting: deque[tuple[asyncio.Future[list[Any]], list[Any], int, float]] = deque()
        self._transport: asyncio.Transport | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self.closed = False

    @classmethod
    async def open(cls, kwargs: dict[str, Any]) -> ScriptLink:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(LINK_TIMEOUT_S):
                _, link = await loop.create_connection(
                    cls, kwargs.get("host", "localhost"), int(kwargs.get("port", 6379))
                )
                hello: list[tuple[Any, ...]] = []
                if kwargs.get("password"):
                    user = kwargs.get("username")
                    hello.append(("AUTH", user, kwargs["password"]) if user else ("AUTH", kwargs["password"]))
                if int(kwargs.get("db") or 0):
                    hello.append(("SELECT", int(kwargs["db"])))
                if hello:
                    for reply in await link.send(hello):
                        if isinstance(reply, Exception):
                            link.close()
                            raise RedisConnectionError(f"Redis refused the connection: {reply}")
        except TimeoutError:
            raise RedisTimeoutError("Timeout connecting to Redis") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error connecting to Redis: {exc}") from exc
        return link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def send(self, commands: Sequence[tuple[Any, ...]]) -> asyncio.Future[list[Any]]:
        """Write `commands`; the future gets their replies (an error reply as its exception object,
        in its place)."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if self.closed or self._transport is None:
            future.set_exception(RedisConnectionError("Redis connection closed"))
            return future
        payload = b"".join([hiredis.pack_command(command) for command in commands])
        self._waiting.append((future, [], len(commands), time.monotonic()))
        self._transport.write(payload)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(LINK_TIMEOUT_S, self._watch)
        return future

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                if isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT"):
                    reply = NoScriptError(str(reply))
                future, replies, expected, _ = self._waiting[0]
                replies.append(reply)
                if len(replies) == expected:
                    self._waiting.popleft()
                    if not future.done():
                        future.set_result(replies)
        except (InvalidResponse, IndexError) as exc:  # garbled, or a reply nobody asked for
            self._fail(RedisConnectionError(f"Redis connection out of step: {exc!r}"))

    def _watch(self) -> None:
        self._watchdog = None
        if not self._waiting:
            return
        age = time.monotonic() - self._waiting[0][3]
        if age >= LINK_TIMEOUT_S:
            self._fail(RedisTimeoutError("Timeout reading from Redis"))
        else:
            self._watchdog = asyncio.get_running_loop().call_later(LINK_TIMEOUT_S - age, self._watch)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(
            RedisConnectionError(f"Redis connection lost: {exc}" if exc else "Redis closed the connection")
        )

    def _fail(self, error: Exception) -> None:
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._transport is not None:
            self._transport.abort()
            self._transport = None
        while self._waiting:
            future = self._waiting.popleft()[0]
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self._fail(RedisConnectionError("Redis connection closed"))


class StreamRider(Protocol):
    """Something with a stream entry to send (the usage queue's buffered events) that may ride along
    in a script pipeline going to Redis anyway, instead of costing a round trip of its own."""

    def take_entry(self) -> tuple[str, bytes] | None:
        """(stream, entry) to XADD now, or None; it is no longer buffered once taken."""
        ...

    def entry_sent(self, entry: bytes) -> None: ...

    def entry_failed(self, entry: bytes) -> None:
        """The XADD failed or its outcome is unknown: the entry goes back to be sent again."""
        ...


class RedisState(Shortcuts):
    def __init__(self, client: aioredis.Redis, prefix: str = "weir:") -> None:
        self._redis = client
        self._prefix = prefix
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)
        self._seed = client.register_script(SEED)
        self._cas = client.register_script(COMPARE_AND_SET)
        self._set_if_absent = client.register_script(SET_IF_ABSENT)
        self._announce = client.register_script(ANNOUNCE)
        self._listeners: list[asyncio.Task[None]] = []
        self._queued: list[tuple[AsyncScript, list[str], list[int | str], asyncio.Future[Any]]] = []
        self._flush_scheduled = False
        self._senders: set[asyncio.Task[None]] = set()
        self.rider: StreamRider | None = None
        # Script pipelines go on a ScriptLink of their own where redis-py's connection would be a
        # plain TCP one (not TLS, not a unix socket); else on a pooled redis-py connection.
        pool = client.connection_pool
        self._link_kwargs: dict[str, Any] | None = (
            dict(pool.connection_kwargs)
            if hiredis is not None and getattr(pool, "connection_class", None) is HiredisConnection
            else None
        )
        self._link: ScriptLink | None = None
        self._link_lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, prefix: str = "weir:") -> RedisState:
        return cls(client_from_url(url), prefix=prefix)

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _budget_keys(self, keys: Sequence[str]) -> list[str]:
        return [self._k(k) + suffix for k in keys for suffix in ("", ":res", ":exp")]

    async def admit(
        self,
        limits: Sequence[Limit],
        budgets: Sequence[Budget] = (),
        amount_pico_usd: int = 0,
        ttl_s: float = 600.0,
        admission_id: str | None = None,
    ) -> Admission:
        if not limits and not budgets:
            return Admission(True)
        reservation_id = (admission_id or random_hex(16)) if budgets else None
        args: list[int | str] = [BUCKETS, len(limits)]
        for limit in limits:
            args += [limit.limit, limit.cost, int(limit.window_s * 1000), limit.lease]
        args += [amount_pico_usd, int(ttl_s * 1000), reservation_id or "", BUDGET_KEY_TTL_MS]
        for budget in budgets:
            args += [budget.limit_pico_usd, budget.pool_pico_usd, int(budget.seeded)]
        keys = [self._k(limit.key) for limit in limits] + self._budget_keys([b.key for b in budgets])
        if admission_id is not None and limits:
            # Kept while its units count (a window and its bucket): later, the units no longer count.
            window_s = max(limit.window_s for limit in limits)
            args.append(math.ceil(window_s * 1000 * (1 + 1 / BUCKETS)))
            keys.append(self._k(admitted_mark(admission_id)))
        else:
            args.append(0)
        result = await self._call(self._admit, keys, args)
        if int(result[0]) == 1:
            n = len(limits)
            leases = tuple(
                Lease(int(result[1 + i * 5]), int(result[2 + i * 5]), float(result[3 + i * 5]))
                for i in range(n)
            )
            windows = tuple((int(result[4 + i * 5]), int(result[5 + i * 5]) / 1000) for i in range(n))
            nb = len(budgets)
            pools = tuple(int(p) for p in result[1 + n * 5 : 1 + n * 5 + nb])
            spent = tuple(int(s) for s in result[1 + n * 5 + nb :])
            return Admission(
                True,
                reservation_id=reservation_id,
                leases=leases,
                pools=pools,
                spent=spent,
                buckets=tuple(lease.bucket for lease in leases),
                windows=windows,
            )
        if int(result[1]) == 1:
            held = ((int(result[4]), int(result[5]) / 1000),)
            return Admission(False, int(result[3]) / 1000, limits[int(result[2]) - 1].key, windows=held)
        if int(result[1]) == 3:
            return Admission(False, unseeded=tuple(budgets[int(i) - 1].key for i in result[2:]))
        n = len(limits)
        windows = tuple((int(result[3 + i * 2]), int(result[4 + i * 2]) / 1000) for i in range(n))
        spent = tuple(int(s) for s in result[3 + n * 2 :])
        return Admission(False, blocked_by=budgets[int(result[2]) - 1].key, spent=spent, windows=windows)

    async def settle_many(self, settlements: Sequence[Settlement]) -> dict[str, tuple[int, int]]:
        # One script call for the lot: limit corrections summed per key (and bucket), and per budget
        # the summed cost plus the reservations to release. Same result as settling one by one, far
        # less work for Redis and for the client's command packing.
        deltas: dict[tuple[str, float, int], int] = {}
        # Per budget: [summed cost], releases, (event id, cost) per attempt (for a budget that holds
        # no seed: the script alone looks, see SETTLE).
        budgets: dict[str, tuple[list[int], list[tuple[str, int]], list[tuple[str, int]]]] = {}
        for settlement in settlements:
            for adjustment in settlement.adjustments:
                if adjustment.delta:
                    bucket = -1 if adjustment.bucket is None else adjustment.bucket
                    where = (adjustment.key, adjustment.window_s, bucket)
                    deltas[where] = deltas.get(where, 0) + adjustment.delta
            for i, key in enumerate(settlement.budget_keys):
                entry = budgets.get(key)
                if entry is None:  # (not setdefault: its default would be built for every call)
                    entry = budgets[key] = ([0], [], [])
                total, releases, events = entry
                total[0] += settlement.actual_pico_usd
                if settlement.event_id and settlement.actual_pico_usd:
                    events.append((settlement.event_id, settlement.actual_pico_usd))
                if settlement.releases:
                    if settlement.releases[i][0]:
                        releases.append(settlement.releases[i])
                elif settlement.reservation_id:
                    releases.append((settlement.reservation_id, 0))
        adjust = [(where, delta) for where, delta in deltas.items() if delta]
        if not adjust and not budgets:
            return {}
        args: list[int | str] = [BUCKETS, len(adjust)]
        for (_, window_s, bucket), delta in adjust:
            args += [delta, int(window_s * 1000), bucket]
        args += [BUDGET_KEY_TTL_MS, UNSEEDED_MAX]
        for total, releases, events in budgets.values():
            args += [total[0], len(releases)]
            for rid, amount in releases:
                args += [rid, amount]
            args.append(len(events))
            for event_id, cost in events:
                args += [event_id, cost]
        keys = [self._k(key) for (key, _, _), _ in adjust]
        for key in budgets:
            keys += [*self._budget_keys([key]), self._k(key) + ":unseeded", self._k(key) + ":counted"]
        usage = await self._call(self._settle, keys, args)
        return {key: (int(usage[2 * i]), int(usage[2 * i + 1])) for i, key in enumerate(budgets)}

    def _call(self, script: AsyncScript, keys: list[str], args: list[int | str]) -> asyncio.Future[Any]:
        """Run a script, pipelined with every other script call made in the same event-loop turn:
        one round trip for all the requests being admitted or settled at once. Each script stays
        atomic on its own, so this changes cost, not results."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queued.append((script, keys, args, future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._start_send)
        return future

    def _start_send(self) -> None:
        task = asyncio.get_running_loop().create_task(self._send_queued())
        self._senders.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._senders.discard)

    async def _send_queued(self) -> None:
        self._flush_scheduled = False
        batch, self._queued = self._queued, []
        # Usage events buffered now ride in this pipeline: their XADD would otherwise be a round
        # trip of its own (the client's CPU per round trip is several times that of one more
        # command in a pipeline), and they reach Redis sooner than the queue's flush window.
        ride = self.rider.take_entry() if self.rider is not None else None
        ridden = False
        try:
            results = await self._evalsha_many(batch, ride)
            if ride is not None:
                outcome = results.pop()
                if not isinstance(outcome, Exception):
                    self.rider.entry_sent(ride[1])  # type: ignore[union-attr]
                    ridden = True
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                # Redis restarted or dropped its script cache: load the scripts, run those calls
                # again (a NOSCRIPT call did not run, so running it now counts it once).
                for script in {id(batch[i][0]): batch[i][0] for i in missing}.values():
                    await self._redis.script_load(script.script)
                again = await self._evalsha_many([batch[i] for i in missing])
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
        except Exception as exc:
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        finally:
            if ride is not None and not ridden:
                # Failed, or cancelled with the answer unknown: sent again by the queue (a repeat is
                # harmless, the ledger takes each event id once).
                self.rider.entry_failed(ride[1])  # type: ignore[union-attr]
        for (*_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _evalsha_many(
        self,
        calls: list[tuple[AsyncScript, list[str], list[int | str], asyncio.Future[Any]]],
        ride: tuple[str, bytes] | None = None,
    ) -> list[Any]:
        # EVALSHA by hand: redis-py's Script objects on a pipeline send SCRIPT EXISTS before every
        # execute, a second round trip on every admission. A rider's XADD goes last; its result too.
        commands: list[tuple[Any, ...]] = [
            ("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args, _ in calls
        ]
        if ride is not None:
            commands.append(("XADD", ride[0], "*", "e", ride[1]))
        return await self._pipeline(commands)

    async def _pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` in one write and read their replies; an error reply is returned in its
        place, as `pipeline.execute(raise_on_error=False)` does. On the ScriptLink where there is
        one (see ScriptLink for why), else on a pooled redis-py connection."""
        if self._link_kwargs is None:
            return await self._pooled_pipeline(commands)
        link = self._link
        if link is None or link.closed:
            async with self._link_lock:
                link = self._link
                if link is None or link.closed:
                    link = self._link = await ScriptLink.open(self._link_kwargs)
        return await link.send(commands)

    async def _pooled_pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """`_pipeline` on one pooled redis-py connection. redis-py's Pipeline object cost about
        80 us of CPU more per round trip here (its retry wrapper, observability hooks and
        per-command bookkeeping), on every admission and settlement."""
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(conn.pack_commands(commands))
            results: list[Any] = []
            for _ in commands:
                try:
                    results.append(await conn.read_response())
                except ResponseError as exc:
                    results.append(exc)
            return results
        except BaseException:
            # Failed or cancelled part-way: replies may still be on their way, so this connection
            # must not serve another caller.
            await conn.disconnect(nowait=True)
            raise
        finally:
            await pool.release(conn)

    async def budget_unseeded(self, key: str) -> list[str]:
        ids = await self._redis.hkeys(self._k(key) + ":unseeded")
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    async def budget_seed(
        self, key: str, spent_pico_usd: int, unseeded: Sequence[str] = (), in_ledger: Sequence[str] = ()
    ) -> bool:
        keys = [self._k(key), self._k(key) + ":unseeded", self._k(key) + ":counted"]
        args: list[int | str] = [
            spent_pico_usd,
            BUDGET_KEY_TTL_MS,
            LATE_SETTLE_MS,
            len(unseeded),
            *unseeded,
            *in_ledger,
        ]
        return int(await self._call(self._seed, keys, args)) == 1

    async def budget_usage(self, key: str) -> tuple[int, int]:
        spent, reserved = await self._redis.hmget(self._k(key), "spent", "reserved")
        return int(spent or 0), int(reserved or 0)

    async def publish_revocation(self, key_hash: str) -> None:
        await self._redis.publish(self._k("revocations"), key_hash)

    async def subscribe_revocations(self, callback: RevocationCallback) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._k("revocations"))
        except BaseException:  # failed or timed out (a hanging Redis): not a connection left open
            with contextlib.suppress(Exception):
                await pubsub.aclose()
            raise
        self._listeners.append(asyncio.create_task(self._listen(pubsub, callback)))

    async def _listen(self, pubsub: aioredis.client.PubSub, callback: RevocationCallback) -> None:
        # Runs for the life of the process; a dropped connection is retried, and the authenticator's
        # cache TTL bounds how stale a key can be while the link is down.
        failing = False  # the subscription was lost and is not back yet
        while True:
            stop_if_cancelled()  # a cancel that library code swallowed last round
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
                # Once per outage, not on every retry: a warning with its traceback every second per
                # replica for as long as Redis was away buried the one that said it went.
                if not failing:
                    log.warning(
                        "revocation subscription lost; resubscribing until Redis answers", exc_info=True
                    )
                    failing = True
                await asyncio.sleep(RESUBSCRIBE_S)
                try:
                    await pubsub.subscribe(self._k("revocations"))
                except Exception:
                    continue
                if failing:
                    log.warning("revocation subscription restored")
                    failing = False

    async def kv_get(self, key: str) -> bytes | None:
        # The client never sets decode_responses, so replies are bytes; the stubs cannot know that.
        return cast("bytes | None", await self._redis.get(self._k(key)))

    async def kv_set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        await self._redis.set(self._k(key), value, px=int(ttl_s * 1000) if ttl_s else None)

    async def kv_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return cast("list[bytes | None]", await self._redis.mget([self._k(key) for key in keys]))

    async def kv_set_many(self, items: Mapping[str, bytes], ttl_s: float | None = None) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key, value in items.items():
                pipe.set(self._k(key), value, px=int(ttl_s * 1000) if ttl_s else None)
            await pipe.execute()

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, ttl_s: float | None = None
    ) -> bool:
        args = ["1" if expected is None else "0", expected or b"", value, int(ttl_s * 1000) if ttl_s else ""]
        return int(await self._cas(keys=[self._k(key)], args=args)) == 1

    async def kv_set_if_absent(self, key: str, value: bytes, ttl_s: float) -> tuple[bool, float]:
        ttl_ms = max(1, int(ttl_s * 1000))
        set_, left_ms = await self._set_if_absent(keys=[self._k(key)], args=[value, ttl_ms])
        return int(set_) == 1, math.inf if int(left_ms) < 0 else int(left_ms) / 1000

    async def announce_replica(self, replica: str, ttl_s: float) -> int:
        ttl_ms = max(1, int(ttl_s * 1000))
        return int(await self._announce(keys=[self._k("replicas")], args=[replica, ttl_ms]))

    async def replica_left(self, replica: str) -> None:
        await self._redis.zrem(self._k("replicas"), replica)

    async def drop_idle_connections(self) -> None:
        await self._redis.connection_pool.disconnect(inuse_connections=False)

    async def close(self) -> None:
        for task in self._listeners:
            task.cancel()
        for task in self._listeners:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._listeners.clear()
        if self._link is not None:
            self._link.close()
        await self._redis.aclose()
