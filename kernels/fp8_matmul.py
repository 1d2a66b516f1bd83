"""Weight-only fp8 matmul: ``y = x @ (fp8(weight) * scales[:, None]).T``, one scale per output row.

Weights are e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, largest value 448), stored
as their bytes (``uint8 [N, K]``) so that ``Module.to(dtype)`` and checkpoints never convert them: torch
counts fp8 as a floating-point dtype and would cast the weight to the model's dtype with everything
else. The scale maps each row's absolute max onto 448. Every e4m3 value is exact in fp16, bf16 and
fp32, so the kernels convert bytes to the activation dtype in registers and reuse the int8 GEMV/GEMM
(``kernels/int8_matmul.py``).

The fast path is Triton on GPUs with fp8 conversion in hardware (compute capability 8.9+: Ada, Hopper
and later). Elsewhere ``fp8_matmul`` runs the reference, which dequantises the whole weight per call:
right, and fine for measuring quality on a CPU, but slower than not quantizing at all.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from weir.kernels._triton import interpreting, use_triton
from weir.kernels.int8_matmul import matmul_8bit_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
MIN_CAPABILITY = (8, 9)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` float -> (e4m3 bytes ``uint8 [N, K]``, fp32 ``scales [N]``), round to nearest."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX  # an all-zero row stays zero
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(torch.uint8), scales


def dequantize_fp8(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.view(FP8_DTYPE).to(torch.float32) * scales.float()[:, None]).to(dtype)


def fp8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the kernels compute, in fp32: the e4m3 values times ``x``, one scale per output row after."""
    y = F.linear(x.float(), weight.view(FP8_DTYPE).float()) * scales.float()
    return y.to(x.dtype)


def fp8_gpu(device: torch.device | str) -> bool:
    """A CUDA device with fp8 conversion in hardware (compute capability 8.9+): where fp8 runs fast."""
    device = torch.device(device)
    return device.type == "cuda" and _capable(device.index)


def fp8_triton_supported(device: torch.device) -> bool:
    """Triton's fp8 kernels: an `fp8_gpu`, or the CPU under the interpreter (tests)."""
    return interpreting() if device.type == "cpu" else fp8_gpu(device)


@functools.cache
def _capable(index: int | None) -> bool:  # asked on every forward: the capability is looked up once
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def fp8_matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, *, gemv: bool | None = None
) -> torch.Tensor:
    return matmul_8bit_triton(x, weight, scales, gemv=gemv, fp8=True)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K] e4m3 bytes, scales [N]).T -> [..., N]``."""
    if use_triton(x) and fp8_triton_supported(x.device):
        return fp8_matmul_triton(x, weight, scales)
    return fp8_matmul_ref(x, weight, scales)
