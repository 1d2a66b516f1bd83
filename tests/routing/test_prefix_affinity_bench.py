"""The prefix-affinity benchmark (`benchmarks/prefix_affinity.py`) puts three routes over the same
engine replicas; its config must stay one the gateway accepts, with the policies it compares."""

from __future__ import annotations

import random

from benchmarks.prefix_affinity import gateway_config, text
from gateway.config import parse_config


def test_the_benchmark_compares_affinity_with_random_spreading_and_one_replica() -> None:
    config = parse_config(gateway_config([8101, 8102, 8103], prefix_chars=1000), {})
    routes = {r.name: r for r in config.routes}
    assert routes["affinity"].policy == "prefix_affinity" and routes["affinity"].prefix_chars == 1000
    assert routes["spread"].policy == "weighted"
    assert {c.weight for c in routes["spread"].candidates} == {routes["spread"].candidates[0].weight}
    assert [c.model for c in routes["one"].candidates] == ["r0"]
    assert [m.backend for m in config.models] == ["e0", "e1", "e2"]
    assert {b.base_url for b in config.backends} == {f"http://127.0.0.1:{p}/v1" for p in (8101, 8102, 8103)}


def test_its_text_is_deterministic_and_about_the_length_asked() -> None:
    first, again = text(random.Random(3), 800), text(random.Random(3), 800)
    assert first == again and 800 <= len(first) < 800 + 160  # one sentence at most over
    assert text(random.Random(4), 800) != first
