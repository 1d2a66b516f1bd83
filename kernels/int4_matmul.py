"""Weight-only int4 matmul, group-wise asymmetric: ``w = (q - 8) * scale + zero`` for each group of K.

Layout (checkpoints, ``engine.quant.Int4Linear``, the Triton kernels; same maths as gpt-fast/tinygemm):
- ``qweight`` uint8 ``[N, Kp // 2]``: two 4-bit values per byte, even k in the low nibble, odd k in the
  high nibble; ``Kp`` is K rounded up to the group size (padding columns are never read against x).
- ``scales_and_zeros`` ``[Kp // group_size, N, 2]`` in the activation dtype: ``[..., 0]`` scale, ``[..., 1]`` zero.

On CPU, PyTorch's tinygemm port (``torch._weight_int4pack_mm_for_cpu``) wants the same tensor shapes with
its own nibble order (``to_cpu_layout``); ``from_cpu_layout`` recovers ours, so a model keeps one copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weir.kernels._triton import cdiv, jit, tl, use_triton

HAS_INT4PACK_CPU = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
    torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
)
CPU_COMPUTE_DTYPE = torch.bfloat16
GEMV_MAX_ROWS = 8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 15], shape ``[N, Kp]`` (Kp even) -> ``[N, Kp // 2]``."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def dequantize_int4(
    qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, k: int | None = None
) -> torch.Tensor:
    q = unpack_int4(qweight).to(scales_and_zeros.dtype)
    n, kp = q.shape
    scales, zeros = (t.t()[..., None] for t in scales_and_zeros.unbind(-1))  # [N, G, 1]
    w = (q.view(n, kp // group_size, group_size) - 8) * scales + zeros
    return w.reshape(n, kp)[:, : k or kp]


def int4_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    w = dequantize_int4(qweight, scales_and_zeros.float(), group_size, x.shape[-1])
    return F.linear(x, w.to(x.dtype))


def cpu_int4_supported(n: int, dtype: torch.dtype) -> bool:
    return HAS_INT4PACK_CPU and dtype in (torch.float32, torch.bfloat16, torch.float16) and n % 16 == 0


def to_cpu_layout(qweight: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight).to(torch.int32), 1)


def from_cpu_layout(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_cpu_layout``. The nibble order is PyTorch's private business, so rather than
    hard-code today's, learn the permutation by packing the bits of each element's own index, 4 at a time."""
    n, kp = packed.shape[0], packed.shape[1] * 2
    index = torch.arange(n * kp, dtype=torch.int64).view(n, kp)
    source = torch.zeros(n * kp, dtype=torch.int64)
    for shift in range(0, max(n * kp - 1, 1).bit_length(), 4):
        probe = torch.ops.aten._convert_weight_to_int4pack_for_cpu(((index >> shift) & 15).int(), 1)
        source |= torch.stack([probe & 15, probe >> 4], -1).flatten().long() << shift
    values = torch.empty(n * kp, dtype=torch.uint8)
    values[source] = torch.stack([packed & 15, packed >> 4], -1).flatten().cpu()
    return pack_int4(values.view(n, kp)).to(packed.device)


def int4_matmul_cpu(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """tinygemm on CPU; ``packed`` comes from ``to_cpu_layout``. As for int8, fp32 activations are
    rounded to bf16 for the product: the fp32 kernel is a scalar path 10-100x slower."""
    compute = x.dtype if x.dtype != torch.float32 else CPU_COMPUTE_DTYPE
    x2 = x.reshape(-1, x.shape[-1]).to(compute)
    kp = packed.shape[1] * 2
    if kp != x2.shape[1]:
        x2 = F.pad(x2, (0, kp - x2.shape[1]))
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2.contiguous(), packed, group_size, scales_and_zeros.to(compute)
    )
    return out.view(*x.shape[:-1], packed.shape[0]).to(x.dtype)


@jit
def _int4_gemv_kernel(
    x_ptr,
    qw_ptr,
    sz_ptr,
    out_ptr,
    N,
    K,
    KP,
    stride_xm,
    stride_qn,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, KP, BLOCK_K):  # BLOCK_K divides GROUP: one scale per row per step
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_j[None, :], mask=n_mask[:, None], other=0)
        lo = (b & 15).to(tl.float32) - 8.0
        hi = (b >> 4).to(tl.float32) - 8.0
        xe = tl.load(x_ptr + m * stride_xm + 2 * offs_j, mask=2 * offs_j < K, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + m * stride_xm + 2 * offs_j + 1, mask=2 * offs_j + 1 < K, other=0.0).to(
            tl.float32
        )
        g = k0 // GROUP
        s = tl.load(sz_ptr + g * stride_sg + 2 * offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(sz_ptr + g * stride_sg + 2 * offs_n + 1, mask=n_mask, other=0.0).to(tl.float32)
        # sum_k ((q-8)*s + z) * x  ==  s * sum_k (q-8)*x  +  z * sum_k x
        acc += s * tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1) + z * (tl.sum(xe) + tl.sum(xo))
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@jit
def _int4_gemm_kernel(
    x_ptr,
    qw_ptr,
    sz_ptr,
    out_ptr,
    M,
    N,
    K,
    KP,
    stride_xm,
    stride_qn,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(qw_ptr + offs_n[None, :] * stride_qn + offs_j[:, None], mask=n_mask[None, :], other=0)
        g = k0 // GROUP
        s = tl.load(sz_ptr + g * stride_sg + 2 * offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(sz_ptr + g * stride_sg + 2 * offs_n + 1, mask=n_mask, other=0.0).to(tl.float32)
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        xe = tl.load(
            x_rows + 2 * offs_j[None, :], mask=m_mask[:, None] & (2 * offs_j[None, :] < K), other=0.0
        )
        xo = tl.load(
            x_rows + 2 * offs_j[None, :] + 1, mask=m_mask[:, None] & (2 * offs_j[None, :] + 1 < K), other=0.0
        )
        # even and odd k as two half-width dots: no nibble interleave needed in registers
        w_lo = (((b & 15).to(tl.float32) - 8.0) * s[None, :] + z[None, :]).to(xe.dtype)
        w_hi = (((b >> 4).to(tl.float32) - 8.0) * s[None, :] + z[None, :]).to(xe.dtype)
        acc += tl.dot(xe, w_lo) + tl.dot(xo, w_hi)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def int4_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    *,
    gemv: bool | None = None,
) -> torch.Tensor:
    """``gemv=None`` picks the GEMV kernel for at most ``GEMV_MAX_ROWS`` rows of ``x``, else the GEMM."""
    N, KP = qweight.shape[0], qweight.shape[1] * 2
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    sz = scales_and_zeros.contiguous()
    block_k = min(group_size, 128)
    assert group_size % block_k == 0 and KP % group_size == 0 and qweight.stride(1) == 1
    common = (N, K, KP, x2.stride(0), qweight.stride(0), sz.stride(0), out.stride(0))
    if gemv if gemv is not None else M <= GEMV_MAX_ROWS:
        BLOCK_N = 64
        _int4_gemv_kernel[(M, cdiv(N, BLOCK_N))](
            x2, qweight, sz, out, *common, GROUP=group_size, BLOCK_N=BLOCK_N, BLOCK_K=block_k
        )
    else:
        BLOCK_M, BLOCK_N = 32, 64
        _int4_gemm_kernel[(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))](
            x2,
            qweight,
            sz,
            out,
            M,
            *common,
            GROUP=group_size,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=min(block_k, 64),
        )
    return out.view(*x.shape[:-1], N)


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x [..., K] @ dequant(int4 weight [N, K]).T`` for weights in our layout: Triton on CUDA, the
    reference elsewhere. On CPU, hold the weight in ``to_cpu_layout`` form and call ``int4_matmul_cpu``."""
    if use_triton(x):
        return int4_matmul_triton(x, qweight, scales_and_zeros, group_size)
    return int4_matmul_ref(x, qweight, scales_and_zeros, group_size)
