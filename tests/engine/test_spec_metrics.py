"""Speculative decoding's metrics on the engine server's /metrics (Prometheus text), after real requests."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from engine.config import KNOWN_MODELS
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from tests.engine.engine_server import NUM_BLOCKS, all_blocks_free, start


def _values(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"
    }


async def test_metrics_report_acceptance_by_position_tokens_per_step_and_rate() -> None:
    engine = LLMEngine.from_config(
        KNOWN_MODELS["tiny"], num_kv_blocks=NUM_BLOCKS, speculative="self:layers=1", num_speculative_tokens=3
    )
    _server, runner, base_url = await start(engine, model_name="tiny")
    try:
        async with httpx.AsyncClient(base_url=base_url) as http:
            for text in ("abcabcabcabc", "hello hello hello"):
                resp = await http.post(
                    "/completions", json={"model": "tiny", "prompt": text, "max_tokens": 24, "temperature": 0}
                )
                assert resp.status_code == 200
            values = _values((await http.get(base_url.removesuffix("/v1") + "/metrics")).text)
    finally:
        await runner.cleanup()  # type: ignore[attr-defined]
    assert all_blocks_free(engine)
    m = engine.speculator.metrics
    method = 'method="self:layers=1"'
    assert m.num_steps > 0
    for i, (proposed, accepted) in enumerate(
        zip(m.proposed_by_position, m.accepted_by_position, strict=True)
    ):
        labels = f'{{{method},position="{i + 1}"}}'
        assert values[f"weir_engine_spec_draft_tokens_total{labels}"] == proposed
        assert values[f"weir_engine_spec_accepted_tokens_total{labels}"] == accepted
        assert values[f"weir_engine_spec_acceptance_rate{labels}"] == accepted / proposed
    assert values[f"weir_engine_spec_verification_steps_total{{{method}}}"] == m.num_steps
    assert values[f"weir_engine_spec_emitted_tokens_total{{{method}}}"] == m.num_emitted_tokens
    mean = values[f"weir_engine_spec_mean_accepted_tokens_per_step{{{method}}}"]
    assert mean == m.num_accepted_tokens / m.num_steps and mean > 0
    # the tokens emitted in the last 10 s (all of them unless this machine is very slow) per second
    assert 0 < values[f"weir_engine_spec_tokens_per_second{{{method}}}"] <= m.num_emitted_tokens / 10


def test_no_speculative_metrics_without_speculation(tiny_engine: LLMEngine) -> None:
    from engine.metrics import EngineMetrics

    tiny_engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    text = EngineMetrics(tiny_engine.stats).render().decode()
    assert "weir_engine_num_requests_running" in text and "weir_engine_spec_" not in text


def test_a_draft_models_kv_cache_is_reported_beside_the_models() -> None:
    """With a draft model half the KV memory is its cache, a pool of its own: the stats and /metrics
    report it (weir_engine_draft_kv_cache_*) beside the model's, whose usage (what new requests wait on,
    the load report's kv_cache_usage_perc) stays the model's alone."""
    from engine.metrics import EngineMetrics

    engine = LLMEngine.from_config(
        KNOWN_MODELS["tiny"], num_kv_blocks=NUM_BLOCKS, speculative="self:layers=1", num_speculative_tokens=3
    )
    metrics = EngineMetrics(engine.stats)
    engine.add_request("a", [5, 6, 7] * 12, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    while engine.speculator.metrics.num_steps == 0:  # until it has drafted
        engine.step()
    s = engine.stats()
    target_used = s.kv_blocks_total - s.kv_blocks_free
    assert s.draft_kv_blocks_total == s.kv_blocks_total == NUM_BLOCKS
    # the draft holds the prompt and its drafts: as many blocks as the model's, give or take one
    assert abs((s.draft_kv_blocks_total - s.draft_kv_blocks_free) - target_used) <= 1
    values = _values(metrics.render().decode())
    assert values["weir_engine_draft_kv_cache_blocks_total"] == NUM_BLOCKS
    assert values["weir_engine_draft_kv_cache_blocks_free"] == s.draft_kv_blocks_free
    assert values["weir_engine_draft_kv_cache_usage_ratio"] == 1 - s.draft_kv_blocks_free / NUM_BLOCKS
    assert values["weir_engine_kv_cache_usage_ratio"] == target_used / NUM_BLOCKS
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert s.draft_kv_blocks_free == s.draft_kv_blocks_total and s.kv_blocks_free == s.kv_blocks_total


def test_no_draft_cache_metrics_without_a_draft_model(make_engine: Callable[..., LLMEngine]) -> None:
    from engine.metrics import EngineMetrics

    engine = make_engine(speculative="ngram")
    engine.generate([[1, 2, 3, 1, 2]], SamplingParams(max_tokens=3, temperature=0))
    stats = engine.stats()
    assert stats.draft_kv_blocks_total == 0
    values = _values(EngineMetrics(engine.stats).render().decode())
    assert "weir_engine_kv_cache_blocks_total" in values
    assert not [name for name in values if name.startswith("weir_engine_draft_kv_cache")]
