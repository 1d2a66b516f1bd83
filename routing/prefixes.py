"""Which replica recent prompts of a `prefix_affinity` route went to, remembered by their prefixes.

An engine replica's prefix cache holds the prompts it served, so the replica that served the longest
prefix of a new prompt is the one whose cache can serve most of it. Every routed prompt is remembered
by a hash of each of its prefixes that ends at a cut point (every `BLOCK` characters up to `DENSE`,
then each a quarter past the one before, so a 100,000-character prompt has 30) and of the whole
prompt; a later request looks up its own prefixes at the same cuts, and at its history's end, and
takes the longest one remembered. A conversation's next turn starts with its previous prompt, so it
finds that prompt whole; questions about one document find the document's cuts, however short the
document is against the route's `prefix_chars`.

Kept in this process (an LRU of prefixes) and, with Redis, in the shared state for `ttl_s`, so a
request that reaches another gateway replica finds where the others sent its prefix.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Container, Sequence

from gateway.state import SharedState

PREFIX = "affinity:"
BLOCK = 256  # characters: about 64 tokens, a few of an engine's KV blocks
DENSE = 4096
_CUTS = list(range(BLOCK, DENSE + 1, BLOCK))
while _CUTS[-1] < 1 << 28:
    _CUTS.append(round(_CUTS[-1] * 1.25 / BLOCK) * BLOCK)


def cuts(length: int) -> list[int]:
    """The cut points of a prompt of `length` characters (not counting its end)."""
    return _CUTS[: bisect.bisect_left(_CUTS, length)]


def prefix_keys(route: str, text: str, ends: Sequence[int]) -> list[bytes]:
    """The key of `text[:end]` for each of `ends` (ascending), hashed in one pass over the text; the
    route is hashed first, so routes do not share their memory. SHA-256: x86 and Arm cores hash it in
    hardware, 2.7x faster than BLAKE2b here (68 against 183 us for 100,000 characters)."""
    digest = hashlib.sha256(b"weir-affinity\0" + route.encode() + b"\0")
    keys: list[bytes] = []
    start = 0
    for end in ends:
        digest.update(text[start:end].encode())
        keys.append(digest.copy().digest()[:16])
        start = end
    return keys


class PrefixIndex:
    # Ten minutes in Redis: an idle prefix's KV blocks are likely evicted by then on a busy replica.
    # A prefix costs an entry once however many requests share it; 131,072 entries are about 25 MB.
    def __init__(self, capacity: int = 131072, ttl_s: float = 600.0) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        # key -> (replica, when this process last wrote it to the shared state)
        self.recent: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self.shared: SharedState | None = None
        self._writes: set[asyncio.Task[None]] = set()

    def _reachable(self) -> SharedState | None:
        # While Redis is unreachable the state falls back to a per-process store: keys for every
        # request would fill it (until each TTL and its next sweep) and no other replica reads them
        # there. The LRU covers that time.
        shared = self.shared
        return None if shared is None or getattr(shared, "degraded", False) else shared

    async def longest(
        self, keys: Sequence[bytes], replicas: Container[str] | None = None
    ) -> tuple[int, str] | None:
        """The index in `keys` (prefixes, shortest first) of the longest one routed recently, and the
        replica it went to; the request that uses it `touch`es it once sent. `replicas`: only a prefix
        sent to one of these counts (a route's replicas now: one removed since serves nothing, while
        a shorter prefix on one still there is that much of the prompt in its cache). The shared
        state is asked only for prefixes longer than this process's."""
        found: tuple[int, str] | None = None
        for i in range(len(keys) - 1, -1, -1):
            entry = self.recent.get(keys[i])
            if entry is not None and (replicas is None or entry[0] in replicas):
                found = (i, entry[0])
                break
        start = found[0] + 1 if found else 0
        shared = self._reachable()
        if shared is not None and start < len(keys):
            values = await shared.kv_get_many([PREFIX + key.hex() for key in keys[start:]])
            for i in range(len(values) - 1, -1, -1):
                value = values[i]
                if value is not None and (replicas is None or value.decode() in replicas):
                    return start + i, value.decode()
        return found

    def touch(self, key: bytes) -> None:
        """A request that found `key` (`longest`) was sent: the prefix is the last to leave the LRU."""
        if key in self.recent:
            self.recent.move_to_end(key)

    def remember(self, keys: Sequence[bytes], replica: str) -> None:
        """The request with these prefixes went to `replica`: its cache now holds them all. Written
        through to the shared state (off the request's path) unless this process wrote the same
        there within half the TTL, so a hot prefix costs Redis a write every five minutes, not one a
        request."""
        now = time.monotonic()
        shared = self._reachable()
        stale: dict[str, bytes] = {}
        for key in keys:
            entry = self.recent.get(key)
            if shared is not None and (
                entry is None or entry[0] != replica or now - entry[1] >= self.ttl_s / 2
            ):
                stale[PREFIX + key.hex()] = replica.encode()
                entry = (replica, now)
            elif entry is None or entry[0] != replica:
                entry = (replica, -math.inf)  # never written: due once the state is reachable
            self.recent[key] = entry
            self.recent.move_to_end(key)
        while len(self.recent) > self.capacity:
            self.recent.popitem(last=False)
        if shared is not None and stale:
            task = asyncio.get_running_loop().create_task(shared.kv_set_many(stale, self.ttl_s))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
