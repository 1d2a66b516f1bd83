from __future__ import annotations

import pytest
import torch

from tests.kernels.checks import assert_close
from weir.kernels.rms_norm import rms_norm, rms_norm_cpu, rms_norm_ref, rms_norm_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, hidden, dtype=dtype) * 3
    w = torch.randn(hidden, dtype=dtype)
    expected = rms_norm_ref(x, w, 1e-6)
    assert_close(rms_norm_triton(x, w, 1e-6), expected, dtype)
    assert_close(rms_norm_cpu(x, w, 1e-6), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_returns_norm_of_sum_and_the_sum(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x, residual = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    w = torch.rand(96, dtype=dtype) + 0.5
    out, new_residual = rms_norm_triton(x, w, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, w, 1e-5, residual)
    assert_close(new_residual, x + residual, dtype)
    assert_close(new_residual, ref_residual, dtype)
    assert_close(out, ref_out, dtype)
    cpu_out, cpu_residual = rms_norm_cpu(x, w, 1e-5, residual)
    assert_close(cpu_out, ref_out, dtype)
    assert torch.equal(cpu_residual, ref_residual)


def test_reference_is_rms_norm() -> None:
    x = torch.tensor([[3.0, 4.0]])
    # rms = sqrt((9 + 16) / 2); weight doubles channel 1
    assert torch.allclose(
        rms_norm_ref(x, torch.tensor([1.0, 2.0]), 0.0), x / (12.5**0.5) * torch.tensor([1.0, 2.0])
    )


def test_dispatcher_uses_pytorch_on_cpu() -> None:
    x, w = torch.randn(4, 64), torch.randn(64)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_cpu(x, w, 1e-6))
