from __future__ import annotations

import pytest
import torch

from tests.kernels.checks import assert_close, skip_broken_bf16_dot
from weir.kernels.int8_matmul import (
    HAS_INT8PACK_MM,
    fbgemm_pack,
    fbgemm_supported,
    fbgemm_unpack,
    int8_dynamic_matmul_ref,
    int8_matmul,
    int8_matmul_cpu,
    int8_matmul_fbgemm,
    int8_matmul_ref,
    int8_matmul_triton,
)

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


needs_fbgemm = pytest.mark.skipif(not fbgemm_supported(), reason="fbgemm needs an x86 CPU with AVX2")


@needs_fbgemm
@pytest.mark.parametrize("m,n,k", [(1, 192, 576), (7, 96, 200), (40, 64, 128)])
def test_fbgemm_path_matches_its_reference(m: int, n: int, k: int) -> None:
    x, w, s = _operands(m, n, k, torch.float32)
    x[0, 3] = 50.0  # an outlier channel, as after SmolLM2's RMSNorm
    out = int8_matmul_fbgemm(x, fbgemm_pack(w, s))
    # the same integer products in float64: only the fp32 rounding of the result differs
    torch.testing.assert_close(out, int8_dynamic_matmul_ref(x, w, s), rtol=1e-5, atol=1e-4)


@needs_fbgemm
def test_fbgemm_activations_keep_about_13_bits() -> None:
    x, w, s = _operands(16, 128, 576, torch.float32)
    x[:, 7] *= 20  # one channel far above the others' RMS
    exact = int8_matmul_ref(x.double(), w, s.double())
    err = (int8_matmul_fbgemm(x, fbgemm_pack(w, s)).double() - exact).norm() / exact.norm()
    assert err < 2e-3  # 7 bits alone leave ~5e-2 on such rows


@needs_fbgemm
def test_fbgemm_rows_do_not_depend_on_their_batch() -> None:
    x, w, s = _operands(9, 96, 200, torch.float32)
    x[4] *= 1000  # a loud row must not change how the quiet ones are rounded
    packed = fbgemm_pack(w, s)
    batched = int8_matmul_fbgemm(x, packed)
    for i in range(x.shape[0]):
        assert torch.equal(int8_matmul_fbgemm(x[i : i + 1], packed), batched[i : i + 1])


@needs_fbgemm
def test_fbgemm_pack_round_trips_and_keeps_dtype_and_shape() -> None:
    x, w, s = _operands(6, 64, 128, torch.float32)
    packed = fbgemm_pack(w, s)
    w2, s2 = fbgemm_unpack(packed)
    assert torch.equal(w2, w) and torch.allclose(s2, s)
    out = int8_matmul_fbgemm(x.view(2, 3, 128).bfloat16(), packed)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    zero = int8_matmul_fbgemm(torch.zeros(2, 128), packed)
    assert torch.equal(zero, torch.zeros(2, 64))
