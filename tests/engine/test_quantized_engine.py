"""`LLMEngine(quantization=...)` / `weir engine serve --quantization`: the quantized model is a module
swap at load, and the engine serves with it exactly as it does in floating point."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from engine.cli import engine as engine_cli
from engine.config import tiny_config
from engine.llm_engine import LLMEngine
from engine.quant import Int4Linear, Int8Linear
from engine.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.mark.parametrize(("scheme", "linear"), [("int8", Int8Linear), ("int4-g32", Int4Linear)])
def test_quantized_engine_swaps_every_linear_and_serves(scheme: str, linear: type) -> None:
    plain = LLMEngine.from_config(tiny_config(), num_kv_blocks=64, progress=False)
    quantized = LLMEngine.from_config(tiny_config(), num_kv_blocks=64, progress=False, quantization=scheme)
    swapped = [m for m in quantized.model.modules() if isinstance(m, Int8Linear | Int4Linear)]
    assert swapped and any(isinstance(m, linear) for m in swapped)
    assert not any(type(m).__name__ == "Linear" for m in quantized.model.modules())

    outputs = quantized.generate(PROMPTS, GREEDY)
    assert [len(o) for o in outputs] == [10, 10, 10]
    # Same random weights, so the first greedy tokens agree with floating point on a tiny model.
    assert [o[0] for o in outputs] == [o[0] for o in plain.generate(PROMPTS, GREEDY)]
    stats = quantized.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError):
        LLMEngine.from_config(tiny_config(), num_kv_blocks=8, progress=False, quantization="int3")


def test_serve_offers_the_schemes() -> None:
    result = CliRunner().invoke(engine_cli, ["serve", "--help"])
    assert result.exit_code == 0 and "--quantization" in result.output and "int4-g64" in result.output
