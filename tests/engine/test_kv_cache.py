"""Block accounting: reference counts, the hash-chained prefix cache and its LRU eviction."""

from __future__ import annotations

import pytest

import engine.kv_cache as kv_cache
from engine.kv_cache import BlockManager
from engine.sampling import SamplingParams
from engine.sequence import Sequence


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def admit(bm: BlockManager, s: Sequence) -> int:
    """Admit with any prefix hit, compute the whole prompt, register full blocks; returns hit tokens."""
    cached = bm.find_cached_prefix(s)
    assert bm.can_allocate(s, s.num_tokens - len(cached) * bm.block_size, cached)
    bm.allocate(s, s.num_tokens - len(cached) * bm.block_size, cached)
    hit = len(cached) * bm.block_size
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return hit


def test_allocation_grows_by_whole_blocks_and_frees_everything() -> None:
    bm = BlockManager(8, 4)
    s = seq("a", list(range(10)))
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    bm.allocate(s, 2)  # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    bm.allocate(s, 3)
    assert len(s.block_table) == 4
    bm.free_sequence(s)
    assert bm.num_free_blocks == 8 and s.block_table == [] and set(bm.ref_counts) == {0}


def test_shared_prefix_blocks_are_reference_counted() -> None:
    bm = BlockManager(16, 4)
    a, b = seq("a", list(range(11))), seq("b", [*range(8), 99, 98])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 8  # two full blocks shared
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[i] for i in a.block_table[:2]] == [2, 2]
    bm.free_sequence(a)
    assert [bm.ref_counts[i] for i in b.block_table[:2]] == [1, 1]
    bm.free_sequence(b)
    assert bm.num_free_blocks == 16


def test_the_last_prompt_token_is_never_served_from_cache() -> None:
    bm = BlockManager(16, 4)
    admit(bm, seq("a", list(range(8))))
    again = seq("b", list(range(8)))
    assert len(bm.find_cached_prefix(again)) == 1  # 2 full blocks cached, only 1 usable: logits needed


def test_a_hit_requires_the_whole_prefix_chain() -> None:
    bm = BlockManager(16, 4)
    admit(bm, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block, different first block: no hit at all
    assert bm.find_cached_prefix(seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_freed_blocks_stay_cached_until_evicted_least_recent_first() -> None:
    bm = BlockManager(4, 2)
    a = seq("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free_sequence(a)
    assert bm.num_free_blocks == 4
    b = seq("b", [1, 2, 3, 4, 6])
    assert admit(bm, b) == 4  # revived from the free list
    bm.free_sequence(b)
    c = seq("c", [9, 9, 9])  # needs 2 blocks: takes uncached/tail blocks first
    admit(bm, c)
    assert len(bm.find_cached_prefix(seq("d", [1, 2, 3, 4, 7]))) >= 1  # the head block survived
    bm.free_sequence(c)
    big = seq("e", list(range(100, 108)))  # needs every block: all cached contents evicted
    admit(bm, big)
    assert bm.find_cached_prefix(seq("f", [1, 2, 3, 4, 7])) == []
    bm.free_sequence(big)
    assert bm.num_free_blocks == 4


def test_can_allocate_counts_revived_cached_blocks() -> None:
    bm = BlockManager(3, 2)
    a = seq("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free_sequence(a)
    b = seq("b", [1, 2, 3, 4, 5, 6])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    assert bm.can_allocate(b, 2, cached)  # 2 revived + 1 new = 3 blocks
    assert not bm.can_allocate(b, 3, cached)


def test_a_collision_of_pythons_hash_never_serves_another_prefixs_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python's `hash` is 64-bit and invertible on tuples of ints: a crafted prompt can collide with
    another tenant's cached prefix (vLLM's CVE-2025-25183). Here a weak `hash` (order-blind in a block)
    collides [2, 1] with [1, 2]: the block after them must still not be shared."""
    real_hash = hash
    monkeypatch.setattr(kv_cache, "hash", lambda key: real_hash((key[0], sum(key[1]))), raising=False)
    bm = BlockManager(16, 2)
    admit(bm, seq("c", [2, 1, 7, 7, 9]))  # caches [2, 1]
    admit(bm, seq("a", [1, 2, 5, 5, 9]))  # [5, 5] computed after [1, 2]
    cached = bm.find_cached_prefix(seq("b", [2, 1, 5, 5, 9]))
    assert len(cached) == 1  # [2, 1] is shared; [5, 5] after [2, 1] was never computed


def test_a_block_computed_twice_is_not_kept_as_a_cache_entry_nobody_can_find() -> None:
    """Two requests that computed the same block (identical greedy choices, a prompt whose cached copy
    was evicted mid-flight) leave one findable copy; the other is an ordinary free block, reused before
    any cached one rather than holding a most-recently-used slot that pushes the findable copy out."""
    bm = BlockManager(6, 4)
    prompt = list(range(1, 10))  # two full blocks and one partial
    first = seq("first", prompt)
    admit(bm, first)
    twin = seq("twin", prompt)  # computed alongside, not read from the cache
    bm.allocate(twin, twin.num_tokens)
    twin.num_computed_tokens = twin.num_tokens
    bm.cache_full_blocks(twin)
    bm.free_sequence(first)
    bm.free_sequence(twin)
    admit(bm, seq("other", list(range(100, 116))))  # four blocks: must evict two cached-looking ones
    assert len(bm.find_cached_prefix(seq("again", prompt))) == 2
