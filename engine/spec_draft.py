"""A draft model inside the engine: its own paged KV cache and batched drafting across requests.

Used by `--speculative draft:<model>`, `self:int4` and `self:layers=N`. The draft never touches the
target's cache or blocks: it has its own block pool, and per request the token ids whose K/V it holds.
Each step, for all requests that speculate:

1. one forward catches every request up (its whole prompt the first time; afterwards the tokens
   accepted since its last draft, usually 1..k+1) and drafts the first token from its last row;
2. k - 1 batched single-token forwards draft the rest.

All of it computes at most `max_num_batched_tokens` tokens (the target's step budget): a catch-up
that does not fit (a new request's long prompt) is computed in chunks over several steps, drafting
only once it is complete, so a long prompt never makes one step as slow as an unchunked prefill.

The K/V of drafted tokens stays in the draft's cache; the next step keeps the part the target accepted
(the longest prefix that matches the request's tokens) and overwrites the rest, so no rollback is needed.
If the pool runs short, the caches of requests not drafting this step are dropped (least recently
used first); a request that still does not fit simply does not speculate this step. A request's cache
is also dropped (`forget`) when it ends or the scheduler preempts it.

The pool is a `BlockManager` of its own, so the draft has a prefix cache too: full blocks of a request's
real tokens are registered under the same chained hashes as the target's, and a request drafting for
the first time adopts the longest cached prefix of its tokens (a system prompt that earlier drafting
requests shared) instead of computing it again. The target's cached blocks cannot serve the draft (they
hold the target's K/V, in the target's pool), and the two pools are not in lockstep (a block the
target computed was drafted only if its request drafted), so the draft's cache hits where the draft
itself has computed the prefix before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from engine.kv_cache import BlockManager
from engine.model import AttentionMetadata, PrefillChunk, attention_metadata
from engine.sampling import SamplingRow, apply_filters, apply_penalties, top_token
from engine.sequence import Sequence as EngineSequence

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.speculative import Proposal, SequenceLike

__all__ = ["DraftModelProposer"]


@dataclass
class _DraftState:
    # the request's tokens (its lists, shared) with the draft's own `block_table` and, as
    # `num_computed_tokens`, how many of its real tokens the draft holds the K/V of (a prefix)
    seq: EngineSequence
    drafts: list[int] = field(default_factory=list)  # drafted tokens after those, K/V also held


@dataclass
class _Feed:
    """One request's tokens in a draft forward: `token_ids` at positions start.. of `block_table`."""

    token_ids: list[int]
    start: int
    block_table: list[int]


class DraftModelProposer:
    """Drafts k tokens per request with `model` (an engine `Transformer`, or anything with its
    `forward`/`logits`/`allocate_kv_cache`), batched over the requests of a step."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.model = model
        # the draft's tokens per step (None: unbounded), as the target's `max_num_batched_tokens`
        self.max_num_batched_tokens = max_num_batched_tokens or 1 << 62
        self.block_size = block_size
        self.device = device
        self.max_positions = cast("ModelConfig", model.config).max_position_embeddings
        model.allocate_kv_cache(num_blocks, block_size, dtype, device)  # type: ignore[operator]
        self.num_blocks = num_blocks
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self._states: OrderedDict[str, _DraftState] = OrderedDict()  # least recently drafted first

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (cached-but-free prefix blocks included, as the target's count them)."""
        return self.blocks.num_free_blocks

    def forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.blocks.free_sequence(state.seq)

    def _reserve(self, state: _DraftState, positions: int, keep: set[str], cached: list[int]) -> bool:
        """Grow the request's block table to hold `positions` tokens (first adopting `cached`, the
        longest cached prefix of its tokens, when it holds none yet), evicting idle requests' caches."""
        mirror = state.seq
        new = positions - mirror.num_computed_tokens - len(cached) * self.block_size
        while not self.blocks.can_allocate(mirror, new, cached):
            victim = next((r for r in self._states if r not in keep), None)
            if victim is None:
                return False
            self.forget(victim)
        self.blocks.allocate(mirror, new, cached)
        return True

    @torch.inference_mode()
    def propose_batch(
        self, requests: Sequence[tuple[SequenceLike, int]], generator: torch.Generator | None
    ) -> dict[str, Proposal]:
        """Draft `k` tokens for each `(seq, k)`. Greedy requests get the draft's argmax (no probs);
        sampling ones draw from the draft's distribution after the request's own penalties,
        temperature and filters, and get those rows back as `Proposal.probs` for rejection sampling.

        The draft computes at most `max_num_batched_tokens` tokens per call (catch-ups plus the k - 1
        drafting forwards), as the target does per step: the usual short catch-ups go first, and a
        request whose catch-up (a new request's whole prompt) does not fit the room left computes a
        chunk of it and drafts nothing this step (fewer than k drafts where only the last ones do
        not fit)."""
        from engine.speculative import Proposal

        keep = {seq.request_id for seq, _ in requests}
        pending: list[tuple[SequenceLike, int, _DraftState]] = []
        for seq, k in requests:
            n = seq.num_tokens
            if k <= 0 or n + k - 1 > self.max_positions:
                continue
            state = self._states.pop(seq.request_id, None) or _DraftState(self._mirror(seq))
            self._states[seq.request_id] = state  # most recently used last
            mirror = state.seq
            valid = mirror.num_computed_tokens
            if valid > n:  # cannot happen with append-only sequences; start over to be safe
                self.blocks.free_sequence(mirror)
                valid = 0
            else:
                for d, t in zip(state.drafts, seq.token_ids(valid, n), strict=False):
                    if d != t:
                        break
                    valid += 1
            valid = min(valid, n - 1)  # the last token is always fed: its row drafts the first token
            mirror.num_computed_tokens, state.drafts = valid, []
            pending.append((seq, k, state))
        # shortest catch-up first (stable): a long one must not keep the usual 1..k+1 from drafting
        pending.sort(key=lambda p: p[0].num_tokens - p[2].seq.num_computed_tokens)

        budget = self.max_num_batched_tokens
        active: list[tuple[SequenceLike, int, _DraftState]] = []
        feeds: list[_Feed] = []
        chunks: list[tuple[_DraftState, _Feed]] = []  # partial catch-ups: no drafting this step
        for seq, k, state in pending:
            if budget <= 0:
                break
            n, mirror = seq.num_tokens, state.seq
            cached = self.blocks.find_cached_prefix(mirror) if not mirror.block_table else []
            start = mirror.num_computed_tokens + len(cached) * self.block_size
            need = n - start  # >= 1: a cached prefix never covers the last token
            if need <= budget:
                k = min(k, budget - need + 1)
                end, positions = n, n + k - 1
            else:
                k, end = 0, start + budget  # < n
                positions = end
            if not self._reserve(state, positions, keep, cached):
                continue
            feed = _Feed(seq.token_ids(start, end), start, mirror.block_table)
            budget -= end - start + max(k - 1, 0)
            if k:
                active.append((seq, k, state))
                feeds.append(feed)
            else:
                chunks.append((state, feed))
        if not active and not chunks:
            return {}

        drafted: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        live = list(range(len(active)))  # requests still drafting
        while live or chunks:
            logits = self._forward([feeds[i] for i in live] + [f for _, f in chunks])
            for state, f in chunks:  # only in the first forward
                state.seq.num_computed_tokens = f.start + len(f.token_ids)
                self.blocks.cache_full_blocks(state.seq)
            chunks = []
            if not live:
                break
            self._draw(
                logits[: len(live)],
                [active[i] for i in live],
                [drafted[i] for i in live],
                probs,
                live,
                generator,
            )
            for i in live:
                seq, _, state = active[i]
                if feeds[i].start + len(feeds[i].token_ids) == seq.num_tokens:
                    state.seq.num_computed_tokens = seq.num_tokens  # the catch-up forward
                    self.blocks.cache_full_blocks(state.seq)
                else:
                    state.drafts.append(feeds[i].token_ids[0])
            live = [i for i in live if len(drafted[i]) < active[i][1]]
            for i in live:
                seq, _, state = active[i]
                feeds[i] = _Feed(
                    [drafted[i][-1]], seq.num_tokens + len(drafted[i]) - 1, state.seq.block_table
                )

        out: dict[str, Proposal] = {}
        for (seq, _, _), tokens, rows in zip(active, drafted, probs, strict=True):
            out[seq.request_id] = Proposal(tokens, torch.stack(rows) if rows else None)
        return out

    @staticmethod
    def _mirror(seq: SequenceLike) -> EngineSequence:
        """A request's tokens for the draft's block manager: the request's own token lists (they only
        grow), with a block table and computed count of the draft's."""
        return EngineSequence(
            seq.request_id, seq.prompt_token_ids, seq.params, output_token_ids=seq.output_token_ids
        )

    def _draw(
        self,
        logits: torch.Tensor,
        active: list[tuple[SequenceLike, int, _DraftState]],
        drafted: list[list[int]],
        probs: list[list[torch.Tensor]],
        live: list[int],
        generator: torch.Generator | None,
    ) -> None:
        rows = [
            SamplingRow(seq.params, seq.generator, seq.prompt_token_ids, [*seq.output_token_ids, *d])
            for (seq, _, _), d in zip(active, drafted, strict=True)
        ]
        logits = apply_penalties(logits, rows)
        greedy = top_token(logits).tolist()
        for j, ((seq, _, _), row) in enumerate(zip(active, rows, strict=True)):
            if seq.params.greedy:
                drafted[j].append(greedy[j])
                continue
            q = apply_filters(logits[j : j + 1], [row]).softmax(-1)[0]
            # never from a seeded request's own generator: its draws are the target's, one per emitted
            # token (speculative.verify_seeded), or its text would change with what was drafted
            drafted[j].append(int(torch.multinomial(q, 1, generator=generator)))
            probs[live[j]].append(q)

    def _forward(self, feeds: list[_Feed]) -> torch.Tensor:
        """Logits [len(feeds), vocab] at the last token of each feed, in `feeds` order. Single-token
        feeds run as batched decodes (the model wants them first), longer ones as prefill chunks."""
        bs = self.block_size
        dev = self.device
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i].token_ids) > 1)
        num_decodes = sum(1 for f in feeds if len(f.token_ids) == 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row = [0] * len(feeds)
        chunks: list[PrefillChunk] = []
        for i in order:
            f = feeds[i]
            n = len(f.token_ids)
            if n > 1:
                chunks.append(
                    PrefillChunk(
                        start=len(ids),
                        length=n,
                        context_len=f.start + n,
                        block_table=torch.tensor(f.block_table, dtype=torch.int32, device=dev),
                    )
                )
            ids.extend(f.token_ids)
            pos = range(f.start, f.start + n)
            positions.extend(pos)
            slots.extend(f.block_table[p // bs] * bs + p % bs for p in pos)
            last_row[i] = len(ids) - 1
        block_tables = context_lens = None
        max_len = 0
        if num_decodes:
            decodes = [feeds[i] for i in order[:num_decodes]]
            width = max(len(f.block_table) for f in decodes)
            block_tables = torch.tensor(
                [f.block_table + [-1] * (width - len(f.block_table)) for f in decodes],
                dtype=torch.int32,
                device=dev,
            )
            lens = [f.start + 1 for f in decodes]
            context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            max_len = max(lens)
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=num_decodes,
            block_tables=block_tables,
            context_lens=context_lens,
            max_context_len=max_len,
            prefills=chunks,
            block_size=bs,
        )
        with attention_metadata(meta):
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev))
        return self.model.logits(hidden[torch.tensor(last_row, device=hidden.device)])  # type: ignore[operator]
