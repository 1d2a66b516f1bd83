"""Which replica each recent prompt of a `prefix_affinity` route went to.

A conversation's next request starts with its previous prompt (the history, then the reply and a new
user turn), so looking that prompt up sends every turn to the replica that holds the conversation's
KV cache, however little of it fits in the route's `prefix_chars`. Kept in this process (an LRU)
and, with Redis, in the shared state for `ttl_s`, so a turn that reaches another gateway replica
finds it too.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict

from gateway.state import SharedState

PREFIX = "affinity:"


def prompt_key(route: str, text: str) -> bytes:
    return hashlib.blake2b(
        text.encode(), digest_size=16, person=b"weir-affinity", key=route.encode()[:64]
    ).digest()


class Conversations:
    # Ten minutes in Redis: an idle conversation's KV blocks are likely evicted by then on a busy
    # replica, and one key per request stays affordable (600k keys at 1,000 requests/s).
    def __init__(self, capacity: int = 65536, ttl_s: float = 600.0) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        self.recent: OrderedDict[bytes, str] = OrderedDict()
        self.shared: SharedState | None = None
        self._writes: set[asyncio.Task[None]] = set()

    def _reachable(self) -> SharedState | None:
        # While Redis is unreachable the state falls back to a per-process store that never purges:
        # one key per request would grow it for the length of the outage. The LRU covers that time.
        shared = self.shared
        return None if shared is None or getattr(shared, "degraded", False) else shared

    async def find(self, key: bytes) -> str | None:
        """The model (replica) the prompt with this key went to, if it was routed recently."""
        model = self.recent.get(key)
        if model is not None:
            self.recent.move_to_end(key)
            return model
        shared = self._reachable()
        if shared is not None:
            value = await shared.kv_get(PREFIX + key.hex())
            if value is not None:
                return value.decode()
        return None

    def remember(self, key: bytes, model: str) -> None:
        self.recent[key] = model
        self.recent.move_to_end(key)
        if len(self.recent) > self.capacity:
            self.recent.popitem(last=False)
        shared = self._reachable()
        if shared is not None:  # off the request's path: the answer need not wait for it
            task = asyncio.get_running_loop().create_task(
                shared.kv_set(PREFIX + key.hex(), model.encode(), self.ttl_s)
            )
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
