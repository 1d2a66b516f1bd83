from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.checks import assert_close
from weir.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_cpu,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _paged_batch(
    context_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    num_blocks: int = 24,
):
    """Scatter each sequence over random, non-contiguous blocks, as a long-running cache would."""
    torch.manual_seed(sum(context_lens) + heads)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    max_blocks = max(-(-n // block_size) for n in context_lens) + 1  # one extra column of -1 padding
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks).tolist()
    for b, n in enumerate(context_lens):
        for i in range(-(-n // block_size)):
            tables[b, i] = free.pop()
    q = torch.randn(len(context_lens), heads, head_dim, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (9, 3)])
def test_triton_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    args = _paged_batch([1, 16, 17, 45], heads, kv_heads, 32, dtype)
    expected = paged_decode_attention_ref(*args)
    assert_close(paged_decode_attention_triton(*args), expected, dtype)
    assert_close(paged_decode_attention_cpu(*args), expected, dtype)


def test_head_dim_not_a_power_of_two_and_custom_scale() -> None:
    args = _paged_batch([3, 30], 4, 2, 48, torch.float32, block_size=8)
    expected = paged_decode_attention_ref(*args, scale=0.3)
    assert_close(paged_decode_attention_triton(*args, scale=0.3), expected, torch.float32)
    assert_close(paged_decode_attention(*args, scale=0.3), expected, torch.float32)


def test_reference_equals_dense_attention_over_the_gathered_context() -> None:
    q, k_cache, v_cache, tables, lens = _paged_batch([20], 2, 1, 16, torch.float32)
    blocks = tables[0, :2].long()
    k = k_cache[blocks].reshape(-1, 16)[:20]
    v = v_cache[blocks].reshape(-1, 16)[:20]
    dense = torch.softmax(q[0] @ k.T / math.sqrt(16), dim=-1) @ v
    assert torch.allclose(paged_decode_attention_ref(q, k_cache, v_cache, tables, lens)[0], dense, atol=1e-5)


def test_tokens_past_the_context_do_not_leak_in() -> None:
    q, k_cache, v_cache, tables, lens = _paged_batch([5], 2, 2, 16, torch.float32)
    before = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens)
    k_cache[tables[0, 0], 5:] = 1e4  # stale slots of the same block, beyond context_lens
    v_cache[tables[0, 0], 5:] = 1e4
    assert torch.equal(paged_decode_attention_triton(q, k_cache, v_cache, tables, lens), before)
    assert torch.allclose(paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens), before, atol=1e-6)
