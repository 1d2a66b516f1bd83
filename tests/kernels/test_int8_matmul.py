from __future__ import annotations

import pytest
import torch

from kernels.int8_matmul import (
    HAS_INT8PACK_MM,
    int8_matmul,
    int8_matmul_cpu,
    int8_matmul_ref,
    int8_matmul_triton,
)
from tests.kernels.conftest import assert_close, skip_broken_bf16_dot

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _operands(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, dtype=dtype)
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n) * 0.02 + 0.001).to(dtype)
    return x, weight, scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n,k", [(96, 200), (64, 128)])
def test_gemv_matches_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    x, w, s = _operands(m, n, k, dtype)
    expected = int8_matmul_ref(x.float(), w, s.float())
    assert_close(int8_matmul_triton(x, w, s, gemv=True), expected.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [5, 40])
def test_gemm_matches_reference(dtype: torch.dtype, m: int, bf16_dot_ok: bool) -> None:
    skip_broken_bf16_dot(dtype, bf16_dot_ok)
    x, w, s = _operands(m, 96, 200, dtype)
    expected = int8_matmul_ref(x.float(), w, s.float())
    assert_close(int8_matmul_triton(x, w, s, gemv=False), expected.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 576), (7, 576), (3, 200)])
def test_cpu_path_matches_reference(dtype: torch.dtype, m: int, k: int) -> None:
    x, w, s = _operands(m, 192, k, dtype)
    expected = int8_matmul_ref(x.float(), w, s.float())
    out = int8_matmul_cpu(x, w, s)
    assert out.dtype == dtype
    # fp32 activations go through the kernel in bf16 (its fp32 path is scalar): bf16 tolerance applies
    fast = HAS_INT8PACK_MM and k % 16 == 0
    assert_close(
        out.to(torch.bfloat16) if fast else out,
        expected.to(out.dtype if not fast else torch.bfloat16),
        torch.bfloat16 if fast else dtype,
    )


def test_reference_dequantises_per_output_row() -> None:
    w = torch.tensor([[1, -2], [127, 0]], dtype=torch.int8)
    s = torch.tensor([0.5, 0.1])
    x = torch.tensor([[2.0, 1.0]])
    assert torch.allclose(int8_matmul_ref(x, w, s), torch.tensor([[0.0, 25.4]]))


def test_dispatcher_keeps_leading_dims() -> None:
    x, w, s = _operands(6, 64, 128, torch.float32)
    out = int8_matmul(x.view(2, 3, 128), w, s)
    assert out.shape == (2, 3, 64)
    assert torch.equal(out.view(6, 64), int8_matmul_cpu(x, w, s))
