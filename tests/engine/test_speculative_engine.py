"""Speculative decoding inside the batched engine: identical greedy output, lossless sampling, no leaks."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest

from engine.llm_engine import LLMEngine, SamplingParams
from tests.engine.test_speculative import chi_square_pvalue


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2:  # input-grounded: a repeated phrase the n-gram lookup can copy
            phrase = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 9))]
            prompts.append(phrase * rng.randrange(2, 5) + phrase[: rng.randrange(1, len(phrase))])
        else:
            prompts.append([rng.randrange(1, 256) for _ in range(rng.randrange(2, 40))])
    return prompts


def test_greedy_output_is_token_identical_with_ngram_speculation(
    make_engine: Callable[..., LLMEngine],
) -> None:
    plain = make_engine()
    spec = make_engine(speculative="ngram", num_speculative_tokens=4)
    prompts = _prompts(24)
    params = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=bool(i % 3)) for i, m in enumerate([40] * 24)
    ]
    expected = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert got == expected
    m = spec.speculator.metrics
    # random tiny models loop, so lookup is accepted often: speculation really ran and paid off
    assert m.num_steps > 0 and m.num_accepted_tokens > 0 and m.mean_tokens_per_step > 1.0
    assert 0 < m.acceptance_rate_by_position()[0] <= 1


def test_greedy_identity_one_request_at_a_time_and_with_a_tight_token_budget(
    make_engine: Callable[..., LLMEngine],
) -> None:
    plain = make_engine()
    # budget 6 tokens/step: drafts are cut to fit, mixed with prefills of newcomers
    spec = make_engine(speculative="ngram", num_speculative_tokens=6, max_num_batched_tokens=6)
    prompts = _prompts(8, seed=1)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for prompt in prompts[:3]:
        assert spec.generate([prompt], params) == plain.generate([prompt], params)
    assert spec.generate(prompts, params) == plain.generate(prompts, params)


def test_speculation_under_kv_pressure_and_preemption_stays_identical(
    make_engine: Callable[..., LLMEngine],
) -> None:
    plain = make_engine(num_kv_blocks=12, block_size=4)
    spec = make_engine(num_kv_blocks=12, block_size=4, speculative="ngram", num_speculative_tokens=5)
    prompts = _prompts(6, seed=2)
    prompts = [p[:12] for p in prompts]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    assert spec.stats().num_preemptions > 0 and spec.speculator.metrics.num_accepted_tokens > 0


def test_requests_with_logprobs_or_penalties_mix_with_speculating_ones(
    make_engine: Callable[..., LLMEngine],
) -> None:
    plain = make_engine()
    spec = make_engine(speculative="ngram")
    prompts = _prompts(6, seed=3)
    params = [
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, stop_token_ids=[prompts[4][0]]),
        SamplingParams(max_tokens=25, temperature=0),
    ]
    assert spec.generate(prompts, params) == plain.generate(prompts, params)


def test_abort_mid_speculation_frees_every_block(make_engine: Callable[..., LLMEngine]) -> None:
    spec = make_engine(speculative="ngram")
    spec.add_request(
        "a", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    )
    for _ in range(4):
        spec.step()
    spec.abort_request("a")
    outs = spec.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert not spec.speculator._k


@pytest.mark.slow
def test_sampling_with_speculation_keeps_the_target_distribution(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Tokens 1 and 2 after a loop-friendly prompt, sampled many times with and without speculation,
    come from the same distribution (chi-square against the plain engine's frequencies as the reference
    is noisy, so compare with the exact target law of token 2 given token 1 = the greedy-likely token)."""
    plain = make_engine(config_changes={"vocab_size": 8})
    spec = make_engine(config_changes={"vocab_size": 8}, speculative="ngram", num_speculative_tokens=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    n = 1500
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    a = Counter(tuple(t[:2]) for t in plain.generate([prompt] * n, params))
    b = Counter(tuple(t[:2]) for t in spec.generate([prompt] * n, params))
    assert spec.speculator.metrics.num_accepted_tokens > 0
    cells = sorted(set(a) | set(b))
    # two-sample chi-square: compare b with a's (smoothed) frequencies
    ref = [(a[c] + 0.5) / (n + 0.5 * len(cells)) for c in cells]
    assert chi_square_pvalue([b[c] for c in cells], ref) > 1e-4
