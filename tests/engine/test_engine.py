"""The batched engine as a caller sees it: greedy answers that do not depend on batching, chunking,
prefix caching or preemption; aborts; limits; bad input."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from engine import model as model_module
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling import SamplingParams
from tests.engine.reference import reference_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_greedy_matches_a_plain_cache_free_forward(tiny_engine: LLMEngine) -> None:
    ps = prompts(3, seed=1)
    got = tiny_engine.generate(ps, GREEDY)
    for p, g in zip(ps, got, strict=True):
        assert g == reference_greedy(tiny_engine.model, p, GREEDY.max_tokens)


def test_batch_invariance_alone_batched_chunked_and_cached(make_engine: Callable[..., LLMEngine]) -> None:
    ps = prompts(16, seed=2)
    alone = [make_engine().generate([p], GREEDY)[0] for p in ps[:4]]
    batched = make_engine().generate(ps, GREEDY)
    assert batched[:4] == alone
    chunked = make_engine(max_num_batched_tokens=7).generate(ps, GREEDY)
    assert chunked == batched
    # same prompts again on a warm engine: every full block of each prompt comes from the prefix cache
    engine = make_engine()
    engine.generate(ps, GREEDY)
    hits_before = engine.stats().prefix_cache_hits
    assert engine.generate(ps, GREEDY) == batched
    assert engine.stats().prefix_cache_hits - hits_before == sum((len(p) - 1) // 16 * 16 for p in ps)


def test_row_blocked_mlp_changes_no_answer(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    ps = prompts(4, seed=5, lo=40, hi=70)  # one step of ~220 rows
    whole = make_engine().generate(ps, GREEDY)
    monkeypatch.setattr(model_module, "MLP_BLOCK_ROWS", 16)  # the step's MLPs now run in 14+ blocks
    engine = make_engine()
    mlp = engine.model.layers[0].mlp
    x = torch.randn(50, engine.config.hidden_size)
    with torch.inference_mode():
        blocked, rows = mlp(x), torch.cat([mlp._forward(x[i : i + 1]) for i in range(50)])
    torch.testing.assert_close(blocked, rows)
    assert engine.generate(ps, GREEDY) == whole


def test_prefix_cache_hit_is_reported_per_request(tiny_engine: LLMEngine) -> None:
    shared = prompts(1, seed=3, lo=40, hi=41)[0]  # 40 tokens: two full blocks of 16
    tiny_engine.add_request("first", [*shared, 7, 8], GREEDY)
    first = run_all(tiny_engine)["first"]
    assert first[0].num_cached_tokens == 0
    tiny_engine.add_request("second", [*shared, 9], GREEDY)
    second = run_all(tiny_engine)["second"]
    assert {o.num_cached_tokens for o in second} == {32}
    assert second[-1].num_prompt_tokens == 41
    stats = tiny_engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (42 + 41, 32)


def test_prefix_caching_can_be_disabled(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(enable_prefix_caching=False)
    p = prompts(1, seed=4, lo=50, hi=51)[0]
    a = engine.generate([p], GREEDY)
    assert engine.generate([p], GREEDY) == a
    assert engine.stats().prefix_cache_hits == 0


def test_preemption_under_a_tiny_cache_gives_the_same_answers(make_engine: Callable[..., LLMEngine]) -> None:
    ps = prompts(8, seed=5, lo=20, hi=40)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    roomy = make_engine().generate(ps, params)
    tight = make_engine(num_kv_blocks=12)  # 192 token slots for ~8 x 60 tokens
    assert tight.generate(ps, params) == roomy
    assert tight.stats().num_preemptions > 0


def gains_by_step(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Step `engine` to the end: (each request's tokens, the steps in which it gained some)."""
    tokens: dict[str, list[int]] = {}
    steps: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps.setdefault(o.request_id, []).append(step)
    return tokens, steps


@pytest.mark.parametrize(
    "num_kv_blocks", [256, 9]
)  # 9: preemptions too, with the latest admitted already served
def test_a_budget_below_the_running_count_serves_every_request_in_turn(
    make_engine: Callable[..., LLMEngine], num_kv_blocks: int
) -> None:
    """Admission keeps the running requests within the token budget, but a budget lowered while they
    run does not: then each still gains a token at least every ceil(running / budget) steps (not the
    first `budget` of them until they finish), with the answers it gives alone."""
    ps = prompts(8, seed=14, lo=3, hi=12)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = make_engine().generate(ps, params)
    engine = make_engine(num_kv_blocks=num_kv_blocks)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    first = engine.step()  # every prompt fits one step of the default budget
    assert len(first) == len(ps)
    engine.scheduler.max_num_batched_tokens = budget = 3
    tokens, steps = gains_by_step(engine)
    if num_kv_blocks == 256:
        for rid, gained in steps.items():
            gaps = [b - a for a, b in zip([0, *gained], gained, strict=False)]
            assert max(gaps) <= math.ceil(len(ps) / budget), rid
    else:
        assert engine.stats().num_preemptions > 0
    assert [o.new_token_ids + tokens[o.request_id] for o in first] == expected


def test_abort_frees_blocks_at_once_and_is_reported(tiny_engine: LLMEngine) -> None:
    tiny_engine.add_request("keep", prompts(1, seed=6)[0], SamplingParams(max_tokens=5, temperature=0))
    tiny_engine.add_request("drop", prompts(1, seed=7, lo=60, hi=61)[0], SamplingParams(max_tokens=50))
    tiny_engine.step()
    used = tiny_engine.block_manager.num_blocks - tiny_engine.stats().kv_blocks_free
    assert used >= 4
    tiny_engine.abort_request("drop")
    assert tiny_engine.block_manager.num_blocks - tiny_engine.stats().kv_blocks_free < used
    outs = run_all(tiny_engine)
    assert outs["drop"] == [outs["drop"][0]]
    assert outs["drop"][0].finished and outs["drop"][0].finish_reason == "abort"
    assert outs["keep"][-1].finish_reason in ("length", "stop")
    tiny_engine.abort_request("keep")  # finished already: nothing happens
    tiny_engine.abort_request("never-existed")
    assert tiny_engine.step() == []


def test_abort_of_a_waiting_request(tiny_engine: LLMEngine) -> None:
    tiny_engine.add_request("w", [1, 2, 3], GREEDY)
    tiny_engine.abort_request("w")
    (out,) = tiny_engine.step()
    assert (out.request_id, out.finished, out.finish_reason, out.new_token_ids) == ("w", True, "abort", [])


def test_stop_tokens_eos_and_length(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    p = prompts(1, seed=8)[0]
    free_run = engine.generate([p], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_at = free_run[3]
    engine.add_request(
        "s", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    )
    out = run_all(engine)["s"]
    tokens = [t for o in out for t in o.new_token_ids]
    assert tokens == free_run[: free_run.index(stop_at) + 1]
    assert out[-1].finish_reason == "stop" and out[-1].num_output_tokens == len(tokens)
    # the same token as the model's EOS stops it too, unless ignore_eos
    eos_engine = make_engine(config_changes={"eos_token_ids": (stop_at,)})
    assert eos_engine.generate([p], SamplingParams(max_tokens=8, temperature=0)) == [tokens]
    engine.add_request("l", p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    out = run_all(engine)["l"]
    assert [o.num_output_tokens for o in out] == [1, 2, 3, 4, 5]
    assert out[-1].finish_reason == "length" and [o.finished for o in out] == [False] * 4 + [True]


def test_context_limit_ends_with_length(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_model_len=40)
    engine.add_request(
        "r", list(range(1, 36)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    )
    out = run_all(engine)["r"]
    assert out[-1].num_output_tokens == 5 and out[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "at least one token"),
        (list(range(1, 200)) * 6, SamplingParams(), "context"),
        ([1, 300], SamplingParams(), "vocab"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0), "top_p"),
        ([1, 2], SamplingParams(top_k=-1), "top_k"),
        ([1, 2], SamplingParams(presence_penalty=3), "presence_penalty"),
        ([1, 2], SamplingParams(stop_token_ids=[999]), "stop token"),
    ],
)
def test_bad_requests_raise_and_change_nothing(
    tiny_engine: LLMEngine, prompt: list[int], params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_engine.add_request("bad", prompt, params)
    assert not tiny_engine.has_unfinished_requests()
    tiny_engine.add_request("bad", [1, 2], SamplingParams(max_tokens=1))  # the id is still free
    run_all(tiny_engine)


def test_duplicate_request_id_is_rejected(tiny_engine: LLMEngine) -> None:
    tiny_engine.add_request("x", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        tiny_engine.add_request("x", [3, 4], GREEDY)
    run_all(tiny_engine)


def test_continuous_batching_admits_new_requests_mid_flight(tiny_engine: LLMEngine) -> None:
    ps = prompts(2, seed=9)
    expected = tiny_engine.generate(ps, GREEDY)
    tiny_engine.add_request("a", ps[0], GREEDY)
    early = [o for _ in range(4) for o in tiny_engine.step()]
    tiny_engine.add_request("b", ps[1], GREEDY)
    assert tiny_engine.stats().num_running == 1 and tiny_engine.stats().num_waiting == 1
    outs = run_all(tiny_engine)
    outs["a"] = early + outs["a"]
    got = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in outs}
    assert got == {"a": expected[0], "b": expected[1]}


def test_max_num_seqs_caps_the_running_batch(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_num_seqs=3)
    for i, p in enumerate(prompts(6, seed=10)):
        engine.add_request(str(i), p, GREEDY)
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        seen = max(seen, engine.stats().num_running)
    assert seen == 3


def test_long_prompt_is_chunked_under_the_token_budget(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_num_batched_tokens=32)
    engine.add_request("short", [5, 6, 7], GREEDY)
    engine.step()
    engine.add_request("long", list(range(1, 200)), GREEDY)
    # the running decode keeps producing a token every step while the long prompt fills in
    for _ in range(5):
        outs = {o.request_id: o for o in engine.step()}
        assert outs["short"].new_token_ids
    run_all(engine)


def test_requests_sharing_a_prompt_wait_for_its_blocks_instead_of_computing_them_again(
    make_engine: Callable[..., LLMEngine],
) -> None:
    system = prompts(1, seed=11, lo=70, hi=71)[0]  # four full blocks of 16 and a bit
    questions = [system + q for q in prompts(4, seed=12, lo=3, hi=9)]
    alone = [make_engine().generate([p], GREEDY)[0] for p in questions]
    engine = make_engine(max_num_batched_tokens=32)  # the shared prefix takes three steps to compute
    assert engine.generate(questions, GREEDY) == alone
    stats = engine.stats()
    assert stats.prefix_cache_hits == 3 * (len(system) // 16) * 16  # every later request read it
    n = [list(questions[0])] * 3  # the n choices of one request, added together
    fresh = make_engine()
    assert fresh.generate(n, GREEDY) == [alone[0]] * 3
    assert fresh.stats().prefix_cache_hits == 2 * ((len(n[0]) - 1) // 16) * 16


def test_unrelated_prompts_are_all_admitted_at_once(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    for i, p in enumerate(prompts(4, seed=13)):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    assert engine.stats().num_running == 4 and engine.stats().num_waiting == 0
    run_all(engine)


@pytest.mark.parametrize("limit", ["max_num_seqs", "max_num_batched_tokens", "block_size"])
def test_a_zero_batch_limit_or_block_size_is_refused(
    make_engine: Callable[..., LLMEngine], limit: str
) -> None:
    with pytest.raises(ValueError, match=limit):
        make_engine(**{limit: 0})


def test_a_block_size_the_cuda_kernel_cannot_tile_is_refused_before_loading(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """On CUDA the paged decode kernel needs a power-of-two block: 24 is refused by the constructor
    (before anything touches the GPU), not by an assertion that kills the engine at its first decode."""
    with pytest.raises(ValueError, match="block_size must be a power of two on CUDA, got 24"):
        make_engine(device="cuda", block_size=24)
