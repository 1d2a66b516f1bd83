from __future__ import annotations

import pytest
import torch

from kernels.int4_matmul import (
    CpuInt4Weight,
    cpu_int4_supported,
    dequantize_int4,
    int4_matmul,
    int4_matmul_ref,
    int4_matmul_triton,
    pack_int4,
    unpack_int4,
)
from tests.kernels.conftest import assert_close, skip_broken_bf16_dot

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _operands(m: int, n: int, k: int, group: int, dtype: torch.dtype):
    torch.manual_seed(m * 7 + n + k + group)
    kp = -(-k // group) * group
    qweight = pack_int4(torch.randint(0, 16, (n, kp), dtype=torch.uint8))
    scales = (torch.rand(n, kp // group) * 0.05 + 0.001).to(dtype)
    zeros = (torch.randn(n, kp // group) * 0.05).to(dtype)
    return torch.randn(m, k, dtype=dtype), qweight, scales, zeros


def test_pack_puts_even_k_in_low_nibble() -> None:
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_int4(packed), q)


def test_dequantise_uses_offset_eight_and_zero_point() -> None:
    qweight = pack_int4(torch.tensor([[8, 0, 15, 9]], dtype=torch.uint8))
    w = dequantize_int4(qweight, torch.tensor([[0.5, 2.0]]), torch.tensor([[1.0, -1.0]]), group_size=2)
    assert w.tolist() == [[1.0, -3.0, 13.0, 1.0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_matches_reference(dtype: torch.dtype, group: int, m: int) -> None:
    x, qw, s, z = _operands(m, 96, 200, group, dtype)  # K=200 is not a multiple of any group: padded
    expected = int4_matmul_ref(x.float(), qw, s.float(), z.float(), group)
    assert_close(int4_matmul_triton(x, qw, s, z, group, gemv=True), expected.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 128])
def test_gemm_matches_reference(dtype: torch.dtype, group: int, bf16_dot_ok: bool) -> None:
    skip_broken_bf16_dot(dtype, bf16_dot_ok)
    x, qw, s, z = _operands(40, 96, 200, group, dtype)
    expected = int4_matmul_ref(x.float(), qw, s.float(), z.float(), group)
    assert_close(int4_matmul_triton(x, qw, s, z, group, gemv=False), expected.to(dtype), dtype)


@pytest.mark.skipif(
    not cpu_int4_supported(64, torch.float32), reason="this PyTorch has no CPU int4pack kernel"
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 9])
def test_cpu_tinygemm_path_matches_reference_and_round_trips(dtype: torch.dtype, group: int, m: int) -> None:
    x, qw, s, z = _operands(m, 192, 576, group, dtype)
    expected = int4_matmul_ref(x.float(), qw, s.float(), z.float(), group)
    packed = CpuInt4Weight.from_canonical(qw, s, z, group, k=576)
    assert_close(packed.matmul(x), expected.to(dtype), dtype)
    back_qw, back_s, back_z = packed.to_canonical()
    assert torch.equal(back_qw, qw) and torch.equal(back_s, s) and torch.equal(back_z, z)


def test_dispatcher_on_cpu_is_the_reference() -> None:
    x, qw, s, z = _operands(2, 64, 128, 64, torch.float32)
    assert torch.equal(int4_matmul(x, qw, s, z, 64), int4_matmul_ref(x, qw, s, z, 64))
