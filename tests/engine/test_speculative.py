"""Speculative decoding building blocks: n-gram lookup, the lossless verification rule, adaptive k."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from engine.config import tiny_config
from engine.model import Transformer
from engine.sampling import SamplingParams, SamplingRow, sample
from engine.sequence import Sequence
from engine.speculative import (
    RATE_WINDOW_S,
    AdaptiveK,
    ModelProposer,
    NgramProposer,
    Proposal,
    SpecMetrics,
    SpeculativeConfig,
    Speculator,
    parse_speculative,
    rejection_sample,
    self_draft_model,
    sequence_logits,
    verify_greedy,
)
from tests.engine.chi_square import chi_square_pvalue, two_sample_chi_square_pvalue


# --- n-gram prompt lookup -------------------------------------------------------------------------
def test_ngram_continues_the_latest_match_of_the_longest_suffix() -> None:
    proposer = NgramProposer(max_n=3)
    #          the cat sat on the mat . the cat
    tokens = [1, 2, 3, 4, 1, 5, 6, 1, 2]
    assert proposer.propose(tokens, 3).token_ids == [3, 4, 1]
    # a later, longer match wins over an earlier one
    assert proposer.propose([7, 8, 9, 1, 7, 8, 5, 0, 7, 8], 2).token_ids == [5, 0]
    assert proposer.propose([4, 9, 1, 2, 3, 5, 2, 3], 2).token_ids == [5, 2]


def test_ngram_proposes_nothing_without_a_match_and_caps_at_k() -> None:
    proposer = NgramProposer(max_n=4)
    assert proposer.propose([1, 2, 3, 4], 4).token_ids == []
    assert proposer.propose([5], 4).token_ids == []
    assert proposer.propose([1, 2, 3, 1, 2, 3, 1], 0).token_ids == []
    assert proposer.propose([1, 2, 3, 4, 5, 6, 1], 2).token_ids == [2, 3]
    # the match's continuation runs up to the end of the context and on through the tokens it copies
    # (it used to stop at the end, [2, 1]: a loop was drafted only one period ahead)
    assert proposer.propose([1, 2, 1], 5).token_ids == [2, 1, 2, 1, 2]
    with pytest.raises(ValueError):
        NgramProposer(max_n=1, min_n=2)


def test_ngram_drafts_k_tokens_of_a_loop_not_one_period() -> None:
    """In a loop the latest match is one period back; its continuation reaches the present after one
    period, and the copy goes on through what it copied (as vLLM's prompt lookup, and LZ77, do)."""
    proposer = NgramProposer(max_n=4)
    assert proposer.propose([7] * 6, 5) == Proposal([7] * 5, match_len=4)
    assert proposer.propose([5, 1, 2, 3, 1, 2, 3, 1], 6).token_ids == [2, 3, 1, 2, 3, 1]
    assert proposer.propose([9, 1, 2, 3, 1, 2, 3, 1, 2], 4).token_ids == [3, 1, 2, 3]
    # the latest of equally long matches still wins, though an earlier one has more after it to copy
    assert proposer.propose([1, 2, 3, 4, 0, 3, 4, 3], 3).token_ids == [4, 3, 4]


# --- the verification rule ------------------------------------------------------------------------
def test_verify_greedy_keeps_the_matching_prefix_and_adds_the_target_token() -> None:
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert verify_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert verify_greedy([], [4]) == [4]
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_speculative_greedy_breaks_exact_ties_as_plain_greedy_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """`argmax` and `max` need not pick the same of two equal logits (on CUDA they may not): every
    greedy choice goes through one function, so speculation keeps plain decoding's token regardless."""

    def last_of_ties(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t.shape[dim] - 1 - t.flip(dim).max(dim).indices

    monkeypatch.setattr(torch.Tensor, "argmax", last_of_ties)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seq = Sequence("a", [1, 2, 3], params, output_token_ids=[4])
    logits = torch.zeros(3, 8)
    logits[:, [2, 5]] = 1.0  # an exact tie in every row
    plain = sample(logits[:1], [SamplingRow(params, None, seq.prompt_token_ids, seq.output_token_ids)])[0]
    other = 2 + 5 - plain
    for drafts in ([plain, plain], [other, plain]):
        seq.draft_token_ids = list(drafts)
        spec = Speculator(SpeculativeConfig("ngram", 2), max_model_len=64)
        got = spec.verify(seq, logits[: len(drafts) + 1], None)
        assert got[0] == plain  # accepted if it is plain decoding's choice, else replaced by it


def test_token_ids_run_on_into_the_drafts_from_any_start() -> None:
    seq = Sequence("a", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5], draft_token_ids=[6, 7, 8])
    everything = [1, 2, 3, 4, 5, 6, 7, 8]
    for start in range(len(everything) + 1):
        for end in range(start, len(everything) + 1):
            assert seq.token_ids(start, end) == everything[start:end], (start, end)
    assert seq.token_ids() == everything[:5]


def _random_dist(gen: torch.Generator, rows: int, vocab: int, sharpness: float = 2.0) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=gen) * sharpness).softmax(-1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(deterministic: bool) -> None:
    """Context-free target rows p_i and a draft q_i (or a fixed guess): the first emitted token must
    follow p_0 and the second (when the first draft was accepted) p_1, whatever the draft does."""
    gen = torch.Generator().manual_seed(1)
    vocab, k, trials = 6, 3, 12000
    p = _random_dist(gen, k + 1, vocab)
    q = _random_dist(gen, k, vocab)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    accepted_any = 0
    for _ in range(trials):
        if deterministic:
            draft = [2, 0, 4]  # a fixed n-gram-style guess
            out = rejection_sample(draft, p, None, gen)
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
            out = rejection_sample(draft, p, q, gen)
        assert 1 <= len(out) <= k + 1 and out[: len(out) - 1] == draft[: len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            accepted_any += 1
    assert accepted_any > trials * 0.05  # the draft was accepted often enough to test the second slot
    assert chi_square_pvalue([first[t] for t in range(vocab)], p[0].tolist()) > 1e-3
    assert chi_square_pvalue([second[t] for t in range(vocab)], p[1].tolist()) > 1e-3


def test_rejection_sampling_with_an_identical_draft_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(0)
    p = _random_dist(gen, 4, 8)
    for _ in range(50):
        draft = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(3)]
        assert rejection_sample(draft, p, p[:3], gen)[:3] == draft


def test_rejection_sampling_detects_a_biased_rule() -> None:
    """The chi-square check has teeth: always accepting the draft (a lossy rule) fails it."""
    gen = torch.Generator().manual_seed(2)
    p = _random_dist(gen, 2, 6)
    q = _random_dist(gen, 1, 6)
    counts = Counter(int(torch.multinomial(q[0], 1, generator=gen)) for _ in range(4000))
    assert chi_square_pvalue([counts[t] for t in range(6)], p[0].tolist()) < 1e-6


def test_a_tiny_random_model_keeps_its_next_token_distribution_under_speculation() -> None:
    """Target and draft are two tiny random transformers; the joint law of the next two tokens with
    speculation equals the target's own p(x0) p(x1 | x0), by a chi-square test over the 2-token joint."""
    torch.manual_seed(0)
    vocab = 8
    config = tiny_config(vocab_size=vocab)
    target = Transformer(config).eval()
    draft_model = Transformer(config).eval()
    prompt = [1, 5, 3]
    temperature = 1.5  # flatten the random model so every cell has mass

    memo: dict[tuple[int, tuple[int, ...], int], torch.Tensor] = {}

    def probs(model: Transformer, tokens: list[int], last: int = 1) -> torch.Tensor:
        # contexts repeat across trials (vocab 8, k 2): run each distinct forward once
        key = (id(model), tuple(tokens), last)
        if key not in memo:
            memo[key] = (sequence_logits(model, tokens, last) / temperature).softmax(-1)
        return memo[key]

    # exact target law of (x0, x1)
    p0 = probs(target, prompt)[0]
    joint = []
    for a, b in itertools.product(range(vocab), repeat=2):
        joint.append(float(p0[a]) * float(probs(target, [*prompt, a])[0][b]))

    proposer = ModelProposer(lambda toks: probs(draft_model, toks)[0])
    gen = torch.Generator().manual_seed(3)
    counts: Counter[tuple[int, int]] = Counter()
    k = 2
    for _ in range(3000):
        proposal = proposer.propose(prompt, k, greedy=False, generator=gen)
        # one target pass scores all k drafts (+ the bonus row)
        scored = probs(target, [*prompt, *proposal.token_ids], last=k + 1)
        out = rejection_sample(proposal.token_ids, scored, proposal.probs, gen)
        if len(out) < 2:  # rejected at the first slot: continue with plain target sampling
            out.append(int(torch.multinomial(probs(target, [*prompt, out[0]])[0], 1, generator=gen)))
        counts[(out[0], out[1])] += 1
    cells = list(itertools.product(range(vocab), repeat=2))
    assert chi_square_pvalue([counts[c] for c in cells], joint) > 1e-3


# --- self-drafts ----------------------------------------------------------------------------------
def test_self_draft_by_layers_shares_weights_and_matches_a_truncated_model() -> None:
    torch.manual_seed(0)
    target = Transformer(tiny_config()).eval()
    draft = self_draft_model(target, "layers=1")
    assert len(draft.layers) == 1 and len(target.layers) == 2
    # the same weights (no copy) but an attention module of its own: the KV caches never alias
    assert draft.layers[0].mlp is target.layers[0].mlp and draft.lm_head is target.lm_head
    assert draft.layers[0].self_attn.qkv_proj is target.layers[0].self_attn.qkv_proj
    draft.allocate_kv_cache(4, 16, torch.float32, torch.device("cpu"))
    assert target.layers[0].self_attn.k_cache.numel() == 0 and draft.layers[0].self_attn.k_cache.numel() > 0
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    # greedy drafting with the truncated model proposes what it predicts, and verification keeps
    # exactly the target's greedy continuation
    proposer = ModelProposer(lambda toks: sequence_logits(draft, toks)[0].softmax(-1))
    proposal = proposer.propose(tokens, 3)
    target_argmax = sequence_logits(target, [*tokens, *proposal.token_ids], last=4).argmax(-1).tolist()
    out = verify_greedy(proposal.token_ids, target_argmax)
    expected, ctx = [], list(tokens)
    for _ in range(len(out)):
        expected.append(int(sequence_logits(target, ctx)[0].argmax()))
        ctx.append(expected[-1])
    assert out == expected
    with pytest.raises(ValueError):
        self_draft_model(target, "layers=3")


def test_self_draft_int4_is_a_quantized_copy() -> None:
    torch.manual_seed(0)
    target = Transformer(tiny_config()).eval()
    target.allocate_kv_cache(64, 16, torch.float32, torch.device("cpu"))
    draft = self_draft_model(target, "int4")
    assert draft is not target and getattr(target, "quant_scheme", None) is None
    # the target's cache is neither copied into the draft nor lost
    assert (
        draft.layers[0].self_attn.k_cache.numel() == 0 and target.layers[0].self_attn.k_cache.shape[0] == 64
    )
    assert str(draft.quant_scheme).startswith("int4")
    tokens = list(range(1, 20))
    close = torch.nn.functional.cosine_similarity(
        sequence_logits(draft, tokens), sequence_logits(target, tokens)
    )
    assert float(close) > 0.9


# --- adaptive k, metrics, parsing -----------------------------------------------------------------
def test_adaptive_k_backs_off_when_acceptance_falls_and_recovers() -> None:
    ak = AdaptiveK(k_max=5)
    for _ in range(10):
        ak.update(5, 5)
    assert ak.next_k() == 5
    for _ in range(10):
        k = ak.next_k()
        ak.update(k, 0)
    assert ak.best_k() == 0
    ks = [ak.next_k() for _ in range(ak.probe_every)]
    assert ks.count(1) == 1 and ks.count(0) == ak.probe_every - 1  # one probe draft, otherwise plain decoding
    for _ in range(10):
        ak.update(1, 1)
    assert ak.next_k() >= 3


def test_adaptive_k_is_monotonic_in_acceptance() -> None:
    ks = []
    for rate in (0.0, 0.2, 0.4, 0.6, 0.8, 0.95):
        ak = AdaptiveK(k_max=8, initial_rate=rate)
        ks.append(ak.best_k())
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8


def test_metrics_count_acceptance_per_position() -> None:
    m = SpecMetrics()
    m.record(3, 3)
    m.record(3, 1)
    m.record(2, 0)
    m.record(0, 0)  # no draft: not a speculative step
    assert m.proposed_by_position == [3, 3, 2]
    assert m.accepted_by_position == [2, 1, 1]
    assert m.acceptance_rate_by_position() == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    assert m.num_steps == 3 and m.mean_accepted_per_step == pytest.approx(4 / 3)
    assert m.mean_tokens_per_step == pytest.approx(7 / 3)
    assert m.acceptance_rate == pytest.approx(4 / 8)


def test_speculative_tokens_per_second_counts_the_last_window_only() -> None:
    m = SpecMetrics()
    m.record(4, 4, now=100.0)  # 5 tokens
    m.record(4, 1, now=105.0)  # 2 tokens
    assert m.tokens_per_second(now=105.0) == pytest.approx(7 / RATE_WINDOW_S)
    assert m.tokens_per_second(now=112.0) == pytest.approx(2 / RATE_WINDOW_S)  # the first fell out
    assert m.tokens_per_second(now=200.0) == 0.0
    snap = m.snapshot()
    assert snap.num_emitted_tokens == 7 and snap.accepted_by_position == [2, 1, 1, 1]


def test_parse_speculative() -> None:
    assert parse_speculative("ngram", 5).num_speculative_tokens == 5
    assert parse_speculative("draft:smollm2-135m").draft_model == "smollm2-135m"
    assert parse_speculative("self:int4").self_draft == "int4"
    assert parse_speculative("self:layers=6").self_draft == "layers=6"
    for bad in ("", "medusa", "draft:", "self:layers=0", "self:int3"):
        with pytest.raises(ValueError, match="speculative"):
            parse_speculative(bad)
    with pytest.raises(ValueError):
        parse_speculative("ngram", 0)


def test_two_sample_chi_square_passes_one_law_and_rejects_two() -> None:
    gen = torch.Generator().manual_seed(0)
    law = torch.tensor([0.5, 0.3, 0.15, 0.05])
    shifted = torch.tensor([0.45, 0.3, 0.15, 0.1])

    def counts(p: torch.Tensor) -> list[int]:
        return torch.bincount(
            torch.multinomial(p, 3000, replacement=True, generator=gen), minlength=4
        ).tolist()

    assert two_sample_chi_square_pvalue(counts(law), counts(law)) > 1e-3
    assert two_sample_chi_square_pvalue(counts(law), counts(shifted)) < 1e-4
