"""The durable usage queue between the request path and the ledger.

`put` is called on the request path and never waits on the network or the DB. The batch writer
`read`s events, writes them, then `ack`s them; anything not acked is read again (after a crash too),
and the ledger's event-id key makes the repeat harmless.

- `SpoolQueue`: an append-only local file (segments of JSON lines) plus a cursor; no Redis needed.
- `RedisStreamQueue`: a Redis stream read by a consumer group, shared by every replica's writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.accounting.events import Unreadable, UsageEvent, decode_or_unreadable, encode
from gateway.aio import detached, stop_if_cancelled
from gateway.state.base import Outage
from gateway.state.redis import client_from_url

log = logging.getLogger(__name__)

Token = Any  # where an event sits in its queue, handed back to `ack`
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)

# KEYS[1]: the usage stream; ARGV: the group, the consumer. Deletes the consumer if it has no pending
# entries (deleting it would drop them from the group: no other writer could claim them); in one
# script, so no read can hand it an entry between the check and the delete. 1: deleted.
FORGET_IDLE_CONSUMER = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""

# KEYS[1]: the usage stream, KEYS[2]: a hash of consumer -> when its writer last ran this (ms, Redis
# time); ARGV: the group, idle ms, the caller's own consumer. Marks the caller's writer alive, then
# deletes every consumer that has no pending entries, has not been handed an entry for over `idle ms`
# and whose writer has not run this for as long: those of replicas that crashed (their entries
# claimed by others) or were killed before `close`. Live writers run this every `idle ms` / 10, so
# theirs are never deleted: Redis before 7.2 does not count a read that found nothing as activity, so
# a quiet stream's live consumers look as idle as dead ones. The check and the delete are one script,
# so no read can hand a consumer an entry in between (deleting one with entries would drop them from
# the group: no other writer could claim them). Returns the number deleted.
FORGET_DEAD_CONSUMERS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local idle_ms = tonumber(ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], now)
redis.call('PEXPIRE', KEYS[2], idle_ms)
local alive = {}
local flat = redis.call('HGETALL', KEYS[2])
for j = 1, #flat, 2 do
  if now - tonumber(flat[j + 1]) > idle_ms then
    redis.call('HDEL', KEYS[2], flat[j])
  else
    alive[flat[j]] = true
  end
end
local removed = 0
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for j = 1, #consumer, 2 do info[consumer[j]] = consumer[j + 1] end
  if not alive[info['name']] and info['pending'] == 0 and info['idle'] > idle_ms then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    removed = removed + 1
  end
end
return removed
"""

# A consumer with nothing pending whose writer has not been heard of for this many claim intervals
# is a dead replica's; live writers say they are alive 10 times as often.
FORGET_AFTER_CLAIMS = 10


class UsageQueue(Protocol):
    def put(self, event: UsageEvent) -> None:
        """Append one event; never blocks on the network or the DB."""
        ...

    async def read(self, max_events: int, block_s: float) -> list[tuple[Token, UsageEvent | Unreadable]]:
        """Up to `max_events` unacknowledged events, each with its token; a line that is no event
        comes as `Unreadable` in its place (the writer sets it aside before acknowledging it)."""
        ...

    @property
    def drained(self) -> bool:
        """The last `read` took everything there was (so the writer may wait for more)."""
        ...

    async def ack(self, tokens: list[Token]) -> None: ...

    @property
    def reachable(self) -> bool:
        """Whether the queue's store answers, as far as it knows: a shutdown does not wait on one that
        does not (a local spool always does)."""
        ...

    async def close(self) -> None: ...


class SpoolQueue:
    """JSON lines in numbered segment files under `directory`, read back from a saved cursor.

    One process owns a spool directory (an exclusive lock says so); run one spool per replica.
    """

    SEGMENT_BYTES = 16 * 1024 * 1024
    reachable = True  # a local file

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self._dir / ".lock", "w")  # noqa: SIM115 - held for the queue's lifetime
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"usage spool {self._dir} is in use by another process") from None
        segments = self._segments()
        self._cursor = self._load_cursor(segments)
        self._write_segment = segments[-1] if segments else 1
        self._fd = os.open(self._path(self._write_segment), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size
        # Lines not yet in the file. A write the disk cannot take (ENOSPC) stays here, whole or in
        # part, and is retried: the file only ever grows by the exact bytes of the lines in order,
        # so a full disk delays events but never tears or drops one. A segment a crash left with a
        # torn last line gets its line break first: appended to, the torn start and the next event
        # would read as one line that is no event, and that whole event would be set aside with it.
        self._pending = bytearray(b"\n" if self._ends_torn() else b"")
        self._write = os.write  # the write seam (tests play a full disk here)
        self._disk_full = False
        self._flush_scheduled = False
        self._data = asyncio.Event()
        self.drained = True

    def _ends_torn(self) -> bool:
        """Whether the segment written to ends inside a line (a crash mid-write)."""
        if self._size == 0:
            return False
        with open(self._path(self._write_segment), "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"

    @classmethod
    def claim(cls, directory: str | os.PathLike[str], slots: int = 64) -> SpoolQueue:
        """The first free slot `directory/<n>`: one spool per worker process, and a restarted worker
        takes over (and drains) the slot a previous one left."""
        for slot in range(slots):
            try:
                return cls(Path(directory) / str(slot))
            except RuntimeError:
                continue
        raise RuntimeError(f"all {slots} usage spool slots under {directory} are in use")

    @property
    def directory(self) -> Path:
        return self._dir

    def _path(self, segment: int) -> Path:
        return self._dir / f"{segment:010d}.jsonl"

    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self._dir.glob("*.jsonl"))

    def _load_cursor(self, segments: list[int]) -> tuple[int, int]:
        try:
            segment, offset = (self._dir / "cursor").read_text().split()
            return int(segment), int(offset)
        except FileNotFoundError:
            return (segments[0] if segments else 1), 0

    def put(self, event: UsageEvent) -> None:
        self.put_line(encode(event))

    def put_line(self, line: bytes) -> None:
        """Append one encoded event (`events.encode`)."""
        # Whole lines, handed to the OS at the end of this event-loop turn (one write for every event
        # produced in it): a crashed gateway loses nothing it had answered a turn earlier, and a torn
        # last line (power loss mid-write) is skipped when read back.
        self._pending += line + b"\n"
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self._flush)
            except RuntimeError:  # no event loop (tools, tests): flush now
                self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._fd < 0:
            return
        while self._pending:
            try:
                written = self._write(self._fd, self._pending)
            except OSError as exc:
                if not self._disk_full:
                    log.warning(
                        "usage spool write failed (%s); %d bytes kept in memory, retrying",
                        exc,
                        len(self._pending),
                    )
                    self._disk_full = True
                self._retry_later()
                break
            del self._pending[:written]
            self._size += written
        else:
            if self._disk_full:
                log.warning("usage spool writable again")
                self._disk_full = False
            if self._size >= self.SEGMENT_BYTES:
                os.close(self._fd)
                self._write_segment += 1
                path = self._path(self._write_segment)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._size = 0
        self._data.set()

    def _retry_later(self) -> None:
        if self._flush_scheduled:
            return
        with contextlib.suppress(RuntimeError):  # no event loop: the next put or read retries
            asyncio.get_running_loop().call_later(0.5, self._flush)
            self._flush_scheduled = True

    async def read(self, max_events: int, block_s: float) -> list[tuple[Token, UsageEvent | Unreadable]]:
        self._flush()
        items = self._read_now(max_events)
        if not items and block_s > 0:
            self._data.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._data.wait(), block_s)
            items = self._read_now(max_events)
        self.drained = len(items) < max_events
        return items

    def _read_now(self, max_events: int) -> list[tuple[Token, UsageEvent | Unreadable]]:
        # A line that is no event comes as `Unreadable`, for the writer to set aside: skipped here, it
        # was acknowledged with the lines after it and lost.
        return [(token, decode_or_unreadable(line)) for token, line in self._lines(max_events)]

    def read_lines(self, max_events: int) -> list[tuple[Token, bytes]]:
        """Up to `max_events` unacknowledged lines, undecoded and unchecked (for forwarding them)."""
        self._flush()
        return self._lines(max_events)

    @property
    def unwritten(self) -> bool:
        """Lines still in memory because the disk refused them."""
        return bool(self._pending)

    def _lines(self, max_events: int) -> list[tuple[Token, bytes]]:
        items: list[tuple[Token, bytes]] = []
        segment, offset = self._cursor
        while len(items) < max_events and segment <= self._write_segment:
            path = self._path(segment)
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(offset)
                    for line in f:
                        if not line.endswith(b"\n"):
                            break  # still being written
                        offset += len(line)
                        items.append(((segment, offset), line[:-1]))
                        if len(items) >= max_events:
                            return items
            if segment == self._write_segment:
                break
            segment, offset = segment + 1, 0
        return items

    async def ack(self, tokens: list[Token]) -> None:
        if not tokens:
            return
        segment, offset = max(tokens)
        tmp = self._dir / "cursor.tmp"
        tmp.write_text(f"{segment} {offset}")
        os.replace(tmp, self._dir / "cursor")
        self._cursor = (segment, offset)
        for old in self._segments():
            if old < segment:
                self._path(old).unlink(missing_ok=True)

    def pending(self) -> int:
        """How many whole lines wait past the cursor. Counted as line breaks, a megabyte at a time:
        it decoded every line, and held every one in memory at once, just to count them."""
        self._flush()
        count = 0
        first, offset = self._cursor
        for segment in range(first, self._write_segment + 1):
            with contextlib.suppress(FileNotFoundError), open(self._path(segment), "rb") as f:
                f.seek(offset)
                while chunk := f.read(1 << 20):
                    count += chunk.count(b"\n")
            offset = 0
        return count

    async def close(self) -> None:
        self._flush()
        if self._pending:
            log.error("usage spool closed with %d bytes it could not write", len(self._pending))
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._lock.close()


class RedisStreamQueue:
    """Events in a Redis stream; every replica's writer reads it through one consumer group.

    With a `spool`, events that cannot reach Redis are not left in memory: they go to the local
    append-only spool (durable) and are forwarded to the stream, oldest first, once Redis answers
    again; new events follow them into the spool until it is empty. A line forwarded twice (a crash
    between the XADD and the spool's ack) is harmless: the ledger takes each event id once.
    """

    GROUP = "writers"
    EVENTS_PER_ENTRY = 200
    FULL_BUFFER = 256  # events that end a flush window early

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "weir:",
        flush_interval_s: float = 0.02,
        claim_idle_s: float = 30.0,
        spool: SpoolQueue | None = None,
        timeout_s: float = 2.0,
        retry_s: float = 0.5,
        forget_idle_s: float | None = None,
    ) -> None:
        self._redis = client
        self._claim_idle_ms = int(claim_idle_s * 1000)
        # Consumers of dead replicas are deleted once they are this idle with nothing pending, by
        # whichever live writer looks first (each looks, and says it is alive, 10 times as often;
        # by default once per claim interval; see `_forget_dead`).
        self._forget_idle_s = FORGET_AFTER_CLAIMS * claim_idle_s if forget_idle_s is None else forget_idle_s
        self._forgot_at = -math.inf  # loop time of the last look
        self._stream = f"{prefix}usage"
        self._consumer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._buffer: list[bytes] = []
        self._flush_interval = flush_interval_s
        self._timeout = timeout_s
        self._retry_s = retry_s
        self._group_ready = False
        self.drained = True
        self._pump: asyncio.Task[None] | None = None
        # The pump flushes when kicked: at the end of a flush window (a timer armed by the first event
        # put into an empty window), when the buffer is full, or to retry after a failure.
        self._kick = asyncio.Event()
        self._window: asyncio.TimerHandle | None = None
        self._flush_lock = asyncio.Lock()
        self.spool = spool
        # Lines a previous process spooled and never forwarded are sent first.
        self.spooling = spool is not None and bool(spool.read_lines(1))
        self._failing = False  # the pump's, for its log (once per outage)
        # Redis did not answer this queue's last call (an XADD, a read, an acknowledgement) and has
        # answered none since: a shutdown does not ask it again (each wait on a hanging Redis cost
        # `timeout_s`). The shared state (`outage`, set by the control plane) adds what its own
        # calls found, and hears what these found.
        self._unanswered = False
        self.outage: Outage | None = None
        # This consumer's entries from `_reread` on (a stream id) are read again before anything
        # else: a read that failed may have had them delivered (see `read_lines`).
        self._reread: str | None = None
        # Entries taken by a shared-state pipeline (take_entry) not yet settled, by id: what `close`
        # spools if their pipeline has not answered by then.
        self._riding: dict[int, bytes] = {}
        # True while a shared-state pipeline that will take the buffered events is under way (set by
        # the control plane to the admission's "settling"); a window then ends once more before the
        # pump sends them itself.
        self.rider_busy: Callable[[], bool] | None = None
        self._deferred = False
        # Events per stream entry in the last read: entries hold 1 (a quiet gateway) to
        # EVENTS_PER_ENTRY (a full flush, or a spool forwarded after an outage); see `_read`.
        self._per_entry = 10.0

    @classmethod
    def from_url(cls, url: str, prefix: str = "weir:", spool: SpoolQueue | None = None) -> RedisStreamQueue:
        return cls(client_from_url(url), prefix=prefix, spool=spool)

    def start(self) -> None:
        """Forward what a previous process left in the spool now: the pump starts with the first
        event otherwise, so a replica without traffic kept it from the ledger."""
        if self.spooling and (self._pump is None or self._pump.done()):
            self._kick.set()
            self._pump = detached(self._run_pump())

    def put(self, event: UsageEvent) -> None:
        # XADD happens in a background pump, batched, so the request path only appends to a list
        # (or, while Redis is away, to the spool: one file write per event-loop turn).
        if self.spooling and self.spool is not None:
            self.spool.put_line(encode(event))
        else:
            self._buffer.append(encode(event))
            if len(self._buffer) >= self.FULL_BUFFER:
                self._kick.set()
        if self._window is None:
            # The first event of a window waits at most one flush interval for its XADD.
            self._window = asyncio.get_running_loop().call_later(self._flush_interval, self._window_end)
        if self._pump is None or self._pump.done():
            self._pump = detached(self._run_pump())  # it outlives the request whose event started it

    def _window_end(self) -> None:
        self._window = None
        busy = self.rider_busy
        if self._buffer and not self.spooling and not self._deferred and busy is not None and busy():
            # Settlements are on their way to Redis (their pipeline waits for its reply or is about
            # to go): the events ride the next one instead of an XADD of their own, which costs as
            # much CPU as the settlement itself. One more window at most.
            self._deferred = True
            self._window = asyncio.get_running_loop().call_later(self._flush_interval, self._window_end)
            return
        self._deferred = False
        # Under load a shared-state pipeline usually took the window's events already (take_entry):
        # then the pump is not even woken. (It used to wake every interval, idle or not: 50 times
        # a second, each costing more CPU than the XADD it usually skipped.)
        if self._buffer or self.spooling:
            self._kick.set()

    def take_entry(self) -> tuple[str, bytes] | None:
        """The buffered events as one stream entry, for a shared-state pipeline that is about to go
        to Redis anyway (`gateway.state.redis.StreamRider`): under load most events then reach the
        stream without an XADD round trip of their own, and sooner than the flush window."""
        # Not while the pump is flushing (it removes what it sent from the front of the buffer after
        # its XADD) or spooling (the spool goes first, oldest first).
        if not self._buffer or self.spooling or self._flush_lock.locked():
            return None
        lines = self._buffer[: self.EVENTS_PER_ENTRY]
        del self._buffer[: len(lines)]
        entry = b"\n".join(lines)
        self._riding[id(entry)] = entry
        return self._stream, entry

    def entry_sent(self, entry: bytes) -> None:
        self._riding.pop(id(entry), None)

    def entry_failed(self, entry: bytes) -> None:
        """The pipeline failed or its answer is unknown: the pump sends the events again now, or
        spools them if Redis is away (a repeat is harmless: the ledger takes each event id once)."""
        if self._riding.pop(id(entry), None) is None:
            return  # `close` spooled it already
        # Appended, never put in front: a flush in progress removes its batch from the front.
        self._buffer.extend(entry.split(b"\n"))
        self._kick.set()

    async def _run_pump(self) -> None:
        while True:
            stop_if_cancelled()  # a cancel that library code swallowed last round
            await self._kick.wait()
            self._kick.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._failing:
                    where = "spooling them to disk" if self.spool is not None else "keeping them in memory"
                    log.warning("usage events cannot reach Redis (%s); %s", exc.__class__.__name__, where)
                    self._failing = True
                await asyncio.sleep(self._retry_s)
                self._kick.set()  # retry without waiting for new events
                continue
            if self._failing:
                log.warning("usage events reach Redis again")
                self._failing = False
            if (self._buffer or self.spooling) and self._window is None:
                # Lines the disk has not taken yet keep the spool from being forwarded: another window.
                loop = asyncio.get_running_loop()
                self._window = loop.call_later(self._flush_interval, self._window_end)

    async def flush(self) -> None:
        """Push spooled, then buffered events to the stream. If Redis is unreachable, what is
        buffered goes to the spool (or stays buffered without one) and the error is raised."""
        async with self._flush_lock:  # the pump and an explicit flush must not send a batch twice
            try:
                if self.outage is not None and self.outage.degraded:
                    # The shared state holds settlements Redis has not had yet, handed over before
                    # it stops being degraded: an attempt's event reaching the ledger first, a budget
                    # seeded from the ledger meanwhile counted the attempt again when they came.
                    raise RedisConnectionError("the shared state has not caught up with Redis yet")
                await self._forward_spool()
                while self._buffer:
                    batch = self._buffer[: self.EVENTS_PER_ENTRY]
                    await self._xadd(batch)
                    del self._buffer[: len(batch)]
            except Exception:
                self._spool_buffer()
                raise

    def _spool_buffer(self) -> None:
        """What is buffered, to the spool (where there is one): it is forwarded once Redis answers."""
        if self.spool is not None:
            for line in self._buffer:
                self.spool.put_line(line)
            self._buffer.clear()
            self.spooling = True

    @contextlib.asynccontextmanager
    async def _answered(self, wait_s: float) -> AsyncIterator[None]:
        """Bounds a call to Redis by `wait_s` (redis-py's own socket timeout is 5 s); one that found
        Redis away is remembered (`reachable`) and told to the shared state (`outage`), so neither
        waits for it again meanwhile."""
        try:
            async with asyncio.timeout(wait_s):
                yield
        except _UNREACHABLE as exc:
            self._unanswered = True
            if self.outage is not None:
                self.outage.lost(exc)
            raise
        self._unanswered = False

    @property
    def reachable(self) -> bool:
        """Redis answered this queue's last call, and the shared state has not found it away since."""
        return not self._unanswered and not (self.outage is not None and self.outage.degraded)

    async def _xadd(self, lines: list[bytes]) -> None:
        # One stream entry carries many events (JSON lines): far less to pack and parse than an
        # entry each, and the ledger's event ids keep redelivery harmless.
        async with self._answered(self._timeout):
            await self._redis.xadd(self._stream, {"e": b"\n".join(lines)})

    async def _forward_spool(self) -> None:
        if not self.spooling or self.spool is None:
            return
        while items := self.spool.read_lines(self.EVENTS_PER_ENTRY):
            await self._xadd([line for _, line in items])
            await self.spool.ack([token for token, _ in items])
        if not self.spool.unwritten:
            # Nothing left on disk or waiting for it, and no await since the last read: every event
            # from here on can go straight to the stream again.
            self.spooling = False

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self._redis.xgroup_create(self._stream, self.GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def read(self, max_events: int, block_s: float) -> list[tuple[Token, UsageEvent | Unreadable]]:
        # A line that is no event (a torn spool line forwarded) comes as `Unreadable`: raised here, it
        # failed the whole read, and its entry was claimed and failed again every 30 s for ever.
        return [
            (token, decode_or_unreadable(line)) for token, line in await self.read_lines(max_events, block_s)
        ]

    async def read_lines(self, max_events: int, block_s: float) -> list[tuple[Token, bytes]]:
        """As `read`, with each event as its encoded line (`events.encode`), not decoded: for a
        writer that hands the lines to the database as they are."""
        try:
            async with self._answered(block_s + self._timeout):
                try:
                    return await self._read(max_events, block_s)
                except aioredis.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    # Redis restarted without its data (no persistence): make the group again.
                    self._group_ready = False
                    return await self._read(max_events, block_s)
        except BaseException:
            # Redis may have delivered entries to this consumer whose reply never came here (a
            # timeout, a dropped connection, a cancel): the next read takes them again at once, where
            # they waited `claim_idle_s` to be claimed. Entries read twice are harmless (the ledger
            # takes each event id once), and the writer reads only once it acknowledged its last
            # batch, so this consumer's unacknowledged entries are only ever such lost ones.
            self._reread = "0"
            raise

    async def _read(self, max_events: int, block_s: float) -> list[tuple[Token, bytes]]:
        await self._ensure_group()
        await self._forget_dead()
        # First take over what a dead writer (a crashed replica) read and never acknowledged.
        # Entries hold 1 to EVENTS_PER_ENTRY events. Sized by the last read's events per entry, the
        # reads after an outage (full entries) stay near `max_events` instead of 20x it (40k events
        # in one batch, seen after a Redis outage); never more entries than max_events / 10.
        count = max(1, min(max_events // 10, round(max_events / self._per_entry)))
        entries: list[Any] = []
        if self._reread is not None:
            # This consumer's own entries a failed read may have had delivered, a page at a time.
            entries = await self._deliver(self._reread, count)
            self._reread = entries[-1][0] if len(entries) == count else None
        if not entries:
            _, claimed, *_ = await self._redis.xautoclaim(
                self._stream, self.GROUP, self._consumer, min_idle_time=self._claim_idle_ms, count=count
            )
            entries = list(claimed)
        if not entries:
            entries = await self._deliver(">", count, block_s)
        self.drained = len(entries) < count
        # Tokens are entry ids; an entry's events are acknowledged together, after all are written.
        lines = [
            (entry_id, line) for entry_id, fields in entries if fields for line in fields[b"e"].split(b"\n")
        ]
        if entries:
            self._per_entry = min(max(len(lines) / len(entries), 1.0), float(self.EVENTS_PER_ENTRY))
        return lines

    async def _forget_dead(self) -> None:
        """Delete the consumers crashed replicas left in the group (`_leave_group` runs only on a clean
        stop): each process reads as a consumer of its own, so without this one more stayed in the
        group for ever per crash or kill, their entries claimed by others but their names kept."""
        now = asyncio.get_running_loop().time()
        if now - self._forgot_at < self._forget_idle_s / FORGET_AFTER_CLAIMS:
            return
        self._forgot_at = now
        try:
            removed = await self._redis.eval(
                FORGET_DEAD_CONSUMERS,
                2,
                self._stream,
                f"{self._stream}:alive",
                self.GROUP,
                int(self._forget_idle_s * 1000),
                self._consumer,
            )
        except aioredis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                raise  # Redis lost the group: `read_lines` makes it again
            # E.g. XINFO refused by an ACL: reading matters more. Not asked again by this process.
            log.warning("cannot remove dead usage consumers (%s); they stay in the group", exc)
            self._forgot_at = math.inf
            return
        if removed:
            log.info("removed %d dead consumers from the usage stream's group", removed)

    async def _deliver(self, start: str, count: int, block_s: float = 0) -> list[Any]:
        """XREADGROUP from `start`: ">", entries no consumer was given yet (waiting up to `block_s`
        for some); a stream id, this consumer's own unacknowledged entries after it (at once)."""
        # RESP2 (the client's protocol) replies [[stream, entries], ...]; the stubs also allow
        # RESP3's dict, which this client never gets.
        response = cast(
            "list[list[Any]]",
            await self._redis.xreadgroup(
                self.GROUP,
                self._consumer,
                {self._stream: start},
                count=count,
                block=int(block_s * 1000) if block_s > 0 else None,
            ),
        )
        return response[0][1] if response else []

    async def ack(self, tokens: list[Token]) -> None:
        tokens = list(dict.fromkeys(tokens))
        if tokens:
            async with self._answered(self._timeout), self._redis.pipeline(transaction=True) as pipe:
                pipe.xack(self._stream, self.GROUP, *tokens)
                pipe.xdel(self._stream, *tokens)
                await pipe.execute()

    async def close(self) -> None:
        if self._window is not None:
            self._window.cancel()
            self._window = None
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        # Entries riding in a shared-state pipeline come back here if it fails: waited for while
        # Redis answers, then sent again (a repeat is harmless), or spooled.
        deadline = asyncio.get_running_loop().time() + self._timeout
        while self._riding and self.reachable and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for entry in self._riding.values():
            self._buffer.extend(entry.split(b"\n"))
        self._riding.clear()
        # What cannot reach Redis now waits in the spool for the next start. A Redis known to be
        # away is not asked again (a hanging one would cost `timeout_s` more to shut down).
        if self.reachable:
            with contextlib.suppress(Exception):
                await self.flush()
        else:
            self._spool_buffer()
        if self._buffer:
            log.error("usage queue closed with %d events Redis did not take", len(self._buffer))
        await self._leave_group()
        if self.spool is not None:
            await self.spool.close()
        await self._redis.aclose()

    async def _leave_group(self) -> None:
        """Take this process's consumer out of the group, unless it has entries pending (another
        writer claims them after `claim_idle_s`): each process names a new one, so every restart,
        rollout or scaled-out replica left one more in the group otherwise."""
        if not self._group_ready or not self.reachable:
            return  # never read here, or Redis is away: nothing to ask it
        with contextlib.suppress(Exception):
            async with self._answered(self._timeout):
                await self._redis.eval(FORGET_IDLE_CONSUMER, 1, self._stream, self.GROUP, self._consumer)
