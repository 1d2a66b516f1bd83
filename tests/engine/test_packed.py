"""CPU weight layouts (engine/packed.py): oneDNN-prepacked and column-major linears compute what
F.linear does, and the swap leaves quantized layers alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from engine.llm_engine import LLMEngine, resolve_dtype
from engine.packed import PackedLinear, pack_linears, packing_available
from engine.quant import Int8Linear
from engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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


def test_swap_modes_and_quantized_layers_untouched() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    model[1] = Int8Linear.from_linear(nn.Linear(64, 64))
    assert pack_linears(model, "off") == 0
    assert pack_linears(model, "auto") == 1
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], Int8Linear)

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


def test_column_major_keeps_a_tied_embedding_shared() -> None:
    embed = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    ids = torch.tensor([3, 99, 0])
    rows, logits = embed(ids), head(torch.ones(2, 16))
    assert pack_linears(model, "auto") == 1
    assert embed.weight is head.weight and embed.weight.stride() == (1, 100)
    torch.testing.assert_close(embed(ids), rows, rtol=0, atol=0)
    torch.testing.assert_close(head(torch.ones(2, 16)), logits)


def test_engine_greedy_output_is_the_same_packed_or_not(make_engine: Callable[..., LLMEngine]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7], list(range(10, 40))]
    plain = make_engine(packing="off")
    packed = make_engine(packing="on")
    column_major = make_engine(packing="auto")
    assert plain.num_packed_linears == 0 and packed.num_packed_linears > 0
    assert column_major.num_packed_linears > 0
    expected = plain.generate(prompts, params)
    assert packed.generate(prompts, params) == expected
    assert column_major.generate(prompts, params) == expected


def test_auto_dtype_follows_the_hardware() -> None:
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("fp32", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("int3", torch.device("cpu"))
