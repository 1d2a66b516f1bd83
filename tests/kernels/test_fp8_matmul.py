"""fp8 (e4m3) weight-only matmul: the Triton GEMV/GEMM (run by the interpreter) against the reference,
the quantizer's error bound, and ``Fp8Linear`` through ``quantize_model`` and a checkpoint."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from engine.config import tiny_config
from engine.llm_engine import LLMEngine
from engine.model import Transformer
from engine.quant import Fp8Linear, build_quantized_model, config_metadata, quantize_model, save_quantized
from tests.kernels.checks import assert_close, prompt_logprobs_and_tokens, skip_broken_bf16_dot
from weir.kernels.fp8_matmul import (
    FP8_MAX,
    dequantize_fp8,
    fp8_matmul,
    fp8_matmul_ref,
    fp8_matmul_triton,
    quantize_fp8,
)


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # rows of different ranges
    q, s = quantize_fp8(w)
    return w, q, s


def test_quantize_fp8_layout_and_error_bound() -> None:
    w, q, s = _weights(48, 96)
    assert q.dtype == torch.uint8 and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (48,)
    back = dequantize_fp8(q, s, torch.float32)
    # each row's absolute max lands on 448 exactly; e4m3 keeps 3 mantissa bits: relative error <= 2^-4
    assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=1e-6)
    assert (q.view(torch.float8_e4m3fn).float().abs().amax(1) == FP8_MAX).all()
    err = (back - w).abs()
    assert (err <= w.abs() * 2**-4 + s[:, None] * 2**-9).all()  # (the floor: e4m3's subnormal step)
    zero_q, zero_s = quantize_fp8(torch.zeros(2, 8))
    assert dequantize_fp8(zero_q, zero_s, torch.float32).abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 160), (3, 70, 200)])
def test_gemv_matches_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    _, q, s = _weights(n, k, seed=m)
    x = torch.randn(m, k).to(dtype)
    assert_close(fp8_matmul_triton(x, q, s, gemv=True), fp8_matmul_ref(x, q, s), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gemm_matches_reference(dtype: torch.dtype, bf16_dot_ok: bool) -> None:
    skip_broken_bf16_dot(dtype, bf16_dot_ok)
    _, q, s = _weights(80, 136, seed=5)
    x = torch.randn(40, 136).to(dtype)
    assert_close(fp8_matmul_triton(x, q, s, gemv=False), fp8_matmul_ref(x, q, s), dtype)


def test_cpu_dispatch_is_the_reference_and_keeps_leading_dims() -> None:
    _, q, s = _weights(24, 32)
    x = torch.randn(2, 3, 32)
    got = fp8_matmul(x, q, s)
    assert got.shape == (2, 3, 24)
    assert torch.equal(got, fp8_matmul_ref(x.reshape(6, 32), q, s).view(2, 3, 24))


def test_quantized_model_stays_close_and_survives_dtype_and_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    reference = copy.deepcopy(model)
    quantize_model(model, "fp8")
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 4 * tiny_config().num_layers + 1  # qkv, o, gate_up, down, and the head
    assert model.quantized_modules["lm_head"] == "fp8"  # fp8 is fine for the head: no int8 override
    x = torch.randn(4, tiny_config().hidden_size)
    for name in ("layers.0.mlp.gate_up_proj", "lm_head"):
        want = reference.get_submodule(name)(x)
        got = model.get_submodule(name)(x)
        assert (got - want).abs().max() <= 0.07 * want.abs().max()  # e4m3: <= 2^-4 relative per weight
    model.to(torch.bfloat16)  # a dtype change must not cast the e4m3 bytes
    assert all(m.weight.dtype == torch.uint8 for m in linears)
    model.float()
    save_quantized(model, tmp_path, metadata=config_metadata(model))
    loaded = build_quantized_model(tmp_path)
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            other = loaded.get_submodule(name)
            assert isinstance(other, Fp8Linear)
            assert torch.equal(other.weight, module.weight) and torch.equal(other.scales, module.scales)


def test_fp8_engine_greedy_follows_fp32() -> None:
    prompt = [(7 * i + 3) % 256 for i in range(12)]

    def run(quantization: str) -> tuple[torch.Tensor, list[int]]:
        engine = LLMEngine.from_config(tiny_config(), seed=0, num_kv_blocks=16)
        quantize_model(engine.model, quantization)  # the engine refuses fp8 on CPU; the module swap does not
        return prompt_logprobs_and_tokens(engine, prompt, 8)

    fp_lps, fp_tokens = run("none")
    q_lps, q_tokens = run("fp8")
    i8_lps, _ = run("int8")
    assert len(q_lps) == len(prompt) - 1
    # the tiny random model's log-probs reach -12; e4m3 keeps ~4 bits less than int8, not more
    assert ((q_lps - fp_lps).abs() <= 0.03 * fp_lps.abs() + 0.02).all()
    assert (q_lps - fp_lps).abs().mean() <= 8 * (i8_lps - fp_lps).abs().mean() + 0.01
    assert q_tokens[:4] == fp_tokens[:4]


def test_engine_refuses_fp8_without_a_gpu_that_has_it() -> None:
    with pytest.raises(ValueError, match=r"compute capability 8\.9"):
        LLMEngine.from_config(tiny_config(), seed=0, num_kv_blocks=16, quantization="fp8")
