"""Weight-only int8 matmul: ``y = x @ (weight * scales[:, None]).T`` with int8 weights, one scale per output row.

Layout (shared with ``engine.quant.Int8Linear`` and ``torch._weight_int8pack_mm``): ``weight`` int8
``[N, K]``, ``scales`` ``[N]`` in the activation dtype. Decode (few rows of ``x``) runs a GEMV kernel that
streams each weight byte once; prefill runs a tiled GEMM on tensor cores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, jit, tl, use_triton

HAS_INT8PACK_MM = hasattr(torch.ops.aten, "_weight_int8pack_mm")
_INT8PACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CPU_COMPUTE_DTYPE = torch.bfloat16
GEMV_MAX_ROWS = 8  # up to this many rows of x, one weight pass per row beats tiling


def int8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)


def int8_matmul_cpu(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``torch._weight_int8pack_mm`` (vectorised, no dequantised copy) where this PyTorch has it.

    Its fast kernels take bf16/fp16 activations; fp32 ones hit a scalar path 10-40x slower than fp32
    ``F.linear``, so fp32 activations are rounded to bf16 for the product (cf. llama.cpp, which rounds
    them to int8) and the result is returned in fp32.
    """
    # PyTorch 2.13's CPU kernel returns garbage for bf16 when K % 16 != 0 (seen at K=200), so stay aligned
    # and its vector loads crash on weights not 64-byte aligned (e.g. views into a safetensors file)
    if not HAS_INT8PACK_MM or x.dtype not in _INT8PACK_DTYPES or x.shape[-1] % 16 or weight.data_ptr() % 64:
        return int8_matmul_ref(x, weight, scales)
    compute = x.dtype if x.dtype != torch.float32 else CPU_COMPUTE_DTYPE
    x2 = x.reshape(-1, x.shape[-1]).to(compute).contiguous()
    out = torch._weight_int8pack_mm(x2, weight, scales.to(compute))
    return out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)


@jit
def _int8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0,
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, (acc * s).to(out_ptr.dtype.element_ty), mask=n_mask)


@jit
def _int8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0,
        )
        acc += tl.dot(x, w.to(x.dtype))  # int8 values are exact in fp16/bf16/fp32
    s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        (acc * s[None, :]).to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def int8_matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, *, gemv: bool | None = None
) -> torch.Tensor:
    """``gemv=None`` picks the GEMV kernel for at most ``GEMV_MAX_ROWS`` rows of ``x``, else the GEMM."""
    N, K = weight.shape
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    assert weight.stride(1) == 1
    if gemv if gemv is not None else M <= GEMV_MAX_ROWS:
        BLOCK_N, BLOCK_K = 64, 128
        _int8_gemv_kernel[(M, cdiv(N, BLOCK_N))](
            x2,
            weight,
            scales,
            out,
            N,
            K,
            x2.stride(0),
            weight.stride(0),
            out.stride(0),
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
    else:
        BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64
        _int8_gemm_kernel[(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))](
            x2,
            weight,
            scales,
            out,
            M,
            N,
            K,
            x2.stride(0),
            weight.stride(0),
            out.stride(0),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
    return out.view(*x.shape[:-1], N)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K], scales [N]).T -> [..., N]`` on the best path for ``x``'s device."""
    if use_triton(x):
        return int8_matmul_triton(x, weight, scales)
    return int8_matmul_cpu(x, weight, scales)
