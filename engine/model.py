"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2): RMSNorm, RoPE with scaling, GQA, SwiGLU.

The model reads and writes a paged KV cache. Attention metadata for the current step (positions, slot
mapping, block tables) lives in one module-level `AttentionMetadata` set by the runner before each
forward, so `forward` signatures stay plain (as in nano-vllm).

Token layout of a step: the D decode tokens come first (one per sequence), then each prefill chunk's
tokens, contiguous. Decodes run as one padded batched attention; each prefill chunk runs alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine import hugepages
from engine.config import ModelConfig
from weir.kernels import cpu_ops
from weir.kernels._triton import use_triton
from weir.kernels.paged_attention import paged_decode_attention_triton
from weir.kernels.rms_norm import rms_norm_triton


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's first token in the step's flat token batch
    length: int  # number of new tokens
    context_len: int  # tokens in the KV cache after this chunk (cached prefix + chunk)
    block_table: torch.Tensor  # int32 [num_blocks] of this sequence
    _mask: torch.Tensor | None = None

    def causal_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive mask [length, context_len] (0 or -inf, in `dtype`) of a chunk after a cached prefix:
        row i sees positions up to its own. Computed on first use and shared by every layer: built per
        layer as a boolean mask, which SDPA turns into this one each time, it was 4% of a 1,024-token
        bf16 prefill (aten::le + aten::where); the output is the same."""
        if self._mask is None:
            rows = torch.arange(self.length, device=device).unsqueeze(1) + (self.context_len - self.length)
            hidden = torch.arange(self.context_len, device=device).unsqueeze(0) > rows
            self._mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(
                hidden, float("-inf")
            )
        return self._mask


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block * block_size + offset
    num_decodes: int  # the first num_decodes tokens are single-token decodes
    block_tables: torch.Tensor | None  # int32 [num_decodes, max_blocks_per_seq], padded with -1
    context_lens: torch.Tensor | None  # int32 [num_decodes]
    max_context_len: int
    prefills: list[PrefillChunk]
    block_size: int
    _decode_cache: tuple[torch.Tensor, torch.Tensor | None] | None = None
    _rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def decode_gather(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat block ids [D * max_blocks] and additive padding mask [D, 1, 1, L] in `dtype` (0 or -inf;
        None if nothing is padded) of the decodes; computed on first use and shared by every layer. CPU
        SDPA would turn a boolean mask into this in every layer (aten::where + to: ~4% of the op time of
        a 32-sequence decode step in a profile); the output is the same."""
        if self._decode_cache is None:
            assert self.block_tables is not None and self.context_lens is not None
            ids = self.block_tables.clamp(min=0).long().reshape(-1)
            length = self.max_context_len
            mask = None
            if bool((self.context_lens != length).any()):
                pad = torch.arange(length, device=ids.device).unsqueeze(0) >= self.context_lens.unsqueeze(1)
                mask = torch.zeros(pad.shape, dtype=dtype, device=ids.device).masked_fill_(pad, float("-inf"))
                mask = mask[:, None, None, :]
            self._decode_cache = (ids, mask)
        return self._decode_cache


_metadata: AttentionMetadata | None = None


@contextmanager
def attention_metadata(meta: AttentionMetadata) -> Iterator[None]:
    global _metadata
    _metadata = meta
    try:
        yield
    finally:
        _metadata = None


def get_attention_metadata() -> AttentionMetadata:
    if _metadata is None:
        raise RuntimeError("model forward called outside attention_metadata()")
    return _metadata


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] + block ids [..., nb] -> [..., length, kvh, d] laid out by position.
    Padding ids (-1) read block 0; callers mask those positions."""
    ids = block_table.clamp(min=0).long()
    blocks = cache.index_select(0, ids.reshape(-1))  # index_select: far cheaper than fancy indexing on CPU
    blocks = blocks.view(*ids.shape[:-1], ids.shape[-1] * cache.shape[1], *cache.shape[2:])
    return blocks[..., :length, :, :]


# Decode attention over at most this many (sequence x context) positions runs on one thread. Measured on
# 2 threads, bf16 SmolLM2, ~150-token contexts: one thread is faster for 4-8 sequences (88.7 vs 76.8 and
# 175 vs 152 tok/s), even at 16, and slower at 32 (306 vs 398 tok/s).
_SMALL_ATTENTION = 2048


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query per sequence [D, H, d] against its paged context.

    The query heads that share a KV head become that head's "query rows" ([D, KVH, group, d]), so
    SDPA needs no causal mask and no K/V copies per query head; K/V are strided views of the
    gathered blocks (the CPU flash kernel takes strides, so nothing is made contiguous)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    ids, mask = meta.decode_gather(q.dtype)
    length = meta.max_context_len
    keys = k_cache.index_select(0, ids).view(num_seqs, -1, num_kv_heads, head_dim)[:, :length].transpose(1, 2)
    values = (
        v_cache.index_select(0, ids).view(num_seqs, -1, num_kv_heads, head_dim)[:, :length].transpose(1, 2)
    )
    qg = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    threads = torch.get_num_threads()
    if q.device.type == "cpu" and threads > 1 and num_seqs * length <= _SMALL_ATTENTION:
        # CPU SDPA splits even a tiny problem across threads; waking the others costs more than the
        # work (measured 4x on one decode query, far more on a busy machine), so run it on this one
        torch.set_num_threads(1)
        try:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        finally:
            torch.set_num_threads(threads)
    else:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, d], k/v [T, KVH, d] of this step's tokens; writes k/v into the cache, returns [T, H, d].

    The CPU reference path: plain gathers, matmuls and SDPA. Accelerated kernels plug in behind the
    same signature and cache layout.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    d = meta.num_decodes
    if d and not meta.prefills:
        if use_triton(q):  # CUDA: one Triton program per (sequence, kv head) over the block table
            assert meta.block_tables is not None and meta.context_lens is not None
            return paged_decode_attention_triton(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale
            )
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if d:
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, meta, scale)
    gqa = q.shape[1] != num_kv_heads
    for chunk in meta.prefills:
        sl = slice(chunk.start, chunk.start + chunk.length)
        if q.dtype == torch.float32:  # CPU: from the paged cache, no gather (bf16 SDPA is faster)
            native = cpu_ops.prefill_attention(
                q[sl], k_cache, v_cache, chunk.block_table, chunk.context_len, scale
            )
            if native is not None:
                out[sl] = native
                continue
        qc = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if chunk.context_len == chunk.length:  # no cached prefix: attend to this chunk, causally
            kc, vc = k[sl].transpose(0, 1).unsqueeze(0), v[sl].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kc = _gather_kv(k_cache, chunk.block_table, chunk.context_len).transpose(0, 1).unsqueeze(0)
            vc = _gather_kv(v_cache, chunk.block_table, chunk.context_len).transpose(0, 1).unsqueeze(0)
            mask = chunk.causal_mask(q.dtype, q.device)
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[sl] = o.squeeze(0).transpose(0, 1)
    return out


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim or 0
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind == "freq_factors":  # from GGUF `rope_freqs`: llama.cpp divides each frequency by its factor
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    # buffers (registered in __init__), declared so they type as tensors, not Module.__getattr__'s union
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # [max_pos, d]: cos/sin duplicated over both halves (HF's rotate_half convention). rotate_half(x)
        # * sin == roll(x, d/2) * (sin with its first half negated): one op instead of chunk, neg, cat
        self.register_buffer("cos", torch.cat([freqs.cos()] * 2, -1).float(), persistent=False)
        self.register_buffer("sin", torch.cat([-freqs.sin(), freqs.sin()], -1).float(), persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        meta = _metadata
        if meta is not None and meta.positions is positions:  # once per step, shared by every layer
            if meta._rope_cache is None:
                meta._rope_cache = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
            cos, sin = meta._rope_cache
        else:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, d]
        out = []
        for x in xs:
            # cos/sin are float32, so half-precision x is rotated in float32 (promotion), then cast back
            rotated = x * cos + x.roll(x.shape[-1] // 2, -1) * sin
            out.append(rotated if rotated.dtype == x.dtype else rotated.to(x.dtype))
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):  # CUDA: kernels/rms_norm.py
            return rms_norm_triton(x, self.weight, self.eps)  # type: ignore[return-value]
        out = cpu_ops.rms_norm(x, self.weight, self.eps)  # CPU: one native pass (kernels/cpu_ops.c)
        return out if out is not None else F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.head_dim or 0
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        # q, k and v in one matmul: one weight read and one kernel launch instead of three
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = d**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        meta = get_attention_metadata()
        qkv = self.qkv_proj(x)
        # q and k heads sit side by side in the fused output: rotate them in one pass
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if cpu_ops.rope_(qk, meta.positions, rope.cos, rope.sin) is None:  # CPU: in place, natively
            (qk,) = rope(meta.positions, qk)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


# CPU: an MLP over more rows than this runs in row blocks of at most this many. The [rows, 2 x
# intermediate] activations of a 1,024-row prefill (12.6 MB for SmolLM2) fall out of cache between the
# gate/up matmul, the SiLU product and the down projection; in blocks of 512 the same work took 25% less
# CPU (2-core AMD EPYC, one thread, SmolLM2's 30 MLPs: 2.81 -> 2.08 s; 256 rows: 2.16 s).
MLP_BLOCK_ROWS = 512


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.device.type == "cpu" and rows > MLP_BLOCK_ROWS:
            blocks = -(-rows // MLP_BLOCK_ROWS)
            return torch.cat([self._forward(part) for part in x.split(-(-rows // blocks))])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = cpu_ops.silu_mul(gate_up)  # CPU: one native pass
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Parameter names follow Hugging Face (`model.layers.N...`) with q/k/v and gate/up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Flat token ids [T] -> final hidden states [T, hidden] (call `logits` on the rows you sample)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.rotary)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers`, typed as what it holds (a ModuleList's items type as plain Modules)."""
        return cast("Sequence[DecoderLayer]", self.layers)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        c = self.config
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim or 0)
        for layer in self.decoder_layers:
            layer.self_attn.k_cache = hugepages.zeros(shape, dtype, device)
            layer.self_attn.v_cache = hugepages.zeros(shape, dtype, device)


def weights_changed(model: nn.Module) -> None:
    """Note that `model`'s layers were swapped (quantized, packed) or reloaded: copies derived from them,
    the fused CPU decode step's (engine/fused_step.py), are rebuilt before their next use."""
    # torch types Module.__setattr__'s value as Tensor | Module; any value is a plain attribute at runtime
    model.weights_version = getattr(model, "weights_version", 0) + 1  # type: ignore[assignment]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * (config.head_dim or 0) * itemsize
