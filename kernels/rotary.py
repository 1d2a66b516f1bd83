"""Rotary position embedding applied to query and key heads from a precomputed cos/sin table.

``cos_sin_cache`` ``[max_positions, rotary_dim]`` holds cos in the first half and sin in the second
(``build_cos_sin_cache``; RoPE scaling variants only change how the table is built). ``is_neox=True``
rotates the two halves of each head (Llama/HF layout); ``False`` rotates interleaved pairs (GPT-J, and
llama.cpp's un-permuted GGUF layout). The first ``rotary_dim`` channels rotate, the rest pass through.
"""

from __future__ import annotations

import torch

from weir.kernels._triton import jit, next_power_of_2, tl, use_triton


def build_cos_sin_cache(
    rotary_dim: int, max_positions: int, base: float = 10000.0, inv_freq: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 ``[max_positions, rotary_dim]`` table; pass ``inv_freq`` for scaled variants (Llama 3, YaRN)."""
    if inv_freq is None:
        inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq.double())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    xr, rest = x[..., :rot].float(), x[..., rot:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if is_neox:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, D]``, ``k [T, KVH, D]``, ``positions [T]`` -> rotated copies of q and k."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    return _rotate_ref(q, cos, sin, is_neox), _rotate_ref(k, cos, sin, is_neox)


@jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cache_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    head_dim,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs, mask=mask, other=1.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs, mask=mask, other=0.0)
    if IS_NEOX:
        i1 = offs
        i2 = offs + HALF
    else:
        i1 = 2 * offs
        i2 = 2 * offs + 1
    x_row = x_ptr + t * stride_xt + h * stride_xh
    o_row = out_ptr + t * stride_ot + h * stride_oh
    x1 = tl.load(x_row + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + i1, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + i2, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    # channels past the rotary dim (partial rotary) are copied through
    offs_d = 2 * HALF + tl.arange(0, BLOCK_D)
    rest = offs_d < head_dim
    tl.store(o_row + offs_d, tl.load(x_row + offs_d, mask=rest, other=0.0), mask=rest)


def _rotate_triton(
    x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    T, H, D = x.shape
    half = cache.shape[-1] // 2
    out = torch.empty_like(x)
    assert x.stride(-1) == 1 and cache.stride(-1) == 1
    _rotary_kernel[(T, H)](
        x,
        out,
        positions,
        cache,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(0),
        D,
        HALF=half,
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_D=next_power_of_2(max(D - 2 * half, 1)),
        IS_NEOX=is_neox,
    )
    return out


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    cache = cos_sin_cache.float().contiguous()
    return _rotate_triton(q, positions, cache, is_neox), _rotate_triton(k, positions, cache, is_neox)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)
