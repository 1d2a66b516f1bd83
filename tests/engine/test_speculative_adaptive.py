"""Adaptive speculation: poor acceptance must cost (almost) nothing next to plain decoding.

The engine's `Speculator` is driven here step by step the way `LLMEngine.step` drives it, with a
simulated clock whose costs have the shape measured on a CPU in fp32 (a fixed price for verifying any
drafts at all plus a little per drafted token) and a target that rejects every draft, so the test is
deterministic and does not depend on machine load."""

from __future__ import annotations

import random

import pytest
import torch

from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.speculative import AdaptiveK, NgramProposer, SpeculativeConfig, Speculator, StepCost

PLAIN_S = 0.010  # one plain decode step
FIXED = 0.35  # verifying any drafts costs this many plain steps more (GEMV -> GEMM, chunked attention)
PER_TOKEN = 0.02  # and this much per drafted token
VOCAB = 32


def step_seconds(num_drafts: int) -> float:
    return PLAIN_S * (1.0 + FIXED + PER_TOKEN * num_drafts) if num_drafts else PLAIN_S


def run_request(
    spec: Speculator, request_id: str, rng: random.Random, max_tokens: int = 48, accept: float = 0.25
) -> tuple[float, int]:
    """Decode one request whose drafts the target accepts with probability `accept` each (the chat
    case: n-gram lookup is right about a quarter of the time). Returns (simulated seconds of its
    decode steps, steps that verified drafts). Tokens come from a small alphabet, so lookup always
    finds a match."""
    prompt = [rng.randrange(1, 8) for _ in range(30)]
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    seq.output_token_ids.append(rng.randrange(1, 8))  # the prefill's token
    seq.num_computed_tokens = seq.num_tokens - 1
    seconds = 0.0
    verifying = 0
    while seq.num_output_tokens < max_tokens:
        spec.begin_step([seq])
        drafts = list(seq.draft_token_ids)
        took = step_seconds(len(drafts))
        spec.end_step([seq], [1 + len(drafts)], took)
        seconds += took
        if drafts:
            verifying += 1
            logits = torch.zeros(len(drafts) + 1, VOCAB)
            expected = []
            for i, d in enumerate(drafts):
                if rng.random() < accept:
                    logits[i, d] = 1.0
                    expected.append(d)
                    continue
                target = [t for t in range(1, 8) if t != d][rng.randrange(6)]
                logits[i, target] = 1.0
                expected.append(target)
                break
            else:
                bonus = rng.randrange(1, 8)
                logits[len(drafts), bonus] = 1.0
                expected.append(bonus)
            tokens = spec.verify(seq, logits, None)
            assert tokens == expected
        else:
            tokens = [rng.randrange(1, 8)]
        seq.output_token_ids.extend(tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
    spec.forget(request_id)
    return seconds, verifying


def test_poor_acceptance_costs_under_5_percent_after_the_first_request() -> None:
    rng = random.Random(0)
    spec = Speculator(SpeculativeConfig("ngram", 5), max_model_len=4096)
    first, _ = run_request(spec, "a", rng)
    assert first <= 1.10 * 47 * PLAIN_S  # even the first request backs off within a few steps
    # what one draft costs has been learned (mostly from probes, so how it splits between the fixed
    # and the per-token part is left to `test_step_cost_recovers_fixed_and_per_token_costs`)
    assert spec.fixed_cost + spec.cost_per_token == pytest.approx(FIXED + PER_TOKEN, abs=0.05)
    # later requests start from the engine's recent acceptance (not from 0.7), a quarter of one draft
    # accepted does not pay for a verification's fixed cost, and rejected probes space out: with any
    # of the three missing this simulation verifies 50-240 times over these 8 requests, not 24-38
    results = [run_request(spec, f"b{i}", rng) for i in range(8)]
    assert spec._k == {}  # each request forgotten at its end
    verifying = sum(v for _, v in results)
    ratio = sum(s for s, _ in results) / (8 * 47 * PLAIN_S)  # 47 decode steps after the prefill's token
    assert verifying <= 45, verifying
    assert ratio <= 1.015, ratio


def test_a_new_request_starts_from_the_engines_recent_acceptance() -> None:
    rng = random.Random(1)
    spec = Speculator(SpeculativeConfig("ngram", 5), max_model_len=4096)
    assert spec.recent_rate == AdaptiveK.initial_rate
    run_request(spec, "a", rng)  # long enough for probes to have timed what a draft costs
    assert spec.recent_rate < 0.3
    assert spec.fixed_cost + spec.cost_per_token > 0.3
    seq = Sequence("b", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=16, temperature=0))
    seq.output_token_ids.append(3)
    seq.num_computed_tokens = seq.num_tokens - 1
    spec.begin_step([seq])
    assert spec._k["b"].rate == pytest.approx(spec.recent_rate)
    assert seq.draft_token_ids == []  # poor recent acceptance: the first step does not draft


def test_rejected_probes_back_off_and_an_accepted_one_restores_the_interval() -> None:
    ak = AdaptiveK(k_max=5, initial_rate=0.0)
    gaps = []
    for _ in range(4):
        steps = 1
        while ak.next_k() == 0:
            steps += 1
        gaps.append(steps)
        ak.update(1, 0)  # the probe's draft was rejected
    assert gaps == [8, 16, 32, 64]
    ak.update(0, 0)  # no draft: not an observation
    while ak.next_k() == 0:
        pass
    ak.update(1, 1)  # a probe accepted: back to probing every 8 steps
    assert ak.probe_interval == ak.probe_every == 8


def test_a_fixed_verification_cost_makes_plain_decoding_win() -> None:
    # acceptance 0.3: with a per-token cost alone one draft pays, but not once it has a fixed price
    assert AdaptiveK(5, cost_per_token=0.05, initial_rate=0.3).best_k() >= 1
    assert AdaptiveK(5, cost_per_token=0.05, fixed_cost=0.35, initial_rate=0.3).best_k() == 0
    # high acceptance still speculates deeply despite the fixed price
    assert AdaptiveK(5, cost_per_token=0.05, fixed_cost=0.35, initial_rate=0.9).best_k() == 5


def test_step_cost_recovers_fixed_and_per_token_costs() -> None:
    rng = random.Random(2)
    cost = StepCost()
    assert cost.plain_seconds(1) is None
    for _ in range(5):
        cost.observe_plain(1, PLAIN_S)
        cost.observe_plain(4, 3 * PLAIN_S)
    for _ in range(60):
        batch = rng.choice((1, 4))
        verifying = rng.randrange(1, batch + 1)
        drafts = sum(rng.randrange(1, 6) for _ in range(verifying))
        base = PLAIN_S if batch == 1 else 3 * PLAIN_S
        cost.observe(batch, verifying, drafts, base * (1 + FIXED * verifying + PER_TOKEN * drafts))
    assert cost.fixed == pytest.approx(FIXED, abs=0.02)
    assert cost.per_token == pytest.approx(PER_TOKEN, abs=0.01)
    assert cost.plain_seconds(3) == pytest.approx(3 * PLAIN_S)  # nearest batch size measured
    # never negative, even when verification measures as faster than plain decoding (noise)
    for _ in range(60):
        cost.observe(1, 1, 3, 0.5 * PLAIN_S)
    assert cost.fixed >= 0 and cost.per_token >= 0


def reference_ngram(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """The straightforward lookup: for n = max_n down to min_n, the latest earlier occurrence."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for start in range(total - n - 1, -1, -1):
            if tokens[start : start + n] == suffix and (follow := tokens[start + n : start + n + k]):
                return follow
    return []


def test_ngram_lookup_matches_the_straightforward_search() -> None:
    rng = random.Random(3)
    for min_n in (1, 2):
        proposer = NgramProposer(max_n=4, min_n=min_n)
        for _ in range(400):
            alphabet = rng.choice((2, 3, 5, 20))
            tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 60))]
            k = rng.randrange(0, 6)
            assert proposer.propose(tokens, k).token_ids == reference_ngram(tokens, k, 4, min_n), tokens
