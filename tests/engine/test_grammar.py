"""Structured output: JSON Schema and JSON-object constraints through the engine (tiny random model,
byte-level vocabulary, so the model itself knows nothing of JSON and every bracket is the grammar's)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from engine.llm_engine import LLMEngine
from engine.sampling import JsonFormat, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["ok", "kind"],
    "additionalProperties": False,
}
PROMPT = [5, 6, 7, 8, 9]


def text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t).decode(errors="replace")  # byte-level ids; 0 is EOS


def run(engine: LLMEngine, params: SamplingParams) -> tuple[list[int], str | None]:
    engine.add_request("r", PROMPT, params)
    tokens: list[int] = []
    reason = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
            reason = o.finish_reason
    return tokens, reason


@pytest.mark.parametrize("seed", range(4))
def test_a_schema_is_followed_and_the_request_stops_when_the_json_is_complete(
    tiny_engine: LLMEngine, seed: int
) -> None:
    params = SamplingParams(
        max_tokens=64, temperature=1.0, seed=seed, json_format=JsonFormat(json.dumps(SCHEMA))
    )
    tokens, reason = run(tiny_engine, params)
    value = json.loads(text(tokens))
    assert set(value) == {"ok", "kind"} and isinstance(value["ok"], bool) and value["kind"] in ("cat", "dog")
    assert reason == "stop" and len(tokens) < 64


def test_unconstrained_the_tiny_model_writes_no_json(tiny_engine: LLMEngine) -> None:
    tokens, _ = run(tiny_engine, SamplingParams(max_tokens=32, temperature=1.0, seed=0))
    with pytest.raises(ValueError):  # the check above would pass for a reason other than the grammar
        json.loads(text(tokens))


def test_json_object_output_is_an_object_as_far_as_it_goes(tiny_engine: LLMEngine) -> None:
    for seed in range(3):
        tokens, reason = run(
            tiny_engine, SamplingParams(max_tokens=40, temperature=1.0, seed=seed, json_format=JsonFormat())
        )
        out = text(tokens)
        assert out.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(out), dict)


def test_an_invalid_schema_is_refused_before_anything_runs(tiny_engine: LLMEngine) -> None:
    bad = SamplingParams(json_format=JsonFormat('{"type": "no-such-type"}'))
    with pytest.raises(ValueError, match="schema"):
        tiny_engine.add_request("bad", PROMPT, bad)
    assert not tiny_engine.has_unfinished_requests()


def test_constrained_requests_are_batch_invariant_and_skip_speculation(
    make_engine: Callable[..., LLMEngine],
) -> None:
    fmt = JsonFormat(json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=48, temperature=0.8, seed=s, json_format=fmt) for s in range(6)]
    prompts = [[*PROMPT, s] for s in range(6)]
    alone = [make_engine().generate([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    spec = make_engine(speculative="ngram", max_num_batched_tokens=11)
    assert spec.generate(prompts, params) == alone
    assert spec.stats().speculative is not None and spec.stats().speculative.num_draft_tokens == 0
