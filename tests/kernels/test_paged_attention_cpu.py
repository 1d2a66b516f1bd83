"""The fused CPU paged decode kernel (kernels/paged_attention_cpu.cpp) against the reference, and the
engine's decode attention on it against the gather + SDPA path it replaces."""

from __future__ import annotations

import pytest
import torch

from engine import model as model_mod
from kernels import paged_attention as pa
from kernels.paged_attention import (
    fused_cpu_supported,
    paged_decode_attention_fused_cpu,
    paged_decode_attention_ref,
)
from tests.kernels.conftest import assert_close
from tests.kernels.test_paged_attention import _paged_batch

pytestmark = pytest.mark.skipif(
    pa._cpu_extension() is None, reason="the fused CPU kernel does not build here (no C++ compiler)"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 2), (4, 4)])
@pytest.mark.parametrize("block_size", [16, 8])
def test_matches_reference_on_padded_gqa_batches(
    dtype: torch.dtype, heads: int, kv_heads: int, block_size: int
) -> None:
    # lengths 1, a full block, one past it, several blocks; tables padded with -1 beyond each sequence
    args = _paged_batch([1, 16, 17, 45, 33], heads, kv_heads, 64, dtype, block_size=block_size, num_blocks=40)
    expected = paged_decode_attention_ref(*args)
    assert_close(paged_decode_attention_fused_cpu(*args), expected, dtype)
    assert_close(paged_decode_attention_fused_cpu(*args, one_thread=True), expected, dtype)


def test_head_dim_32_and_a_custom_scale() -> None:
    args = _paged_batch([3, 30, 64], 4, 2, 32, torch.float32, block_size=16)
    expected = paged_decode_attention_ref(*args, scale=0.3)
    assert_close(paged_decode_attention_fused_cpu(*args, scale=0.3), expected, torch.float32)


def test_long_context_with_a_dominant_score() -> None:
    # one key far above the rest: the softmax must subtract the row max (exp of ~80 would be 5e34)
    q, k_cache, v_cache, tables, lens = _paged_batch([300, 120], 9, 3, 64, torch.float32, num_blocks=30)
    k_cache[tables[0, 3], 5] *= 40.0
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens)
    assert_close(paged_decode_attention_fused_cpu(q, k_cache, v_cache, tables, lens), expected, torch.float32)


def test_tokens_past_the_context_do_not_leak_in() -> None:
    q, k_cache, v_cache, tables, lens = _paged_batch([5, 20], 6, 2, 64, torch.bfloat16)
    before = paged_decode_attention_fused_cpu(q, k_cache, v_cache, tables, lens)
    for b, n in enumerate(lens.tolist()):
        last = tables[b, (n - 1) // 16]
        k_cache[last, n % 16 :] = 1e4  # stale slots of the last block, beyond context_lens
        v_cache[last, n % 16 :] = 1e4
    assert torch.equal(paged_decode_attention_fused_cpu(q, k_cache, v_cache, tables, lens), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_alone_batched_and_on_any_thread_split(dtype: torch.dtype) -> None:
    q, k_cache, v_cache, tables, lens = _paged_batch([7, 45, 16, 33, 2, 60], 9, 3, 64, dtype, num_blocks=40)
    batched = paged_decode_attention_fused_cpu(q, k_cache, v_cache, tables, lens)
    assert torch.equal(
        paged_decode_attention_fused_cpu(q, k_cache, v_cache, tables, lens, one_thread=True), batched
    )
    for b in range(len(lens)):
        width = -(-int(lens[b]) // 16)  # its own table, unpadded: as if it were the only decode
        alone = paged_decode_attention_fused_cpu(
            q[b : b + 1], k_cache, v_cache, tables[b : b + 1, :width], lens[b : b + 1]
        )
        assert torch.equal(alone[0], batched[b])


def _meta(tables: torch.Tensor, lens: torch.Tensor) -> model_mod.AttentionMetadata:
    return model_mod.AttentionMetadata(
        positions=lens.long() - 1,
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        num_decodes=len(lens),
        block_tables=tables,
        context_lens=lens,
        max_context_len=int(lens.max()),
        prefills=[],
        block_size=16,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_decode_attention_uses_it_and_agrees_with_sdpa(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k_cache, v_cache, tables, lens = _paged_batch([150, 171, 140, 9], 9, 3, 64, dtype, num_blocks=48)
    q = torch.randn(len(lens), 12, 64).to(dtype)[:, :9]  # a strided view, as the fused q|k rotation gives
    assert fused_cpu_supported(q, k_cache)
    calls: list[int] = []
    fused = model_mod.paged_decode_attention_fused_cpu
    monkeypatch.setattr(
        model_mod, "paged_decode_attention_fused_cpu", lambda *a, **kw: calls.append(1) or fused(*a, **kw)
    )
    got = model_mod._decode_attention(q, k_cache, v_cache, _meta(tables, lens), 0.125)
    assert calls == [1]
    monkeypatch.setattr(pa, "FUSED_CPU", False)  # the gather + SDPA path
    sdpa = model_mod._decode_attention(q, k_cache, v_cache, _meta(tables, lens), 0.125)
    assert_close(got, sdpa, dtype)
    assert_close(got, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125), dtype)
