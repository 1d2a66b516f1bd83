"""Decode attention over a paged KV cache: one new query token per sequence, keys and values in blocks.

Layout (the engine's KV cache contract): per layer ``k_cache``/``v_cache`` ``[num_blocks, block_size,
num_kv_heads, head_dim]``; ``block_tables`` int32 ``[batch, max_blocks_per_seq]`` padded with -1;
``context_lens`` int32 ``[batch]`` counting the current token, whose K/V must already be in the cache.
Queries ``[batch, num_heads, head_dim]``; grouped-query attention when ``num_heads > num_kv_heads``.
"""

from __future__ import annotations

import math

import torch

from weir.kernels._triton import jit, next_power_of_2, tl, use_triton


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One sequence at a time: gather its blocks, then plain softmax attention in fp32."""
    B, H, D = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, D)[:n].float().repeat_interleave(H // kv_heads, dim=1)
        v = v_cache[blocks].reshape(-1, kv_heads, D)[:n].float().repeat_interleave(H // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float() * scale, k)
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The whole batch at once: gather every table slot, mask past each context, no Python loop."""
    B, H, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    max_len = int(context_lens.max())
    tables = block_tables[:, : -(-max_len // block_size)].clamp(min=0).long()
    k = k_cache[tables].view(B, -1, kv_heads, D)[:, :max_len]  # [B, T, KVH, D]
    v = v_cache[tables].view(B, -1, kv_heads, D)[:, :max_len]
    qg = q.view(B, kv_heads, H // kv_heads, D)
    scores = torch.einsum("bhgd,bthd->bhgt", qg.float() * scale, k.float())
    past_end = torch.arange(max_len, device=q.device)[None, :] >= context_lens[:, None].long()
    scores.masked_fill_(past_end[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(-1), v.float())
    return out.reshape(B, H, D).to(q.dtype)


@jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    ctx_ptr,
    out_ptr,
    scale,
    head_dim,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_btb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (sequence, kv head): each K/V block is read once for all query heads sharing it.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    offs_g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_g
    h_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    offs_t = tl.arange(0, BLOCK_SIZE)
    q = (
        tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        * scale
    )
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for i in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
        block = tl.load(bt_ptr + b * stride_btb + i).to(tl.int64)
        t_mask = i * BLOCK_SIZE + offs_t < ctx
        kv_off = block * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_H, BLOCK_SIZE]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & d_mask[None, :],
    )


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    B, H, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    group = H // kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(B, kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale if scale is not None else 1.0 / math.sqrt(D),
        D,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_H=next_power_of_2(group),
        BLOCK_SIZE=block_size,
        BLOCK_D=next_power_of_2(D),
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q . K^T * scale) V`` over each sequence's first ``context_lens[b]`` cached tokens."""
    if use_triton(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale)
