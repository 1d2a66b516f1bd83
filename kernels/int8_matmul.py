"""Weight-only int8 matmul: ``y = x @ (weight * scales[:, None]).T`` with int8 weights, one scale per output row.

Layout (shared with ``engine.quant.Int8Linear`` and ``torch._weight_int8pack_mm``): ``weight`` int8
``[N, K]``, ``scales`` ``[N]`` in the activation dtype. Decode (few rows of ``x``) runs a GEMV kernel that
streams each weight byte once; prefill runs a tiled GEMM on tensor cores. The same two Triton kernels
serve fp8 (e4m3) weights, passed as their bytes (``kernels/fp8_matmul.py``): only the byte -> float
conversion differs.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from weir.kernels._triton import cdiv, jit, tl, use_triton

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


# fbgemm's u8 x s8 kernels sum pairs of products in int16 on CPUs without VNNI (AVX2): with weights in
# [-127, 127], activations must stay within 7 bits (PyTorch's ``reduce_range``) or the sums saturate.
# 7 bits alone cost SmolLM2-135M 12% perplexity (its normed activations carry a channel ~20x their RMS),
# so each activation row goes in as two 7-bit rows of the same call, the rounded value and its
# remainder 63x magnified: ~13 bits per row, for one pass over the weight. Rows are scaled by their own
# absolute max first, so a row's result never depends on the other rows: the engine stays batch
# invariant, and the call's fixed quantization (scale 1, zero point 63) takes the rows as they are.
ACT_LEVELS = 63  # integer parts in [-63, 63]: with the zero point, fbgemm's reduced range [0, 126]
_ZERO_POINT = ACT_LEVELS


_FBGEMM_CPUS = ("AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability() values fbgemm runs on


@functools.cache
def fbgemm_supported() -> bool:
    """fbgemm's int8 kernels: x86 builds of PyTorch on CPUs with at least AVX2."""
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines and torch.backends.cpu.get_cpu_capability() in _FBGEMM_CPUS


def fbgemm_pack(weight: torch.Tensor, scales: torch.Tensor) -> Any:
    """``weight`` int8 ``[N, K]`` and per-row ``scales`` -> fbgemm's packed weight (its own copy)."""
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; the packing op is not
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(
            weight.cpu(), scales.double().cpu(), zero_points, 0
        )
    return torch.ops.quantized.linear_prepack(qweight, None)


def fbgemm_unpack(packed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    qweight, _ = torch.ops.quantized.linear_unpack(packed)
    return qweight.int_repr(), qweight.q_per_channel_scales().float()


def _split_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` float -> (``[2M, K]``: each row's integer part then remainder, in units of the
    fbgemm input; ``[M, 1]`` the factor back to ``x``'s units)."""
    m = x.shape[0]
    # abs + amax: vector_norm(inf) reduces rows 10-20x slower on CPU; the floor keeps x / factor
    # finite (an all-zero row then stays exactly zero)
    factor = x.abs().amax(-1, keepdim=True).clamp_min_(1e-30).div_(ACT_LEVELS)
    scaled = x / factor
    rows = torch.empty(2 * m, x.shape[1])
    torch.round(scaled, out=rows[:m])
    torch.sub(scaled, rows[:m], out=rows[m:]).mul_(ACT_LEVELS)
    return rows, factor


def _join_rows(y: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    m = y.shape[0] // 2
    return torch.add(y[:m], y[m:], alpha=1.0 / ACT_LEVELS).mul_(factor)


def int8_dynamic_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What ``int8_matmul_fbgemm`` computes, in float64 (the kernel's int32 sums are exact): each row of
    ``x`` as an integer part and a rounded remainder of its own absolute max, times the int8 weight."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    rows, factor = _split_rows(x2)
    y = torch.round(rows.double()) @ weight.double().T * scales.double()
    return _join_rows(y, factor.double()).view(*x.shape[:-1], weight.shape[0]).to(x.dtype)


def int8_matmul_fbgemm(x: torch.Tensor, packed: Any) -> torch.Tensor:
    """``x [..., K]`` (float, CPU) times an ``fbgemm_pack``ed weight; each row of ``x`` goes in as two
    7-bit rows (``_split_rows``), about 13 bits of its own absolute max."""
    rows, factor = _split_rows(x.reshape(-1, x.shape[-1]).float())
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(rows, 1.0, _ZERO_POINT, packed)
    y = _join_rows(y, factor)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


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
    W_FP8: tl.constexpr = False,
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
        )
        if W_FP8:  # bytes of e4m3 values (byte 0 is +0.0, so masked lanes stay zero)
            w = w.to(tl.float8e4nv, bitcast=True)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
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
    W_FP8: tl.constexpr = False,
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
        if W_FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        acc += tl.dot(x, w.to(x.dtype))  # int8 and e4m3 values are exact in fp16/bf16/fp32
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
    return matmul_8bit_triton(x, weight, scales, gemv=gemv, fp8=False)


def matmul_8bit_triton(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, *, gemv: bool | None, fp8: bool
) -> torch.Tensor:
    """``weight`` ``[N, K]``: int8 values, or with ``fp8`` the bytes of e4m3 values (uint8)."""
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
            W_FP8=fp8,
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
            W_FP8=fp8,
        )
    return out.view(*x.shape[:-1], N)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K], scales [N]).T -> [..., N]`` on the best path for ``x``'s device."""
    if use_triton(x):
        return int8_matmul_triton(x, weight, scales)
    return int8_matmul_cpu(x, weight, scales)
