from __future__ import annotations

import pytest
import torch

from tests.kernels.checks import assert_close, skip_broken_bf16_dot
from weir.kernels.int4_matmul import (
    cpu_int4_supported,
    dequantize_int4,
    from_cpu_layout,
    int4_matmul,
    int4_matmul_cpu,
    int4_matmul_ref,
    int4_matmul_triton,
    pack_int4,
    to_cpu_layout,
    unpack_int4,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _operands(m: int, n: int, k: int, group: int, dtype: torch.dtype):
    torch.manual_seed(m * 7 + n + k + group)
    kp = -(-k // group) * group
    qweight = pack_int4(torch.randint(0, 16, (n, kp), dtype=torch.uint8))
    scales = torch.rand(kp // group, n) * 0.05 + 0.001
    zeros = torch.randn(kp // group, n) * 0.05
    return torch.randn(m, k, dtype=dtype), qweight, torch.stack([scales, zeros], -1).to(dtype)


def test_pack_puts_even_k_in_low_nibble() -> None:
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_int4(packed), q)


def test_dequantise_uses_offset_eight_and_zero_point() -> None:
    qweight = pack_int4(torch.tensor([[8, 0, 15, 9]], dtype=torch.uint8))
    scales_and_zeros = torch.tensor([[[0.5, 1.0]], [[2.0, -1.0]]])  # [groups=2, N=1, (scale, zero)]
    w = dequantize_int4(qweight, scales_and_zeros, group_size=2)
    assert w.tolist() == [[1.0, -3.0, 13.0, 1.0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_matches_reference(dtype: torch.dtype, group: int, m: int) -> None:
    x, qw, sz = _operands(m, 96, 200, group, dtype)  # K=200 is not a multiple of any group: padded
    expected = int4_matmul_ref(x.float(), qw, sz.float(), group)
    assert_close(int4_matmul_triton(x, qw, sz, group, gemv=True), expected.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 128])
def test_gemm_matches_reference(dtype: torch.dtype, group: int, bf16_dot_ok: bool) -> None:
    skip_broken_bf16_dot(dtype, bf16_dot_ok)
    x, qw, sz = _operands(40, 96, 200, group, dtype)
    expected = int4_matmul_ref(x.float(), qw, sz.float(), group)
    assert_close(int4_matmul_triton(x, qw, sz, group, gemv=False), expected.to(dtype), dtype)


@pytest.mark.skipif(
    not cpu_int4_supported(64, torch.float32), reason="this PyTorch has no CPU int4pack kernel"
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 9])
def test_cpu_tinygemm_path_matches_reference_and_round_trips(dtype: torch.dtype, group: int, m: int) -> None:
    x, qw, sz = _operands(m, 192, 576, group, dtype)
    expected = int4_matmul_ref(x.float(), qw, sz.float(), group)
    packed = to_cpu_layout(qw)
    assert packed.shape == qw.shape and not torch.equal(packed, qw)
    out = int4_matmul_cpu(x, packed, sz, group)
    assert out.dtype == dtype
    # fp32 activations go through tinygemm in bf16 (its fp32 path is scalar): bf16 tolerance applies
    assert_close(out.to(torch.bfloat16), expected.to(torch.bfloat16), torch.bfloat16)
    assert torch.equal(from_cpu_layout(packed), qw)


def test_dispatcher_on_cpu_is_the_reference() -> None:
    x, qw, sz = _operands(2, 64, 128, 64, torch.float32)
    assert torch.equal(int4_matmul(x, qw, sz, 64), int4_matmul_ref(x, qw, sz, 64))
