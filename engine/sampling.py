"""Sampling parameters and the batched sampler: penalties, temperature, top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class JsonFormat:
    """Structured output (engine/grammar.py): `schema` a JSON Schema as JSON text, or None for any JSON
    object (OpenAI's `json_object`); `prefix` and `suffix` the exact text around it (a forced tool
    call's `<tool_call>` tags); `param` the API parameter the schema came from, which a schema the
    grammar cannot use is refused naming (not part of the grammar: equal formats share it)."""

    schema: str | None = None
    prefix: str = ""
    suffix: str = ""
    param: str = field(default="response_format", compare=False)


GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS


class InvalidSamplingParam(ValueError):
    """A sampling parameter out of range; `param` is its name (the API's name for it too)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: EOS and stop tokens are banned, stop strings ignored, until this many
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 => off
    min_p: float = 0.0
    seed: int | None = None  # reproducible per request, independent of batch-mates
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; 0: chosen token only; k: chosen + top-k
    prompt_logprobs: int | None = None  # same, for prompt tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI)
    json_format: JsonFormat | None = None  # only text the JSON grammar accepts

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidSamplingParam` (a ValueError) naming the parameter, with a message fit for an
        API client."""
        checks = [
            ("max_tokens", self.max_tokens >= 1, "max_tokens must be at least 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            ("temperature", self.temperature >= 0, "temperature must be non-negative"),
            # greedy sampling never reads top_p, so it takes 0 too (vLLM resets it for greedy requests;
            # `temperature: 0, top_p: 0` is a common way to ask for determinism)
            ("top_p", 0 < self.top_p <= 1 or (self.greedy and self.top_p == 0), "top_p must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "top_k must be non-negative (0 disables it)"),
            ("min_p", 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "repetition_penalty must be positive"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "logprobs must be non-negative"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs must be non-negative",
            ),
            (
                "logit_bias",
                all(-100 <= b <= 100 for b in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidSamplingParam(param, message)
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                if not 0 <= tid < vocab_size:
                    raise InvalidSamplingParam(
                        "stop_token_ids", f"stop token id {tid} is outside the vocabulary"
                    )
            for tid in self.logit_bias:
                if not 0 <= tid < vocab_size:
                    raise InvalidSamplingParam(
                        "logit_bias", f"logit_bias names token id {tid}, outside the vocabulary"
                    )
            for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
                if k is not None and k > vocab_size:
                    raise InvalidSamplingParam(name, f"{name} must be at most the vocabulary size")

    @property
    def greedy(self) -> bool:
        """Temperatures below `GREEDY_BELOW` are greedy, as in vLLM: dividing the logits by a temperature
        near float32's smallest (1e-40) overflows them to inf, and softmax then gives NaN."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Whether `apply_penalties` changes this request's logits (penalties or a logit bias)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


@dataclass
class SamplingRow:
    """One row of logits to sample from, with what the sampler needs to know about its request."""

    params: SamplingParams
    generator: torch.Generator | None  # set for seeded requests
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    allowed: torch.Tensor | None = None  # bool [vocab]: the only tokens a grammar accepts next


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (HF/CTRL style, over prompt and output), presence/frequency (OpenAI, output only), then
    the logit bias. Every path that picks tokens (sampling, speculative verification, drafting) calls
    this first, so all of them see the same adjusted logits."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in idx:  # rows with penalties are few; per-row bincounts keep this simple
        p = rows[i].params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(rows[i].prompt_token_ids) | set(rows[i].output_token_ids)),
                dtype=torch.long,
                device=logits.device,
            )
            if len(seen):
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and rows[i].output_token_ids:
            counts = torch.bincount(
                torch.tensor(rows[i].output_token_ids, device=logits.device), minlength=vocab
            )[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=logits.device)
    return logits


def apply_filters(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf outside). Rows are non-greedy."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=dev).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # keep a token while the mass before it is below top_p (so the top token always survives)
        before = probs.cumsum(-1) - probs
        drop |= before >= torch.tensor(top_p, dtype=probs.dtype, device=dev).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(m > 0 for m in min_p):
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * torch.tensor(
            min_p, dtype=probs.dtype, device=dev
        ).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def top_token(scores: torch.Tensor) -> torch.Tensor:
    """The index of the largest score along the last dimension, the first of ties (as `argmax` on the
    CPU, 2.5x faster there). Every greedy choice (plain decoding, speculative verification, drafting)
    and every Gumbel draw goes through here, so that speculation picks what plain decoding picks even on
    exact ties, where `argmax` and `max` need not agree on CUDA."""
    return scores.max(-1).indices


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None
) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32). Seeded rows draw only from their own generator,
    so their choices do not depend on which other requests share the batch."""
    logits = apply_penalties(logits, rows)
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    if constrained:
        logits = logits.clone()  # the caller reads log-probs from its own, unmasked logits
        for i in constrained:
            allowed = rows[i].allowed.to(logits.device, non_blocking=True)  # type: ignore[union-attr]
            logits[i].masked_fill_(~allowed, float("-inf"))
    out = top_token(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sub = apply_filters(logits[random_rows], [rows[i] for i in random_rows])
        probs = sub.softmax(-1)
        # Gumbel-style trick (argmax of p / Exp(1)) samples exactly from p; it needs one noise draw per row
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(random_rows) if rows[i].generator is None]
        if unseeded:
            fresh = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            noise[unseeded] = fresh.exponential_(generator=generator)
        for j, i in enumerate(random_rows):
            if (g := rows[i].generator) is not None:
                noise[j].exponential_(generator=g)
        out[random_rows] = top_token(probs / noise)
    return out.tolist()


def top_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probabilities of `chosen` [N] in `logprobs` [N, vocab] and the top-k (id, logprob) per row."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    if k <= 0:
        return chosen_lp, [[] for _ in chosen_lp]
    vals, ids = logprobs.topk(k, dim=-1)
    tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return chosen_lp, tops
