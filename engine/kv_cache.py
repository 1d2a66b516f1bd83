"""Paged KV-cache block accounting: fixed-size blocks, reference counts, a hash-chained prefix cache.

Only bookkeeping lives here; the tensors themselves are allocated by the runner with layout
`[num_blocks, block_size, num_kv_heads, head_dim]` per layer.

A full block is identified by a SHA-256 digest of (the previous block's digest, its token ids), so a hit
on block i implies the whole prefix up to i matches. The digest is cryptographic because a collision
serves one prompt another prefix's K/V: Python's 64-bit `hash` is invertible on tuples of ints, so a
crafted prompt could read another tenant's cached prefix (vLLM's CVE-2025-25183). Free blocks keep their contents and hash until
they are reused: the free list is also the LRU list of the prefix cache (evict from the front).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """The digest naming a full block: its parent's digest (None for the first block) and its tokens."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # per sequence: how many of its blocks are registered in the prefix cache, and the last hash
        self._num_hashed: dict[str, int] = {}
        self._last_hash: dict[str, bytes | None] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq` (full blocks only, and never the whole
        prompt: the last token must be computed to get logits)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: bytes | None = None
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            h = block_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
            parent = h
        return hits

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hashes[block]
        if old is not None:  # evict its cached contents
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_hashes[block] = None
            self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block

    # --- allocation ---------------------------------------------------------------------------
    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Whether `seq` can grow to hold `num_new_tokens` more tokens (after adopting `cached_blocks`)."""
        have = len(seq.block_table) + len(cached_blocks or ())
        cached = cached_blocks or []
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)  # cached-but-free blocks leave the pool
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        need = self.blocks_needed(computed + num_new_tokens) - have
        return max(need, 0) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> None:
        """Adopt `cached_blocks` (a prefix hit; advances num_computed_tokens) and append blocks so the
        sequence can hold `num_new_tokens` more tokens. Call `can_allocate` first."""
        if cached_blocks:
            assert not seq.block_table and seq.num_computed_tokens == 0
            for b in cached_blocks:
                if self.ref_counts[b] == 0:
                    del self.free[b]
                self.ref_counts[b] += 1
            seq.block_table.extend(cached_blocks)
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
            self._num_hashed[seq.request_id] = len(cached_blocks)
            self._last_hash[seq.request_id] = self.block_hashes[cached_blocks[-1]]
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError("out of KV blocks (can_allocate was not checked)")
        for _ in range(max(need, 0)):
            seq.block_table.append(self._take_free_block())

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        done = self._num_hashed.get(seq.request_id, 0)
        parent = self._last_hash.get(seq.request_id)
        full = seq.num_computed_tokens // self.block_size
        for i in range(done, full):
            block = seq.block_table[i]
            tokens = tuple(seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            h = block_hash(parent, tokens)
            # An identical block already cached (computed alongside, e.g. n greedy choices) stays the
            # only copy: a second copy named by h but absent from hash_to_block could never be hit, yet
            # would be freed to the LRU's recent end and outlive findable blocks.
            if self.block_hashes[block] is None and h not in self.hash_to_block:
                self.block_hashes[block] = h
                self.block_tokens[block] = tokens
                self.hash_to_block[h] = block
            parent = h
        self._num_hashed[seq.request_id] = max(done, full)
        self._last_hash[seq.request_id] = parent

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past `seq.num_computed_tokens` (allocated for rejected speculative tokens)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                self.free.move_to_end(block, last=False)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop the sequence's references. Blocks reaching zero go to the free (LRU) list, tail first,
        so a prefix's later blocks are evicted before its earlier, more shared ones."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, "KV block freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # uncached blocks are reused first
                else:
                    self.free[block] = None
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        self._num_hashed.pop(seq.request_id, None)
        self._last_hash.pop(seq.request_id, None)
