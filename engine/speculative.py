"""Speculative decoding: draft proposers, the lossless verification rule, adaptive k and metrics.

A proposer guesses the next k tokens cheaply; the target model scores all of them in one forward pass
(k + 1 rows of logits: one after each draft prefix, plus the bonus position). The verification rule then
keeps a prefix of the draft and adds one token of the target's own, so every step yields 1..k+1 tokens
and the output distribution is exactly the target's:

- greedy: keep the longest prefix where the draft equals the target's argmax, then the target's argmax;
- sampling: Leviathan et al. (2023) / Chen et al. (2023) rejection sampling. Draft token x drawn from q
  is accepted with probability min(1, p(x) / q(x)); on the first rejection a token is drawn from the
  residual max(0, p - q) normalised, and if every draft survives a bonus token is drawn from the last
  row of p. A deterministic proposer (n-gram lookup) is the case q = one-hot(x);
- seeded sampling: each position's token is drawn as plain decoding draws it (one Exp(1) noise row from
  the request's own generator per emitted token), and drafts are kept while they equal those draws, so
  a seed gives the same text with speculation as without, whatever else the engine is running.

Proposers:
- `NgramProposer`: prompt lookup (Saxena 2023): find the latest earlier occurrence of the sequence's
  last n tokens and propose what followed it (continuing the copy through the match itself, so a loop
  is drafted k tokens ahead). Free, and strong on input-grounded work.
- `ModelProposer`: a small draft model sharing the tokenizer (a separate model, or a self-draft built
  by `self_draft_model`: the target int4-quantized, or its first N layers), run from scratch per call
  (tests, outside the engine). Inside the engine a draft model runs batched over the step's requests
  in its own paged KV cache: `engine.spec_draft.DraftModelProposer`.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from engine.sampling import SamplingRow, apply_filters, apply_penalties, top_token

if TYPE_CHECKING:
    from engine.model import Attention, Transformer

__all__ = [
    "AdaptiveK",
    "BucketRates",
    "ModelProposer",
    "NgramProposer",
    "SpecMetrics",
    "SpecStats",
    "SpeculativeConfig",
    "Speculator",
    "StepCost",
    "parse_speculative",
    "rejection_sample",
    "self_draft_model",
    "verify_greedy",
    "verify_seeded",
]


# --- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft" | "self"
    num_speculative_tokens: int = 4
    draft_model: str | None = None  # method "draft": a registry name or path
    self_draft: str | None = None  # method "self": "int4" or "layers=N"


def parse_speculative(spec: str, num_speculative_tokens: int = 4) -> SpeculativeConfig:
    """`ngram`, `draft:<model>`, `self:int4` or `self:layers=N` (the `--speculative` flag's syntax)."""
    if num_speculative_tokens < 1:
        raise ValueError("num_speculative_tokens must be at least 1")
    k = num_speculative_tokens
    if spec == "ngram":
        return SpeculativeConfig("ngram", k)
    method, _, arg = spec.partition(":")
    if method == "draft" and arg:
        return SpeculativeConfig("draft", k, draft_model=arg)
    if method == "self":
        if arg == "int4":
            return SpeculativeConfig("self", k, self_draft="int4")
        name, _, value = arg.partition("=")
        if name == "layers" and value.isdigit() and int(value) >= 1:
            return SpeculativeConfig("self", k, self_draft=f"layers={int(value)}")
    raise ValueError(
        f"unknown speculative method {spec!r}; use ngram, draft:<model>, self:int4 or self:layers=N"
    )


# --- proposers ------------------------------------------------------------------------------------
@dataclass
class Proposal:
    token_ids: list[int]
    # draft distribution per proposed token [k, vocab]; None for a deterministic proposer (q = one-hot)
    probs: torch.Tensor | None = None
    # n-gram lookup: how many trailing tokens matched (the draft's bucket for acceptance estimates)
    match_len: int = 0


class NgramProposer:
    """Prompt lookup: match the last n tokens (longest n first) against earlier context."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, token_ids: Sequence[int], k: int) -> Proposal:
        if k <= 0 or len(token_ids) < 2:
            return Proposal([])
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        total = len(tokens)
        last = tokens[-1]
        longest = min(self.max_n, total - 1)
        # One backward pass over the ends of candidate n-grams (each ends with the last token), found
        # by C-level `index` on the reversed context, instead of one Python scan per n: this runs on
        # every drafting step, so it must stay cheap on long contexts. Longest match wins; among equally
        # long ones the latest (found first: recent context predicts best and loops get continued).
        rev = tokens[::-1]  # rev[j] == tokens[total - 1 - j]
        best_len, best_j = 0, -1
        j = 0
        while True:
            try:
                j = rev.index(last, j + 1)
            except ValueError:
                break
            m = 1
            while m < longest and j + m < total and rev[j + m] == rev[m]:
                m += 1
            if m > best_len:
                best_len, best_j = m, j
                if m == longest:
                    break
        if best_len < self.min_n:
            return Proposal([])
        end = total - 1 - best_j  # where the matched n-gram ends in `tokens`
        follow = tokens[end + 1 : end + 1 + k]
        # The copy continues through the match, as an overlapping LZ77 copy does: in a loop ("AAAA",
        # "abcabc") the latest match is one period (best_j tokens) back, so what follows it runs into
        # the present after best_j tokens; the proposal goes on with its own tokens, one period back,
        # instead of stopping there (k tokens per step in a loop, not the period's length).
        while len(follow) < k:
            follow.append(follow[len(follow) - best_j])
        return Proposal(follow, match_len=best_len)


class ModelProposer:
    """Drafts k tokens autoregressively with a small model. `next_probs(token_ids)` returns the draft's
    next-token distribution [vocab] (already tempered/filtered as the request's sampling asks; a
    one-hot for greedy requests). Draws use `generator` so seeded requests stay reproducible."""

    def __init__(self, next_probs: Callable[[list[int]], torch.Tensor]) -> None:
        self.next_probs = next_probs

    def propose(
        self,
        token_ids: Sequence[int],
        k: int,
        *,
        greedy: bool = True,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        tokens = list(token_ids)
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            q = self.next_probs(tokens + drafted)
            tok = int(top_token(q)) if greedy else int(torch.multinomial(q, 1, generator=generator))
            drafted.append(tok)
            rows.append(q)
        return Proposal(drafted, torch.stack(rows) if rows and not greedy else None)


@torch.inference_mode()
def sequence_logits(model: nn.Module, token_ids: Sequence[int], last: int = 1) -> torch.Tensor:
    """Logits [last, vocab] of an engine `Transformer` at the last `last` positions of `token_ids`,
    computed from scratch in a private KV cache (the model's own cache is put back afterwards, so this
    is safe on a model that also serves). Quadratic per call: for drafting outside the engine, tests
    and benchmarks, not for the serving loop."""
    from engine.model import AttentionMetadata, PrefillChunk, attention_metadata

    n = len(token_ids)
    block_size = 16
    param = next(model.parameters())
    dev = param.device
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    attns = _attentions(model)
    saved = [(a.k_cache, a.v_cache) for a in attns]
    model.allocate_kv_cache(-(-n // block_size), block_size, dtype, dev)  # type: ignore[operator]
    try:
        meta = AttentionMetadata(
            positions=torch.arange(n, device=dev),
            slot_mapping=torch.arange(n, device=dev),
            num_decodes=0,
            block_tables=None,
            context_lens=None,
            max_context_len=0,
            prefills=[
                PrefillChunk(0, n, n, torch.arange(-(-n // block_size), dtype=torch.int32, device=dev))
            ],
            block_size=block_size,
        )
        with attention_metadata(meta):
            hidden = model(torch.tensor(list(token_ids), dtype=torch.long, device=dev))
        return model.logits(hidden[n - last :])  # type: ignore[operator]
    finally:
        for a, (k, v) in zip(attns, saved, strict=True):
            a.k_cache, a.v_cache = k, v


def self_draft_model(model: nn.Module, spec: str) -> nn.Module:
    """A draft built from the target itself, sharing nothing mutable with it (each has its own KV
    cache): `int4` (a quantized copy; the target must still be in floating point) or `layers=N` (its
    first N decoder layers, sharing the target's weights, with the target's final norm and head)."""
    if spec == "int4":
        from engine.quant import quantize_model

        with _kv_cache_detached(model):  # never copy the target's (large) cache
            draft = copy.deepcopy(model)
        return quantize_model(draft, "int4")
    name, _, value = spec.partition("=")
    if name == "layers" and value.isdigit():
        n = int(value)
        layers = cast("Transformer", model).layers
        if not 1 <= n <= len(layers):
            raise ValueError(f"self:layers=N needs 1 <= N <= {len(layers)}")
        draft = _shallow(model)  # shares parameters
        draft._modules["layers"] = nn.ModuleList(_own_kv_cache(layer) for layer in list(layers)[:n])
        return draft
    raise ValueError(f"unknown self-draft {spec!r}; use int4 or layers=N")


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of `module` sharing its parameters and children, whose child slots can be replaced."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def _own_kv_cache(layer: nn.Module) -> nn.Module:
    """The decoder layer with the same weights but an attention module of its own: the KV cache
    tensors are plain attributes of the attention module, so sharing it would share the cache."""
    clone = _shallow(layer)
    attn = _shallow(layer.self_attn)  # type: ignore[arg-type]
    attn.k_cache = torch.empty(0)
    attn.v_cache = torch.empty(0)
    clone._modules["self_attn"] = attn
    return clone


def _attentions(model: nn.Module) -> list[Attention]:
    """The attention modules of an engine `Transformer`'s decoder layers: they hold its KV cache."""
    return [layer.self_attn for layer in cast("Transformer", model).decoder_layers]


@contextmanager
def _kv_cache_detached(model: nn.Module) -> Iterator[None]:
    attns = _attentions(model)
    saved = [(a.k_cache, a.v_cache) for a in attns]
    for a in attns:
        a.k_cache, a.v_cache = torch.empty(0), torch.empty(0)
    try:
        yield
    finally:
        for a, (k, v) in zip(attns, saved, strict=True):
            a.k_cache, a.v_cache = k, v


# --- verification ---------------------------------------------------------------------------------
def verify_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """`target_argmax[i]`: the target's choice after the first i draft tokens (len(draft) + 1 rows).
    Returns the accepted draft prefix followed by the target's own next token."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError("target_argmax needs one row more than the draft")
    out: list[int] = []
    for d, t in zip(draft, target_argmax, strict=False):
        if d != t:
            out.append(t)
            return out
        out.append(d)
    out.append(target_argmax[len(draft)])
    return out


def verify_seeded(draft: Sequence[int], target_probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Seeded sampling: at each position the token plain decoding would draw (`sampling.sample`: the
    argmax of p / Exp(1), one noise row from `generator`), kept going while it equals the draft. Every
    emitted token costs exactly one noise row, as in plain decoding, so the tokens do not depend on
    what was drafted (rejection sampling draws a varying number of uniforms and residual samples, so a
    seeded request would give another text whenever the drafts differed). Lossless like the rule
    below: each token is an exact sample of its row; n-gram drafts are accepted as often (p(x))."""
    k = len(draft)
    if target_probs.shape[0] != k + 1:
        raise ValueError("target_probs needs one row more than the draft")
    out: list[int] = []
    for i in range(k + 1):
        noise = torch.empty_like(target_probs[i]).exponential_(generator=generator)
        token = int(top_token(target_probs[i] / noise))
        out.append(token)
        if i == k or token != draft[i]:
            break
    return out


def rejection_sample(
    draft: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Lossless speculative sampling. `target_probs` [k+1, vocab]: p after each draft prefix (row k is
    the bonus position); `draft_probs` [k, vocab]: q that drew each draft token (None: q = one-hot).
    Returns the accepted draft tokens plus one token from the residual or bonus distribution; the
    result is distributed exactly as k+1 ancestral samples from p would be (up to where it stops)."""
    k = len(draft)
    if target_probs.shape[0] != k + 1:
        raise ValueError("target_probs needs one row more than the draft")
    p = target_probs.float()
    dev = p.device
    if k:
        idx = torch.tensor(list(draft), device=dev)
        p_x = p[:k].gather(1, idx[:, None]).squeeze(1)
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        else:
            q_x = draft_probs.float().gather(1, idx[:, None]).squeeze(1)
        u = torch.rand(k, generator=generator, device=dev)
        # u < p/q, written without dividing (q_x > 0 for any token the draft actually drew)
        accepted = (u * q_x < p_x).tolist()
        for i, ok in enumerate(accepted):
            if ok:
                continue
            if draft_probs is None:
                residual = p[i].clone()
                residual[draft[i]] = 0.0
            else:
                residual = (p[i] - draft_probs[i].float()).clamp(min=0.0)
            total = residual.sum()
            if float(total) <= 0.0:  # p == q: rejection had probability 0; fall back to p
                residual, total = p[i], p[i].sum()
            tok = int(torch.multinomial(residual / total, 1, generator=generator))
            return [*draft[:i], tok]
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return [*draft, bonus]


# --- adaptive k ---------------------------------------------------------------------------------
def _geometric_counts(num_proposed: int, num_accepted: int) -> tuple[int, int]:
    """(successes, failures) of a verified draft under the per-token acceptance model: each drafted
    token is accepted with probability a until the first rejection, and tokens after a rejection are
    never looked at (they are censored, not failures)."""
    return num_accepted, int(num_accepted < num_proposed)


@dataclass
class BucketRates:
    """Engine-wide acceptance per draft context bucket (for n-gram lookup: the length of the matched
    n-gram; for a draft model: one bucket), as decayed Beta counts.

    Match length predicts acceptance far better than which request it is: measured on SmolLM2-135M's
    greedy answers (fp32, 8 chat + 4 grounded prompts, 48 tokens), drafted tokens from 1-, 2-, 3- and
    4-token matches were accepted at 0.15 / 0.50 / 0.71 / 0.87 on chat and 0.55 / 0.82 / 0.86 / 0.94 on
    the rewrite task, and 59% of chat positions had no match at all. A request's first guess is this
    bucket's rate, not one rate for all drafts (which a high-acceptance task had pushed up before)."""

    prior_rate: float = 0.7
    prior_weight: float = 2.0
    decay: float = 0.9  # per verification in the bucket: the last ~10 count, so traffic shifts show
    _counts: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [successes, failures]

    def rate(self, bucket: int) -> float:
        s, f = self._counts.get(bucket) or (
            self.prior_weight * self.prior_rate,
            self.prior_weight * (1 - self.prior_rate),
        )
        return s / (s + f)

    def update(self, bucket: int, num_proposed: int, num_accepted: int) -> None:
        if num_proposed <= 0:
            return
        c = self._counts.setdefault(
            bucket, [self.prior_weight * self.prior_rate, self.prior_weight * (1 - self.prior_rate)]
        )
        s, f = _geometric_counts(num_proposed, num_accepted)
        c[0] = self.decay * c[0] + s
        c[1] = self.decay * c[1] + f


@dataclass
class AdaptiveK:
    """Chooses how many tokens to draft for one request from its estimated per-token acceptance.

    With per-token acceptance a, drafting k yields (1 - a^(k+1)) / (1 - a) tokens per step for a cost
    of 1 + fixed_cost + cost_per_token * k plain steps when k >= 1 (`fixed_cost`: what turning a decode
    into a verification costs at all, e.g. a multi-row matmul and the chunked attention path;
    `cost_per_token`: verifying and drafting one more token); pick the k that maximises tokens per
    unit cost, so k >= 1 only when the expected tokens per second beat plain decoding.

    a is the mean of a Beta posterior per request and bucket (see `BucketRates`): the prior is the
    engine's rate for the bucket with weight `prior_weight` (2 drafted tokens' worth, so one rejected
    draft moves it a lot), the data are this request's own successes and failures in that bucket
    (`_geometric_counts`). Prior and data both decay by `decay` per verification, so a request whose
    drafts start failing forgets its earlier luck within two or three steps.

    When k = 0 wins, one token is drafted every `probe_every` steps (a probe, only when the proposer has
    a draft at all) to notice when acceptance recovers; each rejected probe doubles that interval (up to
    `max_probe_every`): a probe costs a verification step, and a request whose drafts keep failing would
    otherwise pay for one every `probe_every` steps for nothing."""

    k_max: int
    cost_per_token: float = 0.1
    fixed_cost: float = 0.0
    initial_rate: float = 0.7  # the prior when no engine rate is given (`rate_for`)
    prior_weight: float = 2.0
    decay: float = 0.6
    # engine-wide rates per bucket (`BucketRates`) already carry what other requests learned, so a
    # request probes less often than it had to with a single rate: every 16 steps, backing off to 64
    probe_every: int = 16
    max_probe_every: int = 64
    rate: float = field(init=False)  # the estimate the last `rate_for` (or the constructor) gave
    probe_interval: int = field(init=False)
    _counts: dict[int, list[float]] = field(init=False, default_factory=dict)  # bucket -> [s, f, prior w]
    _idle: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError("k_max must be at least 1")
        self.rate = self.initial_rate
        self.probe_interval = self.probe_every

    def rate_for(self, bucket: int = 0, prior_rate: float | None = None) -> float:
        """Posterior mean acceptance in `bucket`, the prior centred on `prior_rate` (the engine's rate
        for the bucket; `initial_rate` if None). Also sets `rate`, which `best_k`/`next_k` use."""
        m = self.initial_rate if prior_rate is None else prior_rate
        s, f, w = self._counts.get(bucket) or (0.0, 0.0, self.prior_weight)
        self.rate = (w * m + s) / (w + s + f)
        return self.rate

    @staticmethod
    def expected_tokens(rate: float, k: int) -> float:
        if rate >= 1.0:
            return float(k + 1)
        return (1.0 - rate ** (k + 1)) / (1.0 - rate)

    def step_cost(self, k: int) -> float:
        """A step drafting k tokens, in plain decode steps."""
        return 1.0 + self.fixed_cost + self.cost_per_token * k if k else 1.0

    def best_k(self) -> int:
        scores = [self.expected_tokens(self.rate, k) / self.step_cost(k) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=lambda k: (scores[k], -k))

    def next_k(self, bucket: int = 0, prior_rate: float | None = None, can_draft: bool = True) -> int:
        """k for this step, from the posterior in `bucket` around `prior_rate` (see `rate_for`).
        `can_draft` False: the proposer has nothing (an n-gram lookup without a match), so nothing is
        drafted, and a probe that falls due waits for a step that has a draft."""
        self._probing = False
        if not can_draft:
            self._idle = min(self._idle + 1, self.probe_interval)
            return 0
        self.rate_for(bucket, prior_rate)
        k = self.best_k()
        if k:
            self._idle = 0
            return k
        self._idle += 1
        if self._idle >= self.probe_interval:
            self._idle = 0
            self._probing = True
            return 1
        return 0

    def update(self, num_proposed: int, num_accepted: int, bucket: int = 0) -> None:
        if num_proposed <= 0:
            return
        if self._probing:
            # a rejected probe backs the probing off; an accepted one restores the base interval
            self.probe_interval = (
                min(2 * self.probe_interval, self.max_probe_every) if num_accepted == 0 else self.probe_every
            )
            self._probing = False
        s, f = _geometric_counts(num_proposed, num_accepted)
        old = self._counts.get(bucket) or (0.0, 0.0, self.prior_weight)
        d = self.decay
        self._counts[bucket] = [d * old[0] + s, d * old[1] + f, d * old[2]]


@dataclass
class StepCost:
    """What verification costs on this engine, learned from timed pure decode steps.

    A decode step's seconds, relative to a plain step of the same batch size, are modelled as
    1 + fixed * (requests verifying drafts) + per_token * (drafted tokens), fitted by least squares
    with exponential forgetting (`decay` per observation) and a weak pull (`prior_weight`) towards the
    prior. A per-token cost alone misses the fixed part: on a CPU in fp32 the first extra row switches
    the matmuls from GEMV to GEMM and the request from the decode attention kernel to the chunked one,
    so one draft costs about as much as four (measured: k = 1..3 all ~1.3-1.4x a plain step while the
    per-token fit said 1.1-1.25x), and k = 1 looked cheap when it was not.

    One step can only move the fit so far (`max_residual` plain steps per verifying request away from
    the prediction, a plain step at most 2x from its average): the engine's thread tuner now and then
    runs a step on the other thread count, which on a loaded 2-core machine took 4.8 s for a 6-row
    verification whose neighbours took 0.2 s, and one such step made every draft look 4 plain steps
    dear for the next 20-odd verifications."""

    prior_fixed: float = 0.0
    prior_per_token: float = 0.1
    prior_weight: float = 0.1
    decay: float = 0.95
    plain_ema: float = 0.2
    max_residual: float = 0.5
    plain_s: dict[int, float] = field(default_factory=dict)  # batch size -> EMA seconds of a plain step
    fixed: float = field(init=False)
    per_token: float = field(init=False)
    _sxx: list[float] = field(init=False, default_factory=lambda: [0.0, 0.0, 0.0])  # xx11, xx12, xx22
    _sxy: list[float] = field(init=False, default_factory=lambda: [0.0, 0.0])

    def __post_init__(self) -> None:
        self.fixed, self.per_token = self.prior_fixed, self.prior_per_token

    def plain_seconds(self, batch_size: int) -> float | None:
        """The plain step of this batch size, else of the nearest one measured."""
        if not self.plain_s:
            return None
        if batch_size in self.plain_s:
            return self.plain_s[batch_size]
        return self.plain_s[min(self.plain_s, key=lambda b: (abs(b - batch_size), b))]

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        old = self.plain_s.get(batch_size)
        if old is None:
            self.plain_s[batch_size] = seconds
            return
        seconds = min(max(seconds, 0.5 * old), 2.0 * old)
        self.plain_s[batch_size] = (1 - self.plain_ema) * old + self.plain_ema * seconds

    def observe(self, batch_size: int, num_verifying: int, num_drafts: int, seconds: float) -> None:
        """A step where `num_verifying` of `batch_size` decoding requests verified `num_drafts` drafts."""
        base = self.plain_seconds(batch_size)
        if base is None or base <= 0 or num_verifying <= 0:
            return
        x1, x2 = float(num_verifying), float(num_drafts)
        predicted = self.fixed * x1 + self.per_token * x2
        bound = self.max_residual * x1
        y = predicted + min(max(seconds / base - 1.0 - predicted, -bound), bound)
        d = self.decay
        sxx, sxy = self._sxx, self._sxy
        sxx[0], sxx[1], sxx[2] = d * sxx[0] + x1 * x1, d * sxx[1] + x1 * x2, d * sxx[2] + x2 * x2
        sxy[0], sxy[1] = d * sxy[0] + x1 * y, d * sxy[1] + x2 * y
        self._fit()

    def _fit(self) -> None:
        lam = self.prior_weight
        a, b, c = self._sxx[0] + lam, self._sxx[1], self._sxx[2] + lam
        r1 = self._sxy[0] + lam * self.prior_fixed
        r2 = self._sxy[1] + lam * self.prior_per_token
        det = a * c - b * b  # > 0: the prior makes the system positive definite
        fixed, per_token = (c * r1 - b * r2) / det, (a * r2 - b * r1) / det
        # costs are never negative; with one pinned at 0 the other is refitted alone
        if per_token < 0:
            fixed, per_token = max(r1 / a, 0.0), 0.0
        elif fixed < 0:
            fixed, per_token = 0.0, max(r2 / c, 0.0)
        self.fixed, self.per_token = fixed, per_token


# --- metrics --------------------------------------------------------------------------------------
RATE_WINDOW_S = 10.0


@dataclass
class SpecMetrics:
    """Counters for one engine: acceptance per draft position, tokens per verification step, and the
    tokens that verification steps emitted over the last `RATE_WINDOW_S` seconds (speculative tokens/s)."""

    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    num_steps: int = 0  # verification steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + the target's own token per step, up to an ending token
    # (time, tokens) of the rate window and their sum; only the engine thread touches them (a scrape
    # reads the `SpecStats` copy that `EngineStats` carries)
    _recent: deque[tuple[float, int]] = field(default_factory=deque, repr=False)
    _recent_sum: int = field(default=0, repr=False)

    def record(
        self, num_proposed: int, num_accepted: int, num_emitted: int | None = None, now: float | None = None
    ) -> None:
        if num_proposed <= 0:
            return
        grow = num_proposed - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(num_proposed):
            self.proposed_by_position[i] += 1
            if i < num_accepted:
                self.accepted_by_position[i] += 1
        emitted = num_emitted if num_emitted is not None else num_accepted + 1
        self.num_steps += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += emitted
        now = time.perf_counter() if now is None else now
        self._recent.append((now, emitted))
        self._recent_sum += emitted
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent_sum -= self._recent.popleft()[1]

    def tokens_per_second(self, now: float | None = None) -> float:
        """Tokens emitted by verification steps per second over the last `RATE_WINDOW_S` seconds."""
        self._expire(time.perf_counter() if now is None else now)
        return self._recent_sum / RATE_WINDOW_S

    def acceptance_rate_by_position(self) -> list[float]:
        return [
            a / p if p else math.nan
            for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=True)
        ]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    def snapshot(self) -> SpecStats:
        return SpecStats(
            method="",
            proposed_by_position=list(self.proposed_by_position),
            accepted_by_position=list(self.accepted_by_position),
            num_steps=self.num_steps,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_emitted_tokens=self.num_emitted_tokens,
            tokens_per_second=self.tokens_per_second(),
        )


@dataclass(frozen=True)
class SpecStats:
    """A copy of `SpecMetrics` for `EngineStats` (read by the metrics scrape on another thread)."""

    method: str
    proposed_by_position: list[int]
    accepted_by_position: list[int]
    num_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    tokens_per_second: float


# --- the engine's side ----------------------------------------------------------------------------
class BatchProposer(Protocol):
    """A proposer that drafts for all requests of a step at once (a draft model inside the engine)."""

    def propose_batch(
        self, requests: Sequence[tuple[SequenceLike, int]], generator: torch.Generator | None
    ) -> dict[str, Proposal]: ...

    def forget(self, request_id: str) -> None: ...


class Speculator:
    """What `LLMEngine` holds when speculation is on: drafts tokens for decoding requests before each
    step and verifies the target's k+1 logit rows after it. Per-request adaptive k; engine-wide metrics.

    `proposer`: None for n-gram lookup, else a `BatchProposer` (engine/spec_draft.py's draft model).
    Requests asking for log-probabilities do not speculate (their per-token log-probs would need the
    verification rows' logprobs; they decode one token per step as usual)."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: BatchProposer | None = None
    ) -> None:
        if config.method != "ngram" and proposer is None:
            raise ValueError(f"speculative method {config.method!r} needs a draft model proposer")
        self.config = config
        self.ngram = NgramProposer()
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.metrics = SpecMetrics()
        self._k: dict[str, AdaptiveK] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}  # the draft's q rows of a sampling request
        # what a verification costs (learned from timed decode steps) and seconds per drafted token
        # of a model proposer; adaptive k weighs acceptance against these (verifying k rows is cheap
        # on a GPU, not on every CPU)
        self.cost = StepCost(prior_per_token=AdaptiveK.cost_per_token)
        self.propose_token_s: float = 0.0
        # acceptance of this engine's drafts lately per bucket (n-gram match length; one bucket for a
        # draft model): a request's prior, so on traffic whose drafts fail (short matches in
        # open-ended chat) a short answer does not spend its first steps verifying doomed drafts
        self.rates = BucketRates(prior_rate=AdaptiveK.initial_rate)
        self._bucket: dict[str, int] = {}  # request -> bucket of the drafts it is verifying
        self._since_plain = 0
        self._batch_size = 0

    @property
    def method(self) -> str:
        c = self.config
        return {"ngram": "ngram", "draft": f"draft:{c.draft_model}", "self": f"self:{c.self_draft}"}[c.method]

    @property
    def cost_per_token(self) -> float:
        """Extra plain steps per drafted token: verifying it, plus drafting it for a model proposer."""
        base = self.cost.plain_seconds(self._batch_size)
        drafting = self.propose_token_s / base if base else 0.0
        return self.cost.per_token + drafting

    @property
    def fixed_cost(self) -> float:
        """Extra plain steps for verifying any drafts at all (see `StepCost`)."""
        return self.cost.fixed

    def recent_rate(self, bucket: int = 0) -> float:
        """Share of drafted tokens accepted lately in this bucket, across this engine's requests (a
        new request's prior for adaptive k)."""
        return self.rates.rate(bucket)

    def stats(self) -> SpecStats:
        snap = self.metrics.snapshot()
        return SpecStats(**{**snap.__dict__, "method": self.method})

    def begin_step(self, running: Sequence[SequenceLike], generator: torch.Generator | None = None) -> None:
        """Propose drafts for this step. Every 16th step stays plain, to keep the baseline cost fresh.
        (Not every step before the first plain one is timed: with prefills arriving all the time a pure
        decode step may not come soon, and the priors are a fair start. For the same reason the count
        starts over at the plain step itself, timed or not: waiting for a pure decode step to time kept
        a busy engine, where every step also prefilled a newcomer, from speculating ever again.)"""
        self._since_plain += 1
        if self._since_plain >= 16:
            self._since_plain = 0
            return
        self._batch_size = len(running)
        if self.proposer is None:
            for seq in running:
                self._ngram_draft(seq)
            return
        wants = [(seq, k) for seq in running if (k := self._wanted(seq)) > 0]
        if not wants:
            return
        started = time.perf_counter()
        proposals = self.proposer.propose_batch(wants, generator)
        drafted = 0
        for seq, _ in wants:
            if (proposal := proposals.get(seq.request_id)) is None:
                continue
            seq.draft_token_ids = proposal.token_ids
            self._bucket[seq.request_id] = 0
            drafted += len(proposal.token_ids)
            if proposal.probs is not None:
                self._draft_probs[seq.request_id] = proposal.probs
        if drafted:
            per_token = (time.perf_counter() - started) / drafted
            self.propose_token_s = (
                0.8 * self.propose_token_s + 0.2 * per_token if self.propose_token_s else per_token
            )

    def end_step(self, seqs: Sequence[SequenceLike], num_tokens: list[int], seconds: float) -> None:
        """Fold in the model time of a step. Only pure decode steps count (a prefill would skew it)."""
        if any(n != 1 + len(s.draft_token_ids) for s, n in zip(seqs, num_tokens, strict=True)):
            return
        num_drafts = sum(len(s.draft_token_ids) for s in seqs)
        if num_drafts == 0:
            self._since_plain = 0
            self.cost.observe_plain(len(seqs), seconds)
        else:
            verifying = sum(1 for s in seqs if s.draft_token_ids)
            self.cost.observe(len(seqs), verifying, num_drafts, seconds)

    def _room(self, seq: SequenceLike) -> int:
        """How many tokens a request in decode state (one uncomputed token) may draft, else 0."""
        p = seq.params
        if (
            seq.draft_token_ids
            or p.logprobs is not None
            or p.json_format is not None  # a grammar would have to check every draft position
            or seq.num_output_tokens < p.min_tokens  # so would min_tokens' ban on ending tokens
            or seq.num_computed_tokens != seq.num_tokens - 1
        ):
            return 0
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return min(room, self.config.num_speculative_tokens) if room > 0 else 0

    def _adaptive(self, seq: SequenceLike) -> AdaptiveK:
        adaptive = self._k.get(seq.request_id)
        if adaptive is None:
            adaptive = AdaptiveK(self.config.num_speculative_tokens)
            self._k[seq.request_id] = adaptive
        adaptive.cost_per_token = self.cost_per_token
        adaptive.fixed_cost = self.fixed_cost
        return adaptive

    def _ngram_draft(self, seq: SequenceLike) -> None:
        """Look up first (microseconds), then decide: the match length says how promising the draft is,
        and no match means a plain step at no cost."""
        room = self._room(seq)
        if room <= 0:
            return
        proposal = self.ngram.propose(seq.token_ids(), room)
        adaptive = self._adaptive(seq)
        bucket = proposal.match_len
        k = adaptive.next_k(bucket, self.rates.rate(bucket), can_draft=bool(proposal.token_ids))
        if k:
            seq.draft_token_ids = proposal.token_ids[:k]
            self._bucket[seq.request_id] = bucket

    def _wanted(self, seq: SequenceLike) -> int:
        """How many tokens a draft model should draft for this request (decided before drafting:
        drafting costs forwards of the draft)."""
        room = self._room(seq)
        if room <= 0:
            return 0
        return min(self._adaptive(seq).next_k(0, self.rates.rate(0)), room)

    def verify(
        self,
        seq: SequenceLike,
        logits: torch.Tensor,
        generator: torch.Generator | None,
        ends: Collection[int] = (),
    ) -> list[int]:
        """`logits` [k+1, vocab]: the target after the last real token and after each draft token.
        Returns the tokens to append (accepted drafts + one of the target's); clears the drafts.
        `ends`: the tokens that end the request (EOS, its stop tokens); the tokens after the first of
        them are never emitted, so they are dropped here and the metrics count what is emitted."""
        drafts = list(seq.draft_token_ids)
        seq.draft_token_ids = []
        q = self._draft_probs.pop(seq.request_id, None)
        p = seq.params
        rows = [
            SamplingRow(p, seq.generator, seq.prompt_token_ids, [*seq.output_token_ids, *drafts[:i]])
            for i in range(len(drafts) + 1)
        ]
        logits = apply_penalties(logits, rows)
        if p.greedy:
            tokens = verify_greedy(drafts, top_token(logits).tolist())
        else:
            probs = apply_filters(logits, rows).softmax(-1)
            if seq.generator is not None:
                tokens = verify_seeded(drafts, probs, seq.generator)
            else:
                # the scheduler may have cut the draft to fit the token budget: its first rows still hold
                draft_q = q[: len(drafts)] if q is not None else None
                tokens = rejection_sample(drafts, probs, draft_q, generator)
        accepted = len(tokens) - 1
        if ends and (end := next((i for i, t in enumerate(tokens) if t in ends), None)) is not None:
            del tokens[end + 1 :]
        self.metrics.record(len(drafts), accepted, len(tokens))
        bucket = self._bucket.pop(seq.request_id, 0)
        self.rates.update(bucket, len(drafts), accepted)
        if (adaptive := self._k.get(seq.request_id)) is not None:
            adaptive.update(len(drafts), accepted, bucket)
        return tokens

    def preempted(self, seq: SequenceLike) -> None:
        """The scheduler preempted `seq` (its drafts are dropped): free its draft-model cache now rather
        than when it ends. On resume the draft catches up again (or adopts its prefix cache's blocks);
        its adaptive k is kept."""
        self._draft_probs.pop(seq.request_id, None)
        self._bucket.pop(seq.request_id, None)
        if self.proposer is not None:
            self.proposer.forget(seq.request_id)

    def forget(self, request_id: str) -> None:
        self._k.pop(request_id, None)
        self._draft_probs.pop(request_id, None)
        self._bucket.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request_id)


class SequenceLike(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    draft_token_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None

    @property
    def params(self) -> Any: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]: ...
