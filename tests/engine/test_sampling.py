"""Sampling through the engine: seeds, masks, penalties and log-probabilities checked against the
model's own logits (a plain forward of the same weights)."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling import SamplingParams, SamplingRow, apply_filters, apply_penalties, sample
from tests.engine.reference import log_softmax, reference_logits

PROMPT = [17, 99, 3, 250, 41, 8, 77]


def outputs(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def first_token_samples(engine: LLMEngine, params: SamplingParams, n: int) -> Counter[int]:
    for i in range(n):
        engine.add_request(f"s{i}", PROMPT, params)
    return Counter(tokens(o)[0] for o in outputs(engine).values())


def test_seed_reproduces_a_request_whatever_its_batch_mates(tiny_engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = tiny_engine.generate([PROMPT], params)[0]
    rng = random.Random(0)
    mates = [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 40))] for _ in range(7)]
    crowd = tiny_engine.generate(
        [*mates[:3], PROMPT, *mates[3:]],
        [SamplingParams(max_tokens=rng.randrange(2, 14), temperature=1.3) for _ in range(3)]
        + [params]
        + [SamplingParams(max_tokens=6, temperature=0.7, seed=i) for i in range(4)],
    )
    assert crowd[3] == alone
    other_seed = tiny_engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=4321))[0]
    assert other_seed != alone


def test_unseeded_sampling_varies(tiny_engine: LLMEngine) -> None:
    draws = first_token_samples(tiny_engine, SamplingParams(max_tokens=1, temperature=1.0), 40)
    assert len(draws) > 5


def test_top_k_top_p_min_p_keep_only_allowed_tokens(tiny_engine: LLMEngine) -> None:
    logits = reference_logits(tiny_engine.model, PROMPT)[-1]
    order = logits.argsort(descending=True).tolist()
    probs = logits.softmax(-1)

    top5 = set(order[:5])
    draws = first_token_samples(tiny_engine, SamplingParams(max_tokens=1, top_k=5, seed=None), 60)
    assert set(draws) <= top5 and len(draws) > 1

    cum, nucleus = 0.0, set()
    for t in order:  # smallest set whose mass reaches 0.5
        nucleus.add(t)
        cum += float(probs[t])
        if cum >= 0.5:
            break
    draws = first_token_samples(tiny_engine, SamplingParams(max_tokens=1, top_p=0.5), 60)
    assert set(draws) <= nucleus

    allowed = {t for t in range(len(probs)) if probs[t] >= 0.3 * probs.max()}
    draws = first_token_samples(tiny_engine, SamplingParams(max_tokens=1, min_p=0.3), 60)
    assert set(draws) <= allowed


def test_sampling_follows_the_model_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    row = SamplingRow(SamplingParams(temperature=0.8), torch.Generator().manual_seed(0), [], [])
    counts = Counter(sample(logits, [row])[0] for _ in range(4000))
    expected = (logits / 0.8).softmax(-1)[0]
    for t in range(4):
        assert abs(counts[t] / 4000 - float(expected[t])) < 0.03


def test_filters_on_known_logits() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))

    def kept(**kw: float) -> list[int]:
        out = apply_filters(logits, [SamplingRow(SamplingParams(**kw), None, [], [])])
        return [i for i in range(4) if out[0, i] > float("-inf")]

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.5) == [0]
    assert kept(top_p=0.7) == [0, 1]
    assert kept(top_p=0.76) == [0, 1, 2]
    assert kept(min_p=0.3) == [0, 1, 2]  # 0.15 >= 0.3 * 0.5
    assert kept(min_p=0.31) == [0, 1]
    assert kept(top_k=3, top_p=0.6) == [0, 1]


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-45])
def test_a_temperature_near_zero_is_greedy(temperature: float) -> None:
    """Dividing logits by a denormal temperature overflows them to inf (softmax: NaN); vLLM treats any
    temperature below 1e-5 as greedy, and so does the sampler."""
    logits = torch.tensor([[1.0, 5.0, 2.0, -3.0], [4.0, -1.0, 0.5, 3.5]])
    rows = [SamplingRow(SamplingParams(temperature=temperature), None, [], []) for _ in range(2)]
    assert SamplingParams(temperature=temperature).greedy
    assert sample(logits, rows, torch.Generator().manual_seed(0)) == [1, 0]


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_min_tokens_bans_eos_and_stop_tokens_until_reached(make_engine, speculative: str | None) -> None:  # type: ignore[no-untyped-def]
    """vLLM's `min_tokens`: EOS and stop tokens cannot be drawn before the request has that many."""
    engine = make_engine(num_kv_blocks=32, adaptive_threads=False, speculative=speculative)
    eos = min(engine.config.eos_token_ids)
    prompt = list(b"abcabcabcabc")  # repetitive: n-gram lookup has drafts to offer
    forced = SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 100.0})
    [ended] = engine.generate([prompt], forced)
    assert ended == [eos]  # the bias makes EOS the greedy choice at once
    [held] = engine.generate([prompt], replace(forced, min_tokens=5))
    assert len(held) == 6 and eos not in held[:5] and held[5] == eos
    [free] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop = free[1]
    stopped = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    [cut] = engine.generate([prompt], stopped)
    assert cut == free[: free.index(stop) + 1]
    [kept] = engine.generate([prompt], replace(stopped, min_tokens=4))
    assert len(kept) >= 4 and stop not in kept[:4]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4).validate()


def test_penalties_on_known_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])

    def penalised(prompt: list[int], output: list[int], **kw: float) -> list[float]:
        return apply_penalties(logits, [SamplingRow(SamplingParams(**kw), None, prompt, output)])[0].tolist()

    assert penalised([0], [1], repetition_penalty=2.0) == [1.0, -4.0, 1.0, 0.5]
    assert penalised([2], [3, 3], presence_penalty=0.5) == [2.0, -2.0, 1.0, 0.0]  # prompt not counted
    assert penalised([], [3, 3, 0], frequency_penalty=0.25) == [1.75, -2.0, 1.0, 0.0]
    assert penalised([0], [0], repetition_penalty=1.0) == logits[0].tolist()
    biased = apply_penalties(
        logits, [SamplingRow(SamplingParams(logit_bias={1: 5.0, 3: -0.5}), None, [], [])]
    )
    assert biased[0].tolist() == [2.0, 3.0, 1.0, 0.0]
    assert logits[0].tolist() == [2.0, -2.0, 1.0, 0.5]  # the caller's logits are not changed


def test_logit_bias_bans_and_forces_tokens_through_the_engine(tiny_engine: LLMEngine) -> None:
    plain = tiny_engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    banned = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, logit_bias={t: -100 for t in set(plain)}
    )
    assert not set(tiny_engine.generate([PROMPT], banned)[0]) & set(plain)
    forced = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias={42: 100}, ignore_eos=True)
    assert tiny_engine.generate([PROMPT], forced)[0] == [42] * 6


@pytest.mark.parametrize(
    ("bias", "message"),
    [({5: 101.0}, r"\[-100, 100\]"), ({300: 1.0}, "vocabulary"), ({-1: 1.0}, "vocabulary")],
)
def test_logit_bias_is_validated(bias: dict[int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias).validate(vocab_size=256)


def test_repetition_penalty_changes_greedy_output(tiny_engine: LLMEngine) -> None:
    plain = tiny_engine.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert len(set(plain)) < len(plain)  # tiny random models loop
    strong = SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
    )
    penalised = tiny_engine.generate([PROMPT], strong)[0]
    assert len(set(penalised)) > len(set(plain))


def test_logprobs_match_log_softmax_of_the_model(tiny_engine: LLMEngine) -> None:
    tiny_engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, temperature=0.9, seed=5, logprobs=3))
    outs = outputs(tiny_engine)["r"]
    generated = tokens(outs)
    seq = list(PROMPT)
    for out, tok in zip(outs, generated, strict=True):
        (lp,) = out.new_logprobs or []
        expected = log_softmax(reference_logits(tiny_engine.model, seq)[-1])
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, float(expected[tok]), abs_tol=1e-4)
        top = expected.topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(
            math.isclose(a, float(b), abs_tol=1e-4) for (_, a), b in zip(lp.top, top.values, strict=True)
        )
        seq.append(tok)


def test_logprobs_zero_gives_the_chosen_token_only(tiny_engine: LLMEngine) -> None:
    tiny_engine.add_request("r", PROMPT, SamplingParams(max_tokens=2, temperature=0, logprobs=0))
    tiny_engine.add_request("none", PROMPT, SamplingParams(max_tokens=2, temperature=0))
    outs = outputs(tiny_engine)
    assert all(len(o.new_logprobs or []) == 1 and o.new_logprobs[0].top == [] for o in outs["r"])
    assert all(o.new_logprobs is None and o.prompt_logprobs is None for o in outs["none"])


def test_prompt_logprobs_in_the_first_output_even_when_chunked(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_num_batched_tokens=8)
    prompt = [random.Random(1).randrange(1, 256) for _ in range(30)]
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))  # fills the prefix cache
    outputs(engine)
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
    outs = outputs(engine)["r"]
    first = outs[0].prompt_logprobs
    assert first is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert len(first) == len(prompt) and first[0] is None
    expected = log_softmax(reference_logits(engine.model, prompt))
    for i in range(1, len(prompt)):
        entry = first[i]
        assert entry is not None and entry.token_id == prompt[i]
        assert math.isclose(entry.logprob, float(expected[i - 1, prompt[i]]), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == expected[i - 1].topk(2).indices.tolist()
    assert outs[0].num_cached_tokens == 0  # prompt log-probs need every position computed
