"""What the kernel tests compare by and skip on: `assert_close` (tolerances per dtype),
`skip_broken_bf16_dot`, and `prompt_logprobs_and_tokens` (an engine's prefill log-probs and greedy
tokens)."""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

# Tolerances per dtype, relative to the largest reference magnitude. fp32: summation order only. fp16:
# one rounding of each output plus fp16 products. bf16: the interpreter rounds fp32 -> bf16 by
# truncation where PyTorch rounds to nearest, so allow two bf16 ulps (2 * 2^-8).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == dtype
    err = (actual.float() - expected.float()).abs().max().item()
    scale = max(expected.float().abs().max().item(), 1.0)
    assert err <= TOLERANCE[dtype] * scale, (
        f"max error {err:.3g} > {TOLERANCE[dtype]} * {scale:.3g} ({dtype})"
    )


def skip_broken_bf16_dot(dtype: torch.dtype, ok: bool) -> None:
    """Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly (errors ~1e10 on a 16x16
    product; fp16 and fp32 are exact), so the tensor-core GEMM paths can only be checked in bf16 on a GPU
    (benchmarks/gpu_kernels.py does). Re-enables itself once the interpreter is fixed."""
    if dtype == torch.bfloat16 and not ok:
        pytest.skip("Triton interpreter's bf16 tl.dot is broken; checked on GPU by benchmarks/gpu_kernels.py")


def prompt_logprobs_and_tokens(
    engine: LLMEngine, prompt: list[int], max_tokens: int
) -> tuple[torch.Tensor, list[int]]:
    """The prompt's log-probs (the prefill) and `max_tokens` greedy tokens (the later ones decodes)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    engine.add_request("r", prompt, params)
    lps, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lps = out.prompt_logprobs or lps
            tokens += out.new_token_ids
    assert lps is not None
    return torch.tensor([lp.logprob for lp in lps[1:]]), tokens
