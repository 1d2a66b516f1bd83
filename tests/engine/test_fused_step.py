"""The engine's use of the fused CPU decode step (engine/fused_step.py): when it runs, that it changes
no output, and that it follows the model's weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.fused_step import FusedDecoder
from engine.llm_engine import LLMEngine
from engine.quant import quantize_model
from engine.sampling import SamplingParams
from weir.kernels import cpu_decode

pytestmark = pytest.mark.skipif(cpu_decode.library() is None, reason="no C compiler to build the step")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 17, 40))]


def _count_fused_calls(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = FusedDecoder.__call__

    def counted(self: FusedDecoder, *args: Any) -> torch.Tensor:
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(FusedDecoder, "__call__", counted)
    return calls


def test_lone_streams_take_the_fused_step_and_get_the_same_tokens(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    fused, eager = make_engine(fused_decode="on"), make_engine(fused_decode="off")
    assert eager.runner.fused is None
    calls = _count_fused_calls(fused, monkeypatch)
    for prompt in PROMPTS:  # one at a time: every decode step has one sequence
        assert fused.generate([prompt], GREEDY) == eager.generate([prompt], GREEDY)
    # every token but the first of each request comes from a decode step
    assert calls[0] == len(PROMPTS) * (GREEDY.max_tokens - 1)


def test_small_batches_take_it_and_large_ones_stay_eager(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # no prefix cache: a hit that leaves one prompt token to compute is a one-token step the fused
    # step serves too, which would blur the counts
    engine = make_engine(fused_decode="on", enable_prefix_caching=False)
    eager = make_engine(fused_decode="off", enable_prefix_caching=False)
    calls = _count_fused_calls(engine, monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    together = engine.generate(PROMPTS, params)
    assert calls[0] == 7  # the three decode together: one fused call per step
    assert together == eager.generate(PROMPTS, params)
    engine.runner.fused_max_batch = 2
    assert engine.generate(PROMPTS, params) == together
    assert calls[0] == 7  # three sequences, more than the cap: the eager forward
    alone = [engine.generate([p], params)[0] for p in PROMPTS]
    assert calls[0] == 7 + len(PROMPTS) * 7
    assert alone == together  # batch invariance across the paths (float32)


def test_sampling_and_logprobs_read_the_fused_logits(make_engine: Callable[..., LLMEngine]) -> None:
    fused, eager = make_engine(fused_decode="on"), make_engine(fused_decode="off")
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, logprobs=3, ignore_eos=True)
    results = []
    for engine in (fused, eager):
        engine.add_request("r", PROMPTS[1], params)
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        results.append(outs)
    got = [t for o in results[0] for t in o.new_token_ids]
    want = [t for o in results[1] for t in o.new_token_ids]
    assert got == want
    got_lp = [lp for o in results[0] for lp in (o.new_logprobs or [])]
    want_lp = [lp for o in results[1] for lp in (o.new_logprobs or [])]
    assert len(got_lp) == len(want_lp) == 12
    for a, b in zip(got_lp, want_lp, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_the_step_follows_a_swap_of_the_model_weights(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(fused_decode="auto")
    first = engine.runner.fused
    assert first is not None and first.layers[0].qkv.type == cpu_decode.F32
    quantize_model(engine.model, "int8")
    expected = make_engine(quantization="int8", fused_decode="off").generate([PROMPTS[1]], GREEDY)
    assert engine.generate([PROMPTS[1]], GREEDY) == expected
    rebuilt = engine.runner.fused
    assert rebuilt is not None and rebuilt is not first and rebuilt.layers[0].qkv.type == cpu_decode.I8


def test_int4_engine_takes_the_fused_step(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(quantization="int4-g32", fused_decode="on")
    assert engine.runner.fused is not None and engine.runner.fused.layers[0].qkv.type == cpu_decode.I4
    calls = _count_fused_calls(engine, monkeypatch)
    tokens = engine.generate([PROMPTS[2]], GREEDY)[0]
    assert calls[0] == GREEDY.max_tokens - 1
    # the eager int4 path rounds activations to bf16, so tokens may part after a near tie; the first
    # few, decided by clear margins on this seed, agree
    eager = make_engine(quantization="int4-g32", fused_decode="off").generate([PROMPTS[2]], GREEDY)
    assert tokens[:4] == eager[0][:4]


def test_unsupported_models_fall_back_or_refuse(make_engine: Callable[..., LLMEngine]) -> None:
    assert make_engine(dtype="float16", fused_decode="auto").runner.fused is None  # eager
    with pytest.raises(ValueError, match=r"torch\.float16 models are not supported"):
        make_engine(dtype="float16", fused_decode="on")
    with pytest.raises(ValueError, match="fused_decode must be one of"):
        make_engine(fused_decode="yes")


def test_no_compiler_means_the_eager_path(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("WEIR_CACHE_DIR", str(tmp_path))  # nothing cached there to fall back on
    cpu_decode.library.cache_clear()
    try:
        assert cpu_decode.library() is None
        engine = make_engine(fused_decode="auto")
        assert engine.runner.fused is None
        assert engine.generate([PROMPTS[0]], GREEDY)  # still serves
        with pytest.raises(ValueError, match="could not be compiled"):
            make_engine(fused_decode="on")
    finally:
        cpu_decode.library.cache_clear()
