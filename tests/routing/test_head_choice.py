"""Two shipped heads and the choice between them: the encoder head (v4) where it fits the request-path
budget on this machine, else the static-table head (v3)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import routing.difficulty as difficulty
from routing.difficulty import (
    LATENCY_BUDGET_S,
    STATIC_HEAD_DIR,
    TAIL_FACTOR,
    TIMING_PROMPT,
    DifficultyClassifier,
    pick_head,
    scoring_time,
)
from routing.embed import DEFAULT_RECIPE, STATIC_RECIPE
from tests.routing.mmlu import fixture_prompts


def test_the_encoder_is_kept_only_where_its_estimated_p99_fits_the_budget() -> None:
    encoder = SimpleNamespace()
    fits = LATENCY_BUDGET_S / TAIL_FACTOR
    assert pick_head(encoder, timer=lambda clf: fits * 0.5) == "encoder"  # type: ignore[arg-type]
    assert pick_head(encoder, timer=lambda clf: fits) == "encoder"  # type: ignore[arg-type]
    assert pick_head(encoder, timer=lambda clf: fits * 1.01) == "static"  # type: ignore[arg-type]
    # An AVX2-only core: 14 ms for a full-length prompt.
    assert pick_head(encoder, timer=lambda clf: 0.014) == "static"  # type: ignore[arg-type]
    assert pick_head(encoder, budget_s=0.05, timer=lambda clf: 0.014) == "encoder"  # type: ignore[arg-type]


def test_timing_scores_a_prompt_the_encoder_reads_in_full(classifier: DifficultyClassifier) -> None:
    calls: list[str] = []
    seconds = scoring_time(SimpleNamespace(score=calls.append), runs=5)  # type: ignore[arg-type]
    assert calls == [TIMING_PROMPT] * 8 and seconds >= 0.0  # three warm-up calls, five timed
    # A multiple-choice prompt past the encoder's window and the token bag's, about as long as
    # MMLU's 99th percentile (2,190 characters): the timing is that of a prompt at the tail.
    assert len(classifier.embedder.token_ids(TIMING_PROMPT)) >= 510 and len(TIMING_PROMPT) >= 2000


def test_the_static_head_is_v3_on_the_static_table(fixture_dir: Path) -> None:
    static = DifficultyClassifier.default("static")
    assert static.kind == "static" and static.embedder.recipe == STATIC_RECIPE
    assert static.head.meta["version"] == 3 and len(static.head.fallback)  # v3 with its fallback
    assert DifficultyClassifier.load(STATIC_HEAD_DIR).head.meta == static.head.meta
    physics = static.score_many(fixture_prompts(fixture_dir, "conceptual_physics"))
    religions = static.score_many(fixture_prompts(fixture_dir, "world_religions"))
    assert np.mean(physics) > np.mean(religions) + 0.05
    assert all(0.0 < p < 1.0 for p in physics + religions)


def test_the_encoder_head_is_v4(classifier: DifficultyClassifier) -> None:
    assert classifier.kind == "encoder" and classifier.embedder.recipe == DEFAULT_RECIPE
    assert classifier.head.meta["version"] == 4


@pytest.fixture
def fresh_cache() -> Iterator[None]:
    difficulty._cached_default.cache_clear()
    yield
    difficulty._cached_default.cache_clear()


@pytest.mark.parametrize("chosen", ["encoder", "static"])
def test_auto_serves_the_head_the_timing_picks(
    chosen: str, fresh_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[str] = []

    def pick(encoder: DifficultyClassifier) -> str:
        timed.append(encoder.kind)
        return chosen

    monkeypatch.setattr(difficulty, "pick_head", pick)
    auto = DifficultyClassifier.default("auto")
    assert timed == ["encoder"] and auto.kind == chosen
    assert DifficultyClassifier.default("auto") is auto  # timed once per process
    prompt = "Why is the sky blue?"
    assert auto.score(prompt) == pytest.approx(DifficultyClassifier.default(chosen).score(prompt), abs=1e-6)


def test_an_unknown_head_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, encoder, static"):
        DifficultyClassifier.default("fastest")  # type: ignore[arg-type]
