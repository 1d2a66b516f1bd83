"""oneDNN-prepacked linears (engine/packed.py): same numbers as F.linear, and a swap that leaves
quantized layers alone."""

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

    fp32 = nn.Sequential(nn.Linear(64, 64))
    assert pack_linears(fp32, "auto") == 0  # fp32 single-row decode is slower packed: opt-in only
    assert pack_linears(fp32, "on") == 1
    with pytest.raises(ValueError, match="packing"):
        pack_linears(fp32, "sometimes")


def test_engine_greedy_output_is_the_same_packed_or_not(make_engine: Callable[..., LLMEngine]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7], list(range(10, 40))]
    plain = make_engine(packing="off")
    packed = make_engine(packing="on")
    assert plain.num_packed_linears == 0 and packed.num_packed_linears > 0
    assert packed.generate(prompts, params) == plain.generate(prompts, params)


def test_auto_dtype_follows_the_hardware() -> None:
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("fp32", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("int3", torch.device("cpu"))
