"""Speculative decoding inside the batched engine: identical greedy output, lossless sampling, no leaks."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from engine.config import tiny_config
from engine.llm_engine import LLMEngine, SamplingParams
from engine.spec_draft import DraftModelProposer
from engine.speculative import sequence_logits
from tests.engine.chi_square import chi_square_pvalue, two_sample_chi_square_pvalue


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


def test_ngram_speculation_drafts_a_loop_k_tokens_ahead(make_engine: Callable[..., LLMEngine]) -> None:
    """An answer looping on one token ("AAAA"): every verification keeps all k drafts plus the target's
    own token. The lookup used to stop copying at the end of the context, one period after the latest
    match, so a period-1 loop got one draft per step (2 tokens per step however large k was)."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logit_bias={65: 100.0})
    prompt = [65] * 12
    [expected] = make_engine().generate([prompt], params)
    spec = make_engine(speculative="ngram", num_speculative_tokens=5)
    assert spec.generate([prompt], params) == [expected] and set(expected) == {65}
    m = spec.speculator.metrics
    assert m.acceptance_rate == 1.0 and m.mean_tokens_per_step > 4


def test_logit_bias_applies_to_speculative_verification(make_engine: Callable[..., LLMEngine]) -> None:
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logit_bias={7: 4.0, 9: -3.0})
    expected = make_engine().generate(prompts, params)
    assert expected != make_engine().generate(prompts, replace(params, logit_bias={}))  # the bias matters
    assert make_engine(speculative="ngram", num_speculative_tokens=4).generate(prompts, params) == expected


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
    # two-sample chi-square (both samples noisy)
    assert two_sample_chi_square_pvalue([a[c] for c in cells], [b[c] for c in cells]) > 1e-4


# --- model-based proposers: a draft model with its own KV cache inside the engine -------------------
# (spec, extra engine kwargs): a separate draft identical to the target (accepts everything), a separate
# smaller draft (mostly rejected), and the two self-drafts
MODEL_PROPOSERS = {
    "draft-same": ("draft:tiny-copy", {"_draft_config": tiny_config()}),
    "draft-small": ("draft:tiny-1layer", {"_draft_config": tiny_config(num_layers=1, hidden_size=32)}),
    "self-layers": ("self:layers=1", {}),
    "self-int4": ("self:int4", {}),
}


def _draft_pool_is_empty(engine: LLMEngine) -> bool:
    proposer = engine.speculator.proposer
    return proposer.num_free_blocks == proposer.num_blocks and not proposer._states


@pytest.mark.parametrize("name", list(MODEL_PROPOSERS))
def test_greedy_output_is_token_identical_with_a_draft_model(
    make_engine: Callable[..., LLMEngine], name: str
) -> None:
    spec_name, kwargs = MODEL_PROPOSERS[name]
    plain = make_engine()
    spec = make_engine(speculative=spec_name, num_speculative_tokens=4, **kwargs)
    prompts = _prompts(16, seed=4)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=bool(i % 3)) for i in range(16)]
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    m = spec.speculator.metrics
    assert m.num_steps > 0 and m.num_draft_tokens > 0
    if name == "draft-same":  # the draft is the target: every drafted token is accepted
        assert m.acceptance_rate == 1.0 and m.mean_tokens_per_step > 3
    if name in ("self-layers", "self-int4"):  # close to the target: speculation pays off
        assert m.mean_tokens_per_step > 1.5
    assert _draft_pool_is_empty(spec)


def test_draft_model_under_a_tight_budget_kv_pressure_and_preemption(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """The target preempts and recomputes, drafts are cut to the token budget, and the draft's own pool
    (as small as the target's) has to evict idle requests' caches: output stays identical."""
    plain = make_engine(num_kv_blocks=12, block_size=4)
    spec = make_engine(
        num_kv_blocks=12,
        block_size=4,
        max_num_batched_tokens=7,
        speculative="self:layers=1",
        num_speculative_tokens=5,
    )
    prompts = [p[:12] for p in _prompts(6, seed=2)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    assert spec.stats().num_preemptions > 0 and spec.speculator.metrics.num_accepted_tokens > 0
    assert _draft_pool_is_empty(spec)


def test_draft_model_mixes_with_logprobs_penalties_and_stops(make_engine: Callable[..., LLMEngine]) -> None:
    plain = make_engine()
    spec = make_engine(speculative="self:layers=1")
    prompts = _prompts(5, seed=3)
    params = [
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, stop_token_ids=[prompts[3][0]]),
        SamplingParams(max_tokens=25, temperature=0),
    ]
    assert spec.generate(prompts, params) == plain.generate(prompts, params)


def test_a_stop_token_inside_an_accepted_block_counts_only_the_tokens_emitted(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """A draft identical to the target has every draft accepted, so a stop token (or EOS) usually ends
    the request inside a verified block: the tokens after it are dropped, and the speculative metrics
    count what was emitted (`weir_engine_spec_emitted_tokens_total`), not the whole block."""
    spec_name, kwargs = MODEL_PROPOSERS["draft-same"]
    prompt = _prompts(1, seed=5)[0]
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [expected] = make_engine().generate([prompt], free)
    engine = make_engine(speculative=spec_name, num_speculative_tokens=4, **kwargs)
    metrics = engine.speculator.metrics
    firsts = [i for i, t in enumerate(expected) if i >= 2 and t not in expected[:i]][:6]
    assert len(firsts) >= 3
    for n, i in enumerate(firsts):  # consecutive stops: some end mid-block, whatever k was drafted
        engine.add_request(str(n), prompt, replace(free, stop_token_ids=[expected[i]]))
        got: list[int] = []
        while engine.has_unfinished_requests():
            before = metrics.num_emitted_tokens, metrics.num_steps
            for out in engine.step():
                got.extend(out.new_token_ids)
                if metrics.num_steps > before[1]:  # a verification step: it counts what it emitted
                    assert metrics.num_emitted_tokens - before[0] == len(out.new_token_ids)
        assert got == expected[: i + 1]
    assert metrics.num_accepted_tokens > 0


def test_abort_mid_draft_frees_the_draft_cache(make_engine: Callable[..., LLMEngine]) -> None:
    spec = make_engine(speculative="self:layers=1")
    spec.add_request("a", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=50, temperature=0.8))
    for _ in range(4):
        spec.step()
    assert spec.speculator.proposer.num_free_blocks < spec.speculator.proposer.num_blocks
    spec.abort_request("a")
    assert [o.finish_reason for o in spec.step()] == ["abort"]
    assert _draft_pool_is_empty(spec) and not spec.speculator._draft_probs


def test_the_draft_reads_a_cached_prompt_prefix_instead_of_recomputing_it(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft model keeps a prefix cache of its own (its pool's full blocks of real tokens, by the
    target's block hashes): a request whose prompt starts like an earlier drafting request's catches
    the draft up from the end of that prefix, not from token 0, and its output is unchanged."""
    spec_name, kwargs = MODEL_PROPOSERS["draft-same"]  # every draft accepted: both requests draft
    shared = _prompts(2, seed=7)[0][:4] * 9  # 36 tokens: two full blocks of 16
    prompts = [[*shared, 1, 2, 3], [*shared, 9, 8]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = make_engine()
    expected = [plain.generate([p], params)[0] for p in prompts]
    engine = make_engine(speculative=spec_name, num_speculative_tokens=4, **kwargs)
    proposer = engine.speculator.proposer
    starts: list[int] = []  # where each catch-up of a prompt (a feed of several tokens) began
    forward = proposer._forward

    def spy(feeds: list) -> torch.Tensor:  # type: ignore[type-arg]
        starts.extend(f.start for f in feeds if len(f.token_ids) > 1)
        return forward(feeds)

    monkeypatch.setattr(proposer, "_forward", spy)
    assert engine.generate([prompts[0]], params) == [expected[0]]
    assert starts[0] == 0 and _draft_pool_is_empty(engine)
    starts.clear()
    assert engine.generate([prompts[1]], params) == [expected[1]]
    assert starts[0] == 32  # was 0: the whole prompt again
    assert _draft_pool_is_empty(engine)
    # without prefix caching nothing is kept
    engine = make_engine(speculative=spec_name, enable_prefix_caching=False, **kwargs)
    forward = engine.speculator.proposer._forward
    monkeypatch.setattr(engine.speculator.proposer, "_forward", spy)
    starts.clear()
    assert [engine.generate([p], params)[0] for p in prompts] == expected
    assert [s for s in starts if s == 0] == [0, 0]


def _kv_bytes(model: torch.nn.Module) -> int:
    return sum(
        layer.self_attn.k_cache.nbytes + layer.self_attn.v_cache.nbytes for layer in model.decoder_layers
    )


@pytest.mark.parametrize(("spec", "draft_layers"), [("self:int4", 2), ("self:layers=1", 1)])
def test_the_kv_cache_memory_covers_the_draft_models_cache_too(
    make_engine: Callable[..., LLMEngine], spec: str, draft_layers: int
) -> None:
    """`kv_cache_memory_gb` is what the KV cache may take: a draft model's cache (as many blocks as the
    target's) comes out of it, instead of doubling it for self:int4 (on a GPU, whose default is half
    the free memory, the two caches took all of it)."""
    gib = 1 / 1024  # 1 MiB
    plain = make_engine(num_kv_blocks=None, kv_cache_memory_gb=gib)
    engine = make_engine(num_kv_blocks=None, kv_cache_memory_gb=gib, speculative=spec)
    assert engine.speculator is not None and isinstance(engine.speculator.proposer, DraftModelProposer)
    draft = engine.speculator.proposer.model
    target_bytes, draft_bytes = _kv_bytes(engine.model), _kv_bytes(draft)
    assert target_bytes + draft_bytes <= gib * (1 << 30)
    assert draft_bytes == target_bytes * draft_layers // engine.config.num_layers
    blocks = engine.block_manager.num_blocks
    assert engine.speculator.proposer.num_blocks == blocks
    # the budget is used, not merely respected: one more block each would not fit
    per_block = (target_bytes + draft_bytes) // blocks
    assert (blocks + 1) * per_block > gib * (1 << 30)
    assert plain.block_manager.num_blocks > blocks
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert engine.generate(_prompts(3), params) == plain.generate(_prompts(3), params)


def test_a_draft_model_must_share_the_vocabulary(make_engine: Callable[..., LLMEngine]) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(speculative="draft:other", _draft_config=tiny_config(vocab_size=300))


def _exact_two_token_law(engine: LLMEngine, prompt: list[int]) -> dict[tuple[int, int], float]:
    """p(x0) p(x1 | x0) of the engine's target model at temperature 1, computed outside the engine."""
    vocab = engine.config.vocab_size
    p0 = sequence_logits(engine.model, prompt)[0].softmax(-1).tolist()
    law = {}
    for a in range(vocab):
        p1 = sequence_logits(engine.model, [*prompt, a])[0].softmax(-1).tolist()
        for b in range(vocab):
            law[(a, b)] = p0[a] * p1[b]
    return law


@pytest.mark.slow
@pytest.mark.parametrize("name", ["draft-small", "self-layers"])
def test_sampling_with_a_draft_model_keeps_the_target_distribution(
    make_engine: Callable[..., LLMEngine], name: str
) -> None:
    """Rejection sampling with the draft's probabilities (q != p): the first two sampled tokens follow
    the target's exact joint law, by a chi-square goodness-of-fit test."""
    spec_name, kwargs = MODEL_PROPOSERS[name]
    if "_draft_config" in kwargs:
        kwargs = {"_draft_config": kwargs["_draft_config"].with_(vocab_size=8)}
    spec = make_engine(
        config_changes={"vocab_size": 8}, speculative=spec_name, num_speculative_tokens=3, **kwargs
    )
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    n = 1500
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    counts = Counter(tuple(t[:2]) for t in spec.generate([prompt] * n, params))
    m = spec.speculator.metrics
    assert m.num_accepted_tokens > 0 and m.num_accepted_tokens < m.num_draft_tokens  # both branches ran
    law = _exact_two_token_law(spec, prompt)
    cells = sorted(law)
    assert chi_square_pvalue([counts[c] for c in cells], [law[c] for c in cells]) > 1e-4


@pytest.mark.parametrize("spec", ["ngram", "self:layers=1"])
def test_a_seeded_sample_is_the_same_text_with_speculation_alone_or_batched(
    make_engine: Callable[..., LLMEngine], spec: str
) -> None:
    """A `seed` fixes the text: speculation (what was drafted, how much was accepted) must not change
    which tokens a seeded sampling request gets, nor its batch-mates."""
    prompt = list(b"abcabcabcabc abc abc abc")  # repetitive: n-gram lookup has drafts to offer
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True)
    small = {"num_kv_blocks": 32, "adaptive_threads": False}  # fast to build and to step
    [expected] = make_engine(**small).generate([prompt], params)
    engine = make_engine(speculative=spec, **small)
    [alone] = engine.generate([prompt], params)
    others = [list(f"xyz xyz {i} xyz xyz".encode()) for i in range(3)]
    mates = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = engine.generate([prompt, *others], [params, mates, mates, mates])[0]
    assert engine.speculator is not None and engine.speculator.metrics.num_draft_tokens > 0
    assert alone == expected
    assert batched == expected


def test_drafts_never_starve_the_decodes_of_later_running_requests(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """A budget that fits every running request's next token but not everyone's drafts: drafts take
    only what is left, so every decoding request still gains a token every step."""
    spec = make_engine(
        speculative="ngram", num_speculative_tokens=4, max_num_batched_tokens=8, max_num_seqs=4
    )
    phrase = [5, 6, 7, 8]  # the n-gram lookup drafts from the repeated phrase
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(4):
        spec.add_request(str(i), phrase * 3 + [20 + i], params)
    started: set[str] = set()
    while spec.has_unfinished_requests():
        decoding = set(started)
        gained = {o.request_id for o in spec.step() if o.new_token_ids}
        assert decoding <= gained | {r for r in decoding if r not in spec._requests}
        started |= gained
    assert spec.speculator is not None and spec.speculator.metrics.num_draft_tokens > 0


def test_the_drafts_catch_up_on_a_long_prompt_is_chunked_to_the_token_budget(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's first draft catches the draft up on its whole prompt: that work is chunked to
    `max_num_batched_tokens` over several steps (it went through in one forward, an unchunked
    prefill), and greedy output stays that of plain decoding."""
    spec_name, kwargs = MODEL_PROPOSERS["draft-same"]  # every draft accepted: drafting is visible
    budget = 16
    prompts = [p * 3 for p in _prompts(4, seed=8)]  # up to ~120 tokens
    prompts[0] = prompts[0][:5]  # a short one drafts beside the long ones' chunked catch-ups
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = make_engine(max_num_batched_tokens=budget).generate(prompts, params)
    engine = make_engine(
        speculative=spec_name, num_speculative_tokens=4, max_num_batched_tokens=budget, **kwargs
    )
    proposer = engine.speculator.proposer
    per_call: list[int] = []  # draft tokens computed by each propose_batch (one per engine step)
    forward, propose = proposer._forward, proposer.propose_batch

    def spy_forward(feeds: list) -> torch.Tensor:  # type: ignore[type-arg]
        per_call[-1] += sum(len(f.token_ids) for f in feeds)
        return forward(feeds)

    def spy_propose(*args: object) -> object:
        per_call.append(0)
        return propose(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(proposer, "_forward", spy_forward)
    monkeypatch.setattr(proposer, "propose_batch", spy_propose)
    assert engine.generate(prompts, params) == expected
    assert max(len(p) for p in prompts) > 3 * budget
    assert 0 < max(per_call) <= budget
    m = engine.speculator.metrics
    assert m.acceptance_rate == 1.0 and m.mean_tokens_per_step > 2
    assert _draft_pool_is_empty(engine)


def test_preemption_frees_the_requests_draft_cache(make_engine: Callable[..., LLMEngine]) -> None:
    """A preempted request's draft-model cache is freed when the scheduler preempts it (it was kept
    until the request ended or the draft's pool ran short), and output stays that of plain decoding."""
    spec_name, kwargs = MODEL_PROPOSERS["draft-same"]
    plain = make_engine(num_kv_blocks=14, block_size=4)
    spec = make_engine(
        num_kv_blocks=14, block_size=4, speculative=spec_name, num_speculative_tokens=3, **kwargs
    )
    prompts = [p[:10] for p in _prompts(6, seed=9)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = plain.generate(prompts, params)
    proposer = spec.speculator.proposer
    for i, prompt in enumerate(prompts):
        spec.add_request(str(i), prompt, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    freed = 0  # preemptions of a request that held a draft cache
    while spec.has_unfinished_requests():
        cached = set(proposer._states)
        before = {s.request_id: s.num_preemptions for s in spec._requests.values()}
        for out in spec.step():
            got[out.request_id].extend(out.new_token_ids)
        for seq in spec.scheduler.waiting:
            if seq.num_preemptions > before[seq.request_id]:
                assert seq.request_id not in proposer._states
                freed += seq.request_id in cached
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert freed > 0 and spec.speculator.metrics.num_accepted_tokens > 0
    assert _draft_pool_is_empty(spec)
