"""prefix_affinity's memory of where prefixes went (routing.prefixes): keys at fixed cut points, an
LRU in the process, written through to the shared state while it is reachable."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Mapping

from gateway.state import MemoryState
from routing.prefixes import BLOCK, PREFIX, PrefixIndex, cuts, prefix_keys


class Shared(MemoryState):
    """A shared state that counts its writes and can be marked unreachable, as `DegradableState` is
    during a Redis outage."""

    degraded = False

    def __init__(self) -> None:
        super().__init__()
        self.written: list[str] = []

    async def kv_set_many(self, items: Mapping[str, bytes], ttl_s: float | None = None) -> None:
        self.written += items
        await super().kv_set_many(items, ttl_s)


def test_cut_points_are_dense_then_a_quarter_apart() -> None:
    assert cuts(BLOCK) == [] and cuts(BLOCK + 1) == [BLOCK]
    assert cuts(4097) == list(range(256, 4097, 256))
    far = cuts(100_000)
    assert len(far) == 30 and far[-1] < 100_000
    steps = [b / a for a, b in itertools.pairwise(far[15:])]
    assert all(1.15 < s < 1.35 for s in steps), steps
    assert all(c % BLOCK == 0 for c in far)


def test_prefix_keys_hash_each_prefix_in_one_pass() -> None:
    text = "é" * 300 + "document " * 100
    ends = [10, 256, 512, len(text)]
    keys = prefix_keys("r", text, ends)
    for end, key in zip(ends, keys, strict=True):
        alone = hashlib.sha256(b"weir-affinity\0r\0" + text[:end].encode()).digest()[:16]
        assert key == alone
    assert prefix_keys("s", text, ends)[0] != keys[0]  # routes do not share their memory


async def test_the_longest_remembered_prefix_wins_and_the_process_keeps_the_most_recent() -> None:
    memory = PrefixIndex(capacity=3)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    memory.remember([a, b], "r1")
    memory.remember([c], "r2")
    assert await memory.longest([a, b, d]) == (1, "r1")
    # Looking up uses nothing (a preview, a request the gateway may still refuse): c stays the oldest
    # until a request that found it is sent.
    assert await memory.longest([c]) == (0, "r2")
    assert await memory.longest([a, d]) == (0, "r1")
    memory.touch(b)
    memory.touch(a)  # found by requests that were sent: a and b are now the most recent
    memory.remember([d], "r3")  # evicts c, the least recently used
    assert await memory.longest([c]) is None and await memory.longest([c, d]) == (1, "r3")
    assert await memory.longest([a, b]) == (1, "r1")


async def test_another_replica_finds_it_in_the_shared_state_while_reachable() -> None:
    shared = Shared()
    here, there = PrefixIndex(), PrefixIndex()
    here.shared = there.shared = shared
    keys = prefix_keys("r", "x" * 600, [256, 512, 600])
    here.remember(keys[:2], "replica-2")
    await asyncio.gather(*here._writes)
    assert await there.longest(keys) == (1, "replica-2")
    there.remember(keys, "replica-3")  # the longer prompt went elsewhere: the longest prefix says so
    await asyncio.gather(*there._writes)
    assert await here.longest(keys) == (2, "replica-3")

    shared.degraded = True  # an outage: the fallback store would keep every key until it ends
    later = prefix_keys("r", "another chat", [12])
    here.remember(later, "replica-1")
    assert not here._writes and await shared.kv_get(PREFIX + later[0].hex()) is None
    assert await here.longest(later) == (0, "replica-1") and await there.longest(later) is None
    shared.degraded = False  # back: the prefix it could not write is written with the next request
    here.remember(later, "replica-1")
    await asyncio.gather(*here._writes)
    assert await there.longest(later) == (0, "replica-1")


async def test_a_hot_prefix_is_written_once_per_half_ttl_not_once_a_request() -> None:
    shared = Shared()
    memory = PrefixIndex(ttl_s=0.2)
    memory.shared = shared
    document = prefix_keys("r", "d" * 1000, [256, 512, 768])
    for question in range(5):
        memory.remember([*document, bytes([question]) * 16], "replica-1")
        await asyncio.gather(*memory._writes)
    assert len(shared.written) == 3 + 5  # the document's three prefixes once, each question once
    memory.remember(document, "replica-2")  # moved: written again at once
    await asyncio.gather(*memory._writes)
    assert len(shared.written) == 11
    await asyncio.sleep(0.11)  # half the TTL: refreshed before Redis would expire it
    memory.remember(document, "replica-2")
    await asyncio.gather(*memory._writes)
    assert len(shared.written) == 14
