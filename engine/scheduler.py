"""The scheduler: one token budget per step, shared by decodes and chunked prefills (as vLLM v1).

Each step hands out `{sequence: number of tokens to compute}`. Running sequences go first (decodes
take one token, unfinished prefills continue in chunks), then waiting ones are admitted while the
budget, the sequence limit and free KV blocks allow. Running sequences are served least recently
served first, in admission order among equals: while the budget covers them all that is plain
admission order, and when it does not (a budget below the number of running requests, or a prefill
chunk that takes most of it) the ones left out this step go first the next, so every running request
gains a token at least every ceil(running / budget) steps instead of waiting for the first ones to
finish. When a running sequence cannot grow, the most recently admitted one not yet served this step
is preempted: its blocks are freed (and `on_preempt` called) and it goes back to the front of the queue to be recomputed later
(its finished blocks usually come back from the prefix cache).

A waiting sequence whose next uncached prompt block is being computed right now by a running prefill (a
burst of requests with one system prompt, the n choices of one request) waits until that prefill has
put it in the prefix cache, and then reads it from there instead of computing it again. Sequences
behind it in the queue are not held up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens to compute per sequence this step

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls: the clock of Sequence.last_scheduled
        self.prefix_cache_queries = 0  # tokens
        self.prefix_cache_hits = 0  # tokens
        # called with each sequence preempted (the engine frees its speculative draft's cache)
        self.on_preempt: Callable[[Sequence], None] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free_sequence(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.draft_token_ids.clear()
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs = []
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(seq)

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        seq.last_scheduled = self.num_steps

    def _victim(self) -> Sequence:
        """The most recently admitted running sequence not yet in this step's batch (one already in it
        has had its blocks allocated and its tokens counted)."""
        return next(s for s in reversed(self.running) if s.last_scheduled != self.num_steps)

    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        # least recently served first (sorted() is stable: admission order among equals)
        order = sorted(self.running, key=lambda s: s.last_scheduled)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            real = seq.num_tokens - seq.num_computed_tokens
            # speculation is optional: drafts get only the budget the running sequences after this one
            # leave for their next token (else a few drafting requests starve the rest of the batch)
            later = len(self.running) - len(batch) - 1  # running, not yet served, not this one
            del seq.draft_token_ids[max(0, budget - real - later) :]
            n = min(real + len(seq.draft_token_ids), budget)
            if seq.draft_token_ids and not self.kv.can_allocate(seq, n):
                seq.draft_token_ids.clear()  # nor preempt for it
                n = min(real, budget)
            while not self.kv.can_allocate(seq, n):
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.kv.allocate(seq, n)
            self._add(batch, seq, n)
            budget -= n
        # admit waiting sequences (not in a step that had to preempt: memory is tight)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq) if seq.params.prompt_logprobs is None else []
            if self._prefix_in_flight(seq, len(cached)):
                deferred.append(self.waiting.popleft())
                continue
            remaining = seq.num_tokens - len(cached) * self.kv.block_size
            n = min(remaining, budget)
            if not self.kv.can_allocate(seq, n, cached):
                break  # max_model_len never exceeds the cache, so it fits once others finish
            self.waiting.popleft()
            if seq.num_cached_tokens is None:  # first admission: report prefix-cache use
                seq.num_cached_tokens = len(cached) * self.kv.block_size
                self.prefix_cache_queries += seq.num_prompt_tokens
                self.prefix_cache_hits += seq.num_cached_tokens
            self.kv.allocate(seq, n, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # back at the front, in their order
        return batch

    def _prefix_in_flight(self, seq: Sequence, cached_blocks: int) -> bool:
        """Whether a running prefill is computing the next block of `seq`'s prompt past what the prefix
        cache holds now (so `seq` should wait for it rather than compute it again)."""
        if not self.kv.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return False
        bs = self.kv.block_size
        if (seq.num_prompt_tokens - 1) // bs <= cached_blocks:  # nothing more it could read from cache
            return False
        end = (cached_blocks + 1) * bs
        prefix = seq.prompt_token_ids[:end]
        return any(
            other.num_computed_tokens < end <= other.num_prompt_tokens
            and other.prompt_token_ids[:end] == prefix
            for other in self.running
        )
