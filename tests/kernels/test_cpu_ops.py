"""The eager forward's native CPU ops (kernels/cpu_ops.c) against their PyTorch references."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from engine.config import tiny_config
from engine.llm_engine import LLMEngine
from engine.model import _gather_kv
from engine.sampling import SamplingParams
from weir.kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler to build the ops")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def rebuild() -> Iterator[None]:
    """Whatever a test does to the build (environment, compiler), the next test gets the usual one."""
    cpu_ops.library.cache_clear()
    yield
    cpu_ops.library.cache_clear()


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: a few ulps (sums in another order); bf16: the same values but for an odd rounding tie."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)  # one bf16 ulp
        assert (got != want).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 100, 7])  # vector multiples and tails
def test_rms_norm(dtype: torch.dtype, n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(37, n, dtype=dtype) * 3
    weight = torch.randn(n, dtype=dtype)
    got = cpu_ops.rms_norm(x, weight, 1e-5)
    assert got is not None
    _assert_close(got, F.rms_norm(x, (n,), weight, 1e-5))


def test_rms_norm_reads_strided_rows() -> None:
    wide = torch.randn(5, 300)
    x, weight = wide[:, 10:138], torch.randn(128)  # rows 300 apart
    got = cpu_ops.rms_norm(x, weight, 1e-6)
    assert got is not None
    _assert_close(got, F.rms_norm(x, (128,), weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40, 9])
def test_silu_mul(dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(inter)
    gate_up = torch.randn(23, 2 * inter, dtype=dtype) * 6  # far into both tails of the SiLU
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_ops.silu_mul(gate_up)
    assert got is not None
    _assert_close(got, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_matches_the_engine_expression_exactly(dtype: torch.dtype) -> None:
    """Two products and a sum in fp32, rounded once: PyTorch's arithmetic, so equal to the bit; on the q
    and k heads of a fused QKV output (rows wider than the heads), leaving v alone."""
    torch.manual_seed(1)
    heads, d, max_pos = 12, 64, 300
    qkv = torch.randn(29, (heads + 3) * d, dtype=dtype)
    cos, sin = torch.randn(max_pos, d), torch.randn(max_pos, d)
    positions = torch.randint(0, max_pos, (29,))
    qk = qkv[:, : heads * d].view(-1, heads, d)
    want = (qk * cos[positions].unsqueeze(1) + qk.roll(d // 2, -1) * sin[positions].unsqueeze(1)).to(dtype)
    v_before = qkv[:, heads * d :].clone()
    assert cpu_ops.rope_(qk, positions, cos, sin) is qk
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, heads * d :], v_before)


def test_rope_refuses_positions_past_its_tables() -> None:
    x = torch.randn(2, 1, 8)
    cos = sin = torch.zeros(10, 8)
    for bad in (10, -1):
        with pytest.raises(IndexError):
            cpu_ops.rope_(x, torch.tensor([0, bad]), cos, sin)


def test_what_the_ops_do_not_take_falls_back() -> None:
    """None means "run the PyTorch op": other dtypes, rows not unit-stride, odd layouts."""
    half = torch.randn(4, 8, dtype=torch.float16)
    assert cpu_ops.rms_norm(half, torch.ones(8, dtype=torch.float16), 1e-5) is None
    assert cpu_ops.rms_norm(torch.randn(8, 4).t(), torch.ones(8), 1e-5) is None  # columns, not rows
    assert cpu_ops.rms_norm(torch.randn(4, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5) is None
    assert cpu_ops.silu_mul(torch.randn(4, 9)) is None  # no even split into gate and up
    cos = sin = torch.zeros(10, 8)
    assert cpu_ops.rope_(torch.randn(2, 8), torch.tensor([0, 1]), cos, sin) is None  # not [rows, heads, d]
    assert cpu_ops.rope_(torch.randn(2, 1, 8), torch.tensor([0, 1], dtype=torch.int32), cos, sin) is None


def _attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    length: int,
    scale: float,
) -> torch.Tensor:
    """The engine's PyTorch path: gather the blocks, SDPA with a causal mask offset by the prefix."""
    n, heads = q.shape[:2]
    keys = _gather_kv(k_cache, table, length).transpose(0, 1).unsqueeze(0)
    values = _gather_kv(v_cache, table, length).transpose(0, 1).unsqueeze(0)
    rows = torch.arange(n).unsqueeze(1) + (length - n)
    mask = torch.arange(length).unsqueeze(0) <= rows
    gqa = heads != k_cache.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
    )
    return out.squeeze(0).transpose(0, 1)


def _cache(
    blocks: int, block: int, kv_heads: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(blocks, block, kv_heads, d, dtype=dtype), torch.randn(
        blocks, block, kv_heads, d, dtype=dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("length", "n", "heads", "kv_heads", "d"),
    [
        (128, 128, 9, 3, 64),  # a whole prompt, SmolLM2's heads
        (300, 77, 9, 3, 64),  # a chunk after a cached prefix, lengths off the block grid
        (53, 1, 8, 2, 64),  # one query
        (40, 40, 4, 4, 40),  # no grouping; head_dim not a multiple of the vector width
        (70, 30, 14, 2, 24),  # a group of 7 (Qwen2.5-0.5B's), a tile mixing rows
    ],
)
def test_prefill_attention_matches_gather_and_sdpa(
    dtype: torch.dtype, length: int, n: int, heads: int, kv_heads: int, d: int
) -> None:
    torch.manual_seed(length + n)
    block = 16
    k_cache, v_cache = _cache(40, block, kv_heads, d, dtype)
    table = torch.randperm(40)[: -(-length // block)].int()  # out of order
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, dtype=dtype) * 2
    q = qkv[:, : heads * d].view(n, heads, d)  # rows of the fused QKV output, as the model passes them
    got = cpu_ops.prefill_attention(q, k_cache, v_cache, table, length, d**-0.5)
    assert got is not None
    want = _attention_reference(q, k_cache, v_cache, table, length, d**-0.5)
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2  # bf16: the output rounded once vs SDPA's roundings
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_prefill_attention_does_not_depend_on_the_chunking() -> None:
    """A query row's arithmetic is its own: one 100-token prefill and the same in chunks of 40 and 60
    (the second reading the first from the cache) give the same bits."""
    torch.manual_seed(3)
    k_cache, v_cache = _cache(16, 16, 3, 64, torch.float32)
    table = torch.tensor([9, 2, 14, 0, 5, 11, 7], dtype=torch.int32)
    q = torch.randn(100, 9, 64)
    whole = cpu_ops.prefill_attention(q, k_cache, v_cache, table, 100, 0.125)
    first = cpu_ops.prefill_attention(q[:40], k_cache, v_cache, table, 40, 0.125)
    second = cpu_ops.prefill_attention(q[40:], k_cache, v_cache, table, 100, 0.125)
    assert whole is not None and first is not None and second is not None
    assert torch.equal(torch.cat([first, second]), whole)


def test_prefill_attention_does_not_depend_on_the_thread_count() -> None:
    """Tiles go to threads dynamically; a row's arithmetic is its own, so any split gives the same bits."""
    torch.manual_seed(4)
    k_cache, v_cache = _cache(16, 16, 3, 64, torch.float32)
    table = torch.tensor([9, 2, 14, 0, 5, 11, 7], dtype=torch.int32)
    q = torch.randn(60, 9, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.prefill_attention(q, k_cache, v_cache, table, 100, 0.125)
        torch.set_num_threads(3)  # more threads than this machine's cores: uneven, interleaved splits
        three = cpu_ops.prefill_attention(q, k_cache, v_cache, table, 100, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert one is not None and three is not None
    assert torch.equal(one, three)


def test_prefill_attention_refuses_a_table_that_does_not_cover_the_context() -> None:
    k_cache, v_cache = _cache(4, 16, 1, 64, torch.float32)
    q = torch.randn(5, 2, 64)
    with pytest.raises(IndexError):
        cpu_ops.prefill_attention(q, k_cache, v_cache, torch.tensor([0], dtype=torch.int32), 20, 0.125)
    for bad in (4, -1):
        with pytest.raises(IndexError):
            cpu_ops.prefill_attention(
                q, k_cache, v_cache, torch.tensor([0, bad], dtype=torch.int32), 20, 0.125
            )


def _greedy(fused: str) -> list[list[int]]:
    engine = LLMEngine.from_config(tiny_config(), device="cpu", num_kv_blocks=64, fused_decode=fused)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(40 + 9 * i)] for i in range(3)]
    return engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))


def test_the_engine_generates_the_same_with_and_without_the_ops(
    monkeypatch: pytest.MonkeyPatch, rebuild: None
) -> None:
    with_ops = _greedy("off")
    monkeypatch.setenv("WEIR_CPU_OPS", "0")
    cpu_ops.library.cache_clear()
    assert cpu_ops.library() is None
    assert _greedy("off") == with_ops


def test_no_compiler_means_the_pytorch_ops(monkeypatch: pytest.MonkeyPatch, rebuild: None) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    assert cpu_ops.library() is None  # logged, not raised
    x = torch.randn(3, 8)
    assert cpu_ops.rms_norm(x, torch.ones(8), 1e-5) is None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set variants")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # the AVX2 + FMA path; plain C
def test_the_other_instruction_set_paths(march: str, monkeypatch: pytest.MonkeyPatch, rebuild: None) -> None:
    monkeypatch.setenv("WEIR_CPU_DECODE_MARCH", march)
    assert cpu_ops.library() is not None
    for dtype in DTYPES:
        test_rms_norm(dtype, 100)
        test_silu_mul(dtype, 40)
        test_rope_in_place_matches_the_engine_expression_exactly(dtype)
        test_prefill_attention_matches_gather_and_sdpa(dtype, 300, 77, 9, 3, 64)
        test_prefill_attention_matches_gather_and_sdpa(dtype, 40, 40, 4, 4, 40)
