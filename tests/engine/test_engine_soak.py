"""A seeded random workload over everything that moves at once: staggered arrivals, aborts, shared
prefixes, a KV cache small enough to force preemption, chunked prefill under a small token budget, greedy
and seeded sampling with penalties, stop tokens, logit biases and JSON-schema constraints. Each surviving request must get exactly what it gets
alone on a roomy engine, and no KV block may be left behind (the autouse leak check)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine.llm_engine import LLMEngine
from engine.sampling import JsonFormat, SamplingParams

SCHEMA = json.dumps({"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"]})


@dataclass
class Arrival:
    request_id: str
    step: int  # engine step before which it is added
    prompt: list[int]
    params: SamplingParams
    abort_at: int | None  # engine step before which it is aborted, if any


def workload(rng: random.Random, n: int) -> list[Arrival]:
    bases = [[rng.randrange(1, 256) for _ in range(rng.randrange(16, 60))] for _ in range(3)]
    arrivals = []
    for i in range(n):
        # most prompts share a base up to a random point, so they part ways anywhere in a block,
        # including its last token (what the prefix cache's hash chain must tell apart)
        shared = rng.choice(bases)[: rng.randrange(1, 61)] if rng.random() < 0.7 else []
        prompt = shared + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 20))]
        sampled = rng.random() < 0.5
        params = SamplingParams(
            max_tokens=rng.randrange(1, 48),
            temperature=rng.choice([0.7, 1.0, 1.3]) if sampled else 0,
            top_p=rng.choice([1.0, 0.9]) if sampled else 1.0,
            top_k=rng.choice([0, 20]) if sampled else 0,
            seed=rng.randrange(1 << 30) if sampled else None,
            presence_penalty=rng.choice([0.0, 0.5]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            stop_token_ids=[rng.randrange(1, 256)] if rng.random() < 0.3 else [],
            ignore_eos=True,
            logit_bias={rng.randrange(1, 256): rng.choice([-100.0, 5.0])} if rng.random() < 0.2 else {},
            json_format=JsonFormat(SCHEMA) if rng.random() < 0.2 else None,
        )
        step = rng.randrange(0, 16)
        abort_at = step + rng.randrange(0, 12) if rng.random() < 0.2 else None
        arrivals.append(Arrival(f"r{i}", step, prompt, params, abort_at))
    return arrivals


def run_workload(
    engine: LLMEngine,
    arrivals: list[Arrival],
    after_step: Callable[[LLMEngine], None] | None = None,
    prompt_logprobs: dict[str, list] | None = None,
) -> tuple[dict[str, list[int]], set[str]]:
    """Tokens per request and the requests that ended by abort. `after_step` checks the engine after
    every step; `prompt_logprobs` collects each request's prompt log-probs."""
    out: dict[str, list[int]] = {a.request_id: [] for a in arrivals}
    aborted: set[str] = set()
    step = 0
    while step <= max(a.step for a in arrivals) or engine.has_unfinished_requests():
        for a in arrivals:
            if a.step == step:
                engine.add_request(a.request_id, a.prompt, a.params)
            if a.abort_at == step:
                engine.abort_request(a.request_id)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished and o.finish_reason == "abort":
                aborted.add(o.request_id)
            if prompt_logprobs is not None and o.prompt_logprobs is not None:
                prompt_logprobs[o.request_id] = o.prompt_logprobs
        if after_step is not None:
            after_step(engine)
        step += 1
        assert step < 5000, "the workload did not drain"
    return out, aborted


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_workload_gets_each_request_its_solo_answer(
    make_engine: Callable[..., LLMEngine], seed: int
) -> None:
    rng = random.Random(seed)
    arrivals = workload(rng, 24)
    tight = make_engine(
        num_kv_blocks=10,  # 160 token slots for up to 8 running requests of up to ~115 tokens
        max_num_seqs=rng.choice([4, 8]),
        max_num_batched_tokens=rng.choice([13, 32, 64]),
    )
    got, aborted = run_workload(tight, arrivals)
    assert tight.stats().num_preemptions > 0, "the cache was meant to be too small for the workload"
    assert tight.stats().prefix_cache_hits > 0, "requests were meant to share prefixes"
    solo_engine = make_engine()
    for a in arrivals:
        tokens = got[a.request_id]
        if a.request_id in aborted:
            continue
        want = solo_engine.generate([a.prompt], a.params)[0]
        assert tokens == want, f"{a.request_id} ({a.params}) differs from its solo run"
        stopped = bool(set(a.params.stop_token_ids) & set(tokens))
        if a.params.json_format is not None and len(tokens) < a.params.max_tokens and not stopped:
            assert json.loads(bytes(tokens[:-1]).decode())["pet"] in ("cat", "dog")  # complete, then EOS
        else:
            assert len(tokens) == a.params.max_tokens or stopped
    assert aborted <= {a.request_id for a in arrivals if a.abort_at is not None}


@pytest.mark.parametrize("speculative", ["ngram", "self:int4"])
def test_a_random_greedy_workload_with_speculation_gets_each_request_its_solo_answer(
    make_engine: Callable[..., LLMEngine], speculative: str
) -> None:
    rng = random.Random(7)
    arrivals = workload(rng, 16)
    for a in arrivals:  # speculation keeps greedy answers exactly; sampled ones only in distribution
        a.params.temperature, a.params.seed = 0, None
    spec = make_engine(num_kv_blocks=10, max_num_seqs=6, max_num_batched_tokens=24, speculative=speculative)
    got, aborted = run_workload(spec, arrivals)
    stats = spec.stats()
    assert stats.num_preemptions > 0
    assert stats.speculative is not None and stats.speculative.num_accepted_tokens > 0
    plain = make_engine()
    for a in arrivals:
        if a.request_id not in aborted:
            assert got[a.request_id] == plain.generate([a.prompt], a.params)[0], a.request_id


def assert_blocks_accounted(engine: LLMEngine) -> None:
    """Every block's reference count is the number of running block tables holding it, the free list
    is exactly the unreferenced blocks, and waiting requests hold none (no leak, no double free)."""
    bm, scheduler = engine.block_manager, engine.scheduler
    refs = [0] * bm.num_blocks
    for seq in scheduler.running:
        assert len(seq.block_table) >= bm.blocks_needed(seq.num_computed_tokens)
        for block in seq.block_table:
            refs[block] += 1
    assert all(not seq.block_table for seq in scheduler.waiting)
    assert refs == bm.ref_counts
    assert set(bm.free) == {b for b, n in enumerate(refs) if n == 0}


@pytest.mark.parametrize(
    ("seed", "block_size", "max_num_seqs", "budget"), [(0, 1, 3, 3), (1, 4, 3, 2), (2, 16, 4, 17)]
)
def test_limits_at_their_edges_keep_every_block_accounted_at_every_step(
    make_engine: Callable[..., LLMEngine], seed: int, block_size: int, max_num_seqs: int, budget: int
) -> None:
    """A cache that holds exactly one maximal request (so max_model_len is the cache's size), prompts
    up to max_model_len - 1, step budgets of a few tokens, block sizes down to one, prompt log-probs
    and aborts: block accounting holds after every step, and each surviving request gets its solo
    answer and prompt log-probs."""
    rng = random.Random(seed)
    num_blocks = 32 // block_size + 1
    engine = make_engine(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
    )
    limit = engine.max_model_len
    assert limit == num_blocks * block_size  # clamped to the cache
    base = [rng.randrange(1, 256) for _ in range(limit)]
    arrivals = []
    for i in range(8):
        length = rng.choice([1, limit - 1, limit // 2, rng.randrange(1, limit)])
        prompt = base[: rng.randrange(length + 1)]
        prompt += [rng.randrange(1, 256) for _ in range(length - len(prompt))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 12),
            temperature=0,
            ignore_eos=True,
            prompt_logprobs=1 if rng.random() < 0.3 else None,
        )
        step = rng.randrange(4)
        abort_at = step + rng.randrange(6) if rng.random() < 0.25 else None
        arrivals.append(Arrival(f"r{i}", step, prompt, params, abort_at))
    prompt_lps: dict[str, list] = {}
    got, aborted = run_workload(engine, arrivals, assert_blocks_accounted, prompt_lps)
    assert engine.stats().num_preemptions > 0, "the cache was meant to be too small for the workload"
    solo = make_engine(block_size=block_size, num_kv_blocks=4 * num_blocks, max_model_len=limit)
    for a in arrivals:
        if a.request_id in aborted:
            continue
        solo.add_request("solo", a.prompt, a.params)
        outs = []
        while solo.has_unfinished_requests():
            outs.extend(solo.step())
        assert got[a.request_id] == [t for o in outs for t in o.new_token_ids], a.request_id
        if a.params.prompt_logprobs is not None:
            want = outs[0].prompt_logprobs
            assert want is not None
            have = prompt_lps[a.request_id]
            assert have[0] is want[0] is None  # the first prompt token has no log-prob
            assert [lp.token_id for lp in have[1:]] == [lp.token_id for lp in want[1:]]
            assert [lp.logprob for lp in have[1:]] == pytest.approx([lp.logprob for lp in want[1:]], abs=1e-4)
