"""prefix_affinity's conversation memory (routing.conversations): an LRU in the process, written
through to the shared state while it is reachable."""

from __future__ import annotations

import asyncio

from gateway.state import MemoryState
from routing.conversations import Conversations, prompt_key


class Degradable(MemoryState):
    """A shared state that can be marked unreachable, as `DegradableState` is during a Redis outage."""

    degraded = False


async def test_the_process_keeps_the_most_recent_prompts() -> None:
    memory = Conversations(capacity=2)
    keys = [prompt_key("r", f"prompt {i}") for i in range(3)]
    memory.remember(keys[0], "a")
    memory.remember(keys[1], "b")
    assert await memory.find(keys[0]) == "a"  # now the most recent of the two
    memory.remember(keys[2], "c")
    assert [await memory.find(k) for k in keys] == ["a", None, "c"]
    assert prompt_key("r", "x") != prompt_key("s", "x")  # routes do not share their memory


async def test_another_replica_finds_it_in_the_shared_state_while_reachable() -> None:
    shared = Degradable()
    here, there = Conversations(), Conversations()
    here.shared = there.shared = shared
    key = prompt_key("r", "turn one")
    here.remember(key, "replica-2")
    await asyncio.gather(*here._writes)
    assert await there.find(key) == "replica-2"

    shared.degraded = True  # an outage: the fallback store would keep every key until it ends
    later = prompt_key("r", "turn one of another chat")
    here.remember(later, "replica-1")
    assert not here._writes and await shared.kv_get("affinity:" + later.hex()) is None
    assert await here.find(later) == "replica-1" and await there.find(key) is None
