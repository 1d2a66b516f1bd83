"""Fused RMSNorm, optionally adding a residual first (one read of each input, one write of each output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weir.kernels._triton import jit, next_power_of_2, tl, use_triton


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x + residual) * weight``; with a residual also returns the sum, which is the next residual."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's own fused op; same maths as the reference."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:  # keep the fp32 accumulation of the reference for half types
        out = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return out if residual is None else (out, residual)


@jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # add in fp32, then round once to the storage dtype so the norm sees exactly the stored residual
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, shape[-1]) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.stride(-1) != 1 or res2.stride(-1) != 1:
        x2, res2 = x2.contiguous(), res2.contiguous()
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res2,
        weight,
        out,
        res_out,
        x2.stride(0),
        res2.stride(0),
        out.stride(0),
        res_out.stride(0),
        shape[-1],
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=next_power_of_2(shape[-1]),
    )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim. ``residual`` given: returns ``(norm(x + residual), x + residual)``."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_cpu(x, weight, eps, residual)
