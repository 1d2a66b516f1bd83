"""The model runner: turns a scheduled batch into flat tensors, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.fused_step import FUSED_MAX_BATCH, FusedDecoder, build_fused_decoder
from engine.model import AttentionMetadata, PrefillChunk, Transformer, attention_metadata
from engine.sampling import SamplingRow, sample, top_logprobs
from engine.scheduler import ScheduledBatch


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first; empty if logprobs == 0


@dataclass
class SeqResult:
    token_id: int | None  # None: a prefill chunk that did not reach the end of the sequence
    logprob: TokenLogprob | None
    prompt_logprobs: list[TokenLogprob]  # for prompt tokens predicted in this chunk
    spec_logits: torch.Tensor | None = None  # [k+1, vocab] for a request verifying k draft tokens


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.model.allocate_kv_cache(num_blocks, block_size, dtype, device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # decode steps of a few sequences as one native call (engine/fused_step.py): "auto", "on" or
        # "off", built by `use_fused_decode`, rebuilt when the weights change (`model.weights_changed`)
        self.fused_mode = "off"
        self.fused_max_batch = FUSED_MAX_BATCH
        self.fused: FusedDecoder | None = None
        self._fused_version = -1
        self._max_len = 0

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Flat inputs with decodes first. Returns (input_ids, metadata, order, start offset per order entry)."""
        bs = self.block_size
        decodes = [i for i, n in enumerate(batch.num_tokens) if n == 1]
        prefills = [i for i, n in enumerate(batch.num_tokens) if n > 1]
        order = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        for i in order:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            c = seq.num_computed_tokens
            starts.append(len(ids))
            ids.extend(seq.token_ids(c, c + n))
            positions.extend(range(c, c + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
        dev = self.device
        block_tables = context_lens = None
        max_len = 0
        if decodes:
            width = max(len(batch.seqs[i].block_table) for i in decodes)
            rows = [
                batch.seqs[i].block_table + [-1] * (width - len(batch.seqs[i].block_table)) for i in decodes
            ]
            block_tables = torch.tensor(rows, dtype=torch.int32, device=dev)
            lens = [batch.seqs[i].num_computed_tokens + 1 for i in decodes]
            context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            max_len = max(lens)
        chunks = []
        for j, i in enumerate(prefills, start=len(decodes)):
            seq, n = batch.seqs[i], batch.num_tokens[i]
            chunks.append(
                PrefillChunk(
                    start=starts[j],
                    length=n,
                    context_len=seq.num_computed_tokens + n,
                    block_table=torch.tensor(seq.block_table, dtype=torch.int32, device=dev),
                )
            )
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(decodes),
            block_tables=block_tables,
            context_lens=context_lens,
            max_context_len=max_len,
            prefills=chunks,
            block_size=bs,
        )
        return torch.tensor(ids, dtype=torch.long, device=dev), meta, order, starts

    def use_fused_decode(self, mode: str, max_len: int) -> None:
        """Serve decode steps of a few sequences, up to `max_len` positions, with the fused CPU step."""
        self.fused_mode, self._max_len, self._fused_version = mode, max_len, -1
        self._fused_decoder()

    def _fused_decoder(self) -> FusedDecoder | None:
        version = getattr(self.model, "weights_version", 0)
        if self._fused_version != version:
            self.fused = None  # the old copies go before the new ones are made
            self.fused = build_fused_decoder(self.model, self.fused_mode, self._max_len)
            self._fused_version = version
        return self.fused

    def _fused_step(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Logits [batch, vocab] from the fused step when every sequence of `batch` decodes one token and
        samples it (no prompt log-probs left to read, no draft tokens to verify); else None."""
        if self.fused_mode == "off" or not 1 <= len(batch.seqs) <= self.fused_max_batch:
            return None
        tokens, positions = [], []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            c = seq.num_computed_tokens
            if n != 1 or c + 1 != seq.num_tokens:
                return None
            if seq.params.prompt_logprobs is not None and c < seq.num_prompt_tokens:
                return None
            tokens.append(seq.token_ids(c, c + 1)[0])
            positions.append(c)
        fused = self._fused_decoder()
        if fused is None:
            return None
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs])
        return fused(tokens, positions, tables)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SeqResult]:
        """Run one step. Results are in `batch.seqs` order. Does not mutate the sequences."""
        fused_logits = self._fused_step(batch)
        if fused_logits is None:
            input_ids, meta, order, starts = self._prepare(batch)
            with attention_metadata(meta):
                hidden = self.model(input_ids)
        else:
            order = starts = list(range(len(batch.seqs)))

        # rows of `hidden` that need logits: the last token of every sequence that samples, and every
        # token of chunks whose request asked for prompt log-probs
        sample_rows: list[int] = []  # index into `order`
        logit_rows: list[int] = []
        plp_rows: dict[int, tuple[int, int]] = {}  # order index -> (first row in logit_rows, count)
        spec_rows: dict[int, tuple[int, int]] = {}  # same, for verifying speculative tokens
        for j, i in enumerate(order):
            seq, n = batch.seqs[i], batch.num_tokens[i]
            if seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                # positions c..c+n-1 predict tokens c+1..c+n; keep those inside the prompt
                count = min(n, seq.num_prompt_tokens - 1 - seq.num_computed_tokens)
                if count > 0:
                    plp_rows[j] = (len(logit_rows), count)
                    logit_rows.extend(range(starts[j], starts[j] + count))
            if seq.num_computed_tokens + n == seq.num_tokens:
                sample_rows.append(j)
            elif (kd := len(seq.draft_token_ids)) and seq.num_computed_tokens + n == seq.num_tokens + kd:
                spec_rows[j] = (len(logit_rows), kd + 1)
                logit_rows.extend(range(starts[j] + n - kd - 1, starts[j] + n))
        sample_at = len(logit_rows)
        logit_rows.extend(starts[j] + batch.num_tokens[order[j]] - 1 for j in sample_rows)
        results = [SeqResult(None, None, []) for _ in batch.seqs]
        if not logit_rows:
            return results
        if fused_logits is not None:  # _fused_step takes only steps whose logits rows are 0..B-1
            logits = fused_logits
        else:
            logits = self.model.logits(hidden[torch.tensor(logit_rows, device=hidden.device)])
        for j, (first, count) in spec_rows.items():
            results[order[j]].spec_logits = logits[first : first + count]

        if sample_rows:
            rows = []
            for j in sample_rows:
                seq = batch.seqs[order[j]]
                allowed = seq.grammar.allowed() if seq.grammar is not None else None
                if seq.min_tokens_banned and seq.num_output_tokens < seq.params.min_tokens:
                    kept = (
                        torch.ones(logits.shape[1], dtype=torch.bool) if allowed is None else allowed.clone()
                    )
                    kept[seq.min_tokens_banned] = False
                    # a complete JSON answer's grammar allows EOS alone: it ends there, min_tokens or
                    # not (masking every token would draw one the grammar then refuses)
                    if bool(kept.any()):
                        allowed = kept
                rows.append(
                    SamplingRow(
                        seq.params, seq.generator, seq.prompt_token_ids, seq.output_token_ids, allowed
                    )
                )
            sample_logits = logits[sample_at:]
            tokens = sample(sample_logits, rows, self.generator)
            want = [j for j, r in zip(sample_rows, rows, strict=True) if r.params.logprobs is not None]
            if want:
                k = max(batch.seqs[order[j]].params.logprobs or 0 for j in want)
                pos = [sample_rows.index(j) for j in want]
                lps = sample_logits[pos].log_softmax(-1)
                chosen, tops = top_logprobs(lps, torch.tensor([tokens[p] for p in pos], device=lps.device), k)
                for j, p, lp, top in zip(want, pos, chosen, tops, strict=True):
                    kk = batch.seqs[order[j]].params.logprobs or 0
                    results[order[j]].logprob = TokenLogprob(tokens[p], lp, top[:kk])
            for j, tok in zip(sample_rows, tokens, strict=True):
                results[order[j]].token_id = tok

        for j, (first, count) in plp_rows.items():
            seq = batch.seqs[order[j]]
            c = seq.num_computed_tokens
            targets = torch.tensor(seq.prompt_token_ids[c + 1 : c + 1 + count], device=logits.device)
            lps = logits[first : first + count].log_softmax(-1)
            chosen, tops = top_logprobs(lps, targets, seq.params.prompt_logprobs or 0)
            results[order[j]].prompt_logprobs = [
                TokenLogprob(t, lp, top) for t, lp, top in zip(targets.tolist(), chosen, tops, strict=True)
            ]
        return results
