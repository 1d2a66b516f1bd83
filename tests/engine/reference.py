"""A plain, cache-free forward of our Transformer's weights: the yardstick for the paged engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import Transformer


@torch.inference_mode()
def reference_logits(model: Transformer, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] (float32) of every position, by textbook attention over the whole sequence."""
    c = model.config
    d = c.head_dim or 0
    ids = torch.tensor(token_ids)
    positions = torch.arange(len(token_ids))
    x = model.embed_tokens(ids)
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(-1, c.num_heads, d)
        k = k.reshape(-1, c.num_kv_heads, d)
        v = v.reshape(-1, c.num_kv_heads, d)
        q, k = model.rotary(positions, q, k)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * d**-0.5
        causal = torch.ones(len(token_ids), len(token_ids), dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", probs, v.float()).to(x.dtype)
        x = x + attn.o_proj(o.reshape(len(token_ids), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x)).float()


def reference_greedy(model: Transformer, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float(), dim=-1)
