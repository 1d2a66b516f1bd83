from __future__ import annotations

import pytest
import torch

from tests.kernels.checks import assert_close
from weir.kernels.rotary import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
    rotary_embedding_triton,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])  # 16 of 32: partial rotary, the rest passes through
def test_triton_matches_reference(dtype: torch.dtype, is_neox: bool, rotary_dim: int) -> None:
    torch.manual_seed(0)
    cache = build_cos_sin_cache(rotary_dim, 128)
    positions = torch.tensor([0, 1, 77, 127, 3])
    q, k = torch.randn(5, 6, 32, dtype=dtype), torch.randn(5, 2, 32, dtype=dtype)
    eq, ek = rotary_embedding_ref(positions, q, k, cache, is_neox)
    tq, tk = rotary_embedding_triton(positions, q, k, cache, is_neox)
    assert_close(tq, eq, dtype)
    assert_close(tk, ek, dtype)
    if rotary_dim < 32:
        assert torch.equal(tq[..., rotary_dim:], q[..., rotary_dim:])


def test_matches_hugging_face_rotate_half() -> None:
    torch.manual_seed(2)
    dim, base = 64, 10000.0
    positions = torch.arange(10)
    q, k = torch.randn(10, 3, dim), torch.randn(10, 1, dim)
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    emb = torch.cat([torch.outer(positions.float(), inv_freq)] * 2, dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)

    rq, rk = rotary_embedding(positions, q, k, build_cos_sin_cache(dim, 16, base))
    assert torch.allclose(rq, q * cos + rotate_half(q) * sin, atol=1e-5)
    assert torch.allclose(rk, k * cos + rotate_half(k) * sin, atol=1e-5)


def test_rotation_preserves_norm_and_relative_position() -> None:
    cache = build_cos_sin_cache(16, 64)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    scores = []
    for shift in (0, 9):
        rq, _ = rotary_embedding(torch.tensor([5 + shift]), q, k, cache)
        _, rk = rotary_embedding(torch.tensor([2 + shift]), q, k, cache)
        assert torch.allclose(rq.norm(), q.norm(), atol=1e-5)
        scores.append((rq * rk).sum())
    assert torch.allclose(scores[0], scores[1], atol=1e-4)
