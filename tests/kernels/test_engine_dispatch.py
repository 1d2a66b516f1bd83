"""The engine's forward reaches the Triton kernels when tensors live on CUDA.

No GPU here: ``triton_on_cpu()`` makes the dispatch rule treat CPU tensors as CUDA ones while the
interpreter runs (``TRITON_INTERPRET=1``, set by this package's conftest), so the same code path the
engine takes on a GPU runs on tiny shapes and is compared with the CPU path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import engine.model as model_mod
import weir.kernels.int4_matmul as int4_mod
import weir.kernels.int8_matmul as int8_mod
from engine.config import tiny_config
from engine.llm_engine import LLMEngine
from engine.quant import Int4Linear, Int8Linear, quantize_model
from tests.kernels.checks import prompt_logprobs_and_tokens
from weir.kernels._triton import interpreting, triton_on_cpu, use_triton

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

PROMPT = [(5 * i + 1) % 256 for i in range(6)]  # short: the interpreter runs every program in Python


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, calls: Counter[str]) -> None:
    original: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def _logprobs(engine: LLMEngine) -> tuple[torch.Tensor, list[int]]:
    """Prompt log-probs (prefill) and two greedy tokens (the second from a decode step)."""
    return prompt_logprobs_and_tokens(engine, PROMPT, 2)


def test_use_triton_only_for_cuda_unless_forced() -> None:
    x = torch.zeros(2)
    assert not use_triton(x)
    with triton_on_cpu():
        assert use_triton(x)
    assert not use_triton(x)


@pytest.mark.slow  # ~10 s of interpreted kernels on an idle 2-core machine
def test_engine_forward_runs_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # no fused CPU decode step: on CUDA, which this emulates, the engine never builds one
    engine = LLMEngine.from_config(tiny_config(), seed=0, num_kv_blocks=32, fused_decode="off")
    quantize_model(engine.model, "int4-g32")  # int4 body, int8 head: both quantized kernels
    expected_lps, expected_tokens = _logprobs(engine)

    calls: Counter[str] = Counter()
    _spy(monkeypatch, model_mod, "rms_norm_triton", calls)
    _spy(monkeypatch, model_mod, "paged_decode_attention_triton", calls)
    _spy(monkeypatch, int8_mod, "int8_matmul_triton", calls)
    _spy(monkeypatch, int4_mod, "int4_matmul_triton", calls)
    with triton_on_cpu():
        got_lps, got_tokens = _logprobs(engine)

    layers = tiny_config().num_layers
    assert calls["rms_norm_triton"] == 2 * (2 * layers + 1)  # every norm of the prefill and the decode
    assert calls["paged_decode_attention_triton"] == layers  # the decode step, not the prefill
    assert calls["int4_matmul_triton"] == 2 * 4 * layers  # qkv, o, gate_up, down
    assert calls["int8_matmul_triton"] >= 2  # the head
    assert not any(m.cpu_layout for m in engine.model.modules() if isinstance(m, Int4Linear | Int8Linear))
    # the CPU path rounds activations to bf16 (int4) and to ~13 bits per row (int8 on fbgemm) for its
    # packed kernels; the Triton path stays fp32
    assert (got_lps - expected_lps).abs().max().item() < 0.05
    assert got_tokens == expected_tokens
