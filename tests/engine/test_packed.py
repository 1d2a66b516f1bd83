"""CPU weight layouts (engine/packed.py): oneDNN-prepacked and column-major linears compute what
F.linear does, and the swap leaves quantized layers alone."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

import engine.packed
from engine.llm_engine import LLMEngine, resolve_dtype
from engine.packed import DualLinear, PackedLinear, pack_linears, packing_available, packing_supported
from engine.quant import Int8Linear, quantize_model, weight_bytes
from engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
# oneDNN packs bfloat16 only on CPUs with AVX-512 or AVX-NE-CONVERT (not on an AVX2-only AMD EPYC)
BF16_PACKS = packing_supported(torch.bfloat16)
needs_bf16_packing = pytest.mark.skipif(not BF16_PACKS, reason="oneDNN cannot pack bfloat16 on this CPU")


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_packing)])
@pytest.mark.parametrize("rows", [1, 3, 32, 200])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=True).to(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96, dtype=dtype)
    want, got = linear(x).float(), packed(x).float()
    # bf16: both round the same fp32 accumulations to 8 bits of mantissa, differently ordered
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    # leading dimensions are kept, and non-contiguous inputs are fine
    x3 = torch.randn(2, 5, 192, dtype=dtype)[..., ::2]
    assert packed(x3).shape == (2, 5, 160)
    torch.testing.assert_close(packed(x3).float(), linear(x3).float(), rtol=tol, atol=tol * 10)


def test_swap_modes_and_quantized_layers_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.packed, "onednn_wins_for_few_rows", lambda: False)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    model[1] = Int8Linear.from_linear(nn.Linear(64, 64))
    assert pack_linears(model, "off") == 0
    assert pack_linears(model, "auto") == int(BF16_PACKS)  # where it cannot pack, bf16 stays as it is
    assert type(model[0]) is (PackedLinear if BF16_PACKS else nn.Linear) and isinstance(model[1], Int8Linear)

    fp32 = nn.Sequential(nn.Linear(64, 32))
    x = torch.randn(3, 64)
    want = fp32(x)
    assert pack_linears(fp32, "auto") == 1  # fp32: column-major, not packed (slower for one row)
    assert isinstance(fp32[0], nn.Linear) and fp32[0].weight.stride() == (1, 32)
    torch.testing.assert_close(fp32(x), want)
    assert pack_linears(fp32, "auto") == 0  # already laid out
    assert pack_linears(fp32, "on") == 1
    with pytest.raises(ValueError, match="packing"):
        pack_linears(fp32, "sometimes")


@pytest.mark.parametrize("rows", [1, 2, 5, 32, 128, 300])
def test_dual_linear_uses_both_layouts_and_matches_f_linear(rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=True)
    want_weight = linear.weight.detach().clone()
    x = torch.randn(rows, 96)
    want = linear(x)
    dual = DualLinear(linear)
    assert dual.weight is linear.weight and dual.weight.stride() == (1, 160)  # column-major, in place
    torch.testing.assert_close(dual.weight, want_weight, rtol=0, atol=0)
    torch.testing.assert_close(dual(x), want, rtol=1e-5, atol=1e-5)
    assert dual(x.unsqueeze(0)).shape == (1, rows, 160)


def _count_onednn_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every oneDNN call from now on, in order."""
    calls: list[int] = []
    onednn = engine.packed._onednn_linear

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return onednn(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.packed, "_onednn_linear", counting)
    return calls


def test_dual_linear_runs_few_rows_on_onednn_and_one_or_many_on_mkl(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_onednn_rows(monkeypatch)
    monkeypatch.setattr(engine.packed, "WIDE_OUT", 128)
    big = engine.packed.MKL_MIN_ROWS
    monkeypatch.setattr(engine.packed, "mkl_min_rows", lambda: big)  # a CPU where MKL matches oneDNN there
    monkeypatch.setattr(engine.packed, "onednn_wins_for_one_row", lambda: False)
    narrow, wide = DualLinear(nn.Linear(64, 96)), DualLinear(nn.Linear(64, 128))
    for rows in (1, 4, big - 1, big, 3 * big):
        narrow(torch.randn(rows, 64))
    assert calls == [4, big - 1]
    calls.clear()
    for rows in (1, 4, big, 3 * big):
        wide(torch.randn(rows, 64))
    assert calls == [4, big, 3 * big]  # a vocabulary-wide head stays on oneDNN for many rows
    calls.clear()
    monkeypatch.setattr(engine.packed, "mkl_min_rows", lambda: sys.maxsize)  # oneDNN faster at any count
    everywhere = DualLinear(nn.Linear(64, 96))
    for rows in (1, 4, big, 3 * big):
        everywhere(torch.randn(rows, 64))
    assert calls == [4, big, 3 * big]


def test_mkl_min_rows_probe_returns_a_row_count() -> None:
    assert engine.packed.mkl_min_rows() in (engine.packed.MKL_MIN_ROWS, sys.maxsize)


@pytest.mark.parametrize(("wins", "expected"), [(True, DualLinear), (False, nn.Linear)])
def test_auto_keeps_two_float32_layouts_only_where_onednn_wins(
    monkeypatch: pytest.MonkeyPatch, wins: bool, expected: type
) -> None:
    monkeypatch.setattr(engine.packed, "onednn_wins_for_few_rows", lambda: wins)
    monkeypatch.setattr(engine.packed, "onednn_serves_every_row_count", lambda: False)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    assert pack_linears(model, "auto") == 2
    assert type(model[0]) is type(model[1]) is expected
    forced = nn.Sequential(nn.Linear(64, 32))
    assert pack_linears(forced, "dual") == 1 and isinstance(forced[0], DualLinear)


@pytest.mark.parametrize("onednn_one_row", [True, False])
def test_dual_linear_runs_one_row_where_the_probe_says(
    monkeypatch: pytest.MonkeyPatch, onednn_one_row: bool
) -> None:
    calls = _count_onednn_rows(monkeypatch)
    monkeypatch.setattr(engine.packed, "onednn_wins_for_one_row", lambda: onednn_one_row)
    linear = nn.Linear(64, 96)
    x = torch.randn(1, 64)
    want = linear(x)
    dual = DualLinear(linear)
    torch.testing.assert_close(dual(x), want, rtol=1e-5, atol=1e-5)
    assert calls == ([1] if onednn_one_row else [])


def test_onednn_one_row_probe_returns_a_decision() -> None:
    assert isinstance(engine.packed.onednn_wins_for_one_row(256, 128, 2), bool)


def test_a_dual_linear_follows_its_weight_after_load_state_dict() -> None:
    dual = DualLinear(nn.Linear(32, 48))
    other = nn.Linear(32, 48)
    dual.load_state_dict(other.state_dict())
    x = torch.randn(5, 32)
    torch.testing.assert_close(dual(x), other(x), rtol=1e-5, atol=1e-5)  # the packed (multi-row) path
    torch.testing.assert_close(dual(x[:1]), other(x[:1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("mode", "layout"), [("dual", DualLinear), ("auto", PackedLinear)])
def test_quantization_sees_packed_linears_as_linears(
    monkeypatch: pytest.MonkeyPatch, mode: str, layout: type
) -> None:
    # auto: where oneDNN serves every row count, only the packed copy is kept (PackedLinear)
    monkeypatch.setattr(engine.packed, "onednn_wins_for_few_rows", lambda: True)
    monkeypatch.setattr(engine.packed, "onednn_serves_every_row_count", lambda: True)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    x = torch.randn(4, 64)
    want = model(x)
    assert pack_linears(model, mode) == 2 and type(model[0]) is layout
    quantize_model(model, "int8")
    assert isinstance(model[0], Int8Linear) and isinstance(model[1], Int8Linear)
    torch.testing.assert_close(model(x), want, rtol=0.05, atol=0.05)


def test_weight_bytes_counts_opaque_packed_copies() -> None:
    plain = nn.Sequential(nn.Linear(64, 32))
    one = weight_bytes(plain)
    assert one == (64 * 32 + 32) * 4
    pack_linears(plain, "dual")
    assert weight_bytes(plain) == one + 64 * 32 * 4  # the second, oneDNN-packed copy of the weight


def test_onednn_few_row_probe_returns_a_decision() -> None:
    assert isinstance(engine.packed.onednn_wins_for_few_rows(2, 64, 256), bool)


@pytest.mark.parametrize("mode", ["auto", "dual"])
def test_column_major_keeps_a_tied_embedding_shared(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setattr(engine.packed, "onednn_wins_for_few_rows", lambda: False)
    embed = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    ids = torch.tensor([3, 99, 0])
    rows, logits = embed(ids), head(torch.ones(2, 16))
    assert pack_linears(model, mode) == 1
    assert embed.weight is head.weight is model["head"].weight and embed.weight.stride() == (1, 100)
    torch.testing.assert_close(embed(ids), rows, rtol=0, atol=0)
    torch.testing.assert_close(head(torch.ones(2, 16)), logits)


def test_engine_greedy_output_is_the_same_packed_or_not(make_engine: Callable[..., LLMEngine]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7], list(range(10, 40))]
    plain = make_engine(packing="off")
    packed = make_engine(packing="on")
    column_major = make_engine(packing="auto")
    dual = make_engine(packing="dual")
    assert plain.num_packed_linears == 0 and packed.num_packed_linears > 0
    assert column_major.num_packed_linears > 0 and dual.num_packed_linears > 0
    expected = plain.generate(prompts, params)
    assert packed.generate(prompts, params) == expected
    assert column_major.generate(prompts, params) == expected
    assert dual.generate(prompts, params) == expected


def test_auto_dtype_follows_the_hardware() -> None:
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("fp32", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("int3", torch.device("cpu"))


def test_auto_keeps_only_the_packed_copy_where_onednn_serves_every_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine.packed, "onednn_wins_for_few_rows", lambda: True)
    monkeypatch.setattr(engine.packed, "onednn_serves_every_row_count", lambda: True)
    embed = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embed.weight
    body = nn.Linear(16, 16)
    model = nn.ModuleDict({"embed": embed, "body": body, "head": head})
    x = torch.randn(3, 16)
    ids = torch.tensor([3, 99, 0])
    want_body, want_head, rows = body(x), head(x), embed(ids)
    assert pack_linears(model, "auto") == 2
    assert type(model["body"]) is type(model["head"]) is PackedLinear
    assert model["body"].weight is None  # no plain copy left beside the packed one
    assert model["head"].weight is embed.weight  # the tied head keeps the embedding's: no extra bytes
    assert embed.weight.stride() == (16, 1)  # the embedding keeps its row-major table
    torch.testing.assert_close(model["body"](x), want_body, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model["head"](x), want_head, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model["body"](x[:1]), want_body[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embed(ids), rows, rtol=0, atol=0)
    assert pack_linears(model, "dual") == 0  # already packed: nothing left to lay out


def test_onednn_serves_every_row_count_combines_both_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    for one_row, min_rows, expected in (
        (True, sys.maxsize, True),
        (True, 128, False),
        (False, sys.maxsize, False),
    ):
        monkeypatch.setattr(engine.packed, "onednn_wins_for_one_row", lambda v=one_row: v)
        monkeypatch.setattr(engine.packed, "mkl_min_rows", lambda v=min_rows: v)
        assert engine.packed.onednn_serves_every_row_count() is expected


def test_a_packed_linear_converts_back_exactly() -> None:
    linear = nn.Linear(48, 80)
    back = PackedLinear(linear).to_linear()
    assert torch.equal(back.weight, linear.weight) and back.bias is linear.bias
