"""Two shipped heads and the choice between them: the encoder head (on a student distilled from
MiniLM's first layers) where it fits the request-path budget on this machine, else the static-table
head (v3)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import routing.difficulty as difficulty
from routing.difficulty import (
    DEFAULT_HEAD_DIR,
    LATENCY_BUDGET_S,
    STATIC_HEAD_DIR,
    TAIL_FACTOR,
    TIMING_PROMPT,
    DifficultyClassifier,
    DifficultyHead,
    pick_head,
    scoring_time,
)
from routing.embed import DEFAULT_RECIPE, STATIC_RECIPE, STUDENT_RECIPE
from tests.routing.mmlu import fixture_prompts

V4_RECIPE = "minilm-l6-first3-96tok-v1"


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


def test_the_encoder_head_reads_the_distilled_student(
    classifier: DifficultyClassifier, tmp_path: Path
) -> None:
    assert classifier.kind == "encoder" and classifier.embedder.recipe == DEFAULT_RECIPE == STUDENT_RECIPE
    assert classifier.head.meta["version"] == 4
    # The student's three layers, 4 heads of 32 and 384 feed-forward neurons each, not MiniLM's 12 and 1,536.
    encoder = classifier.embedder.encoder  # type: ignore[attr-defined]
    assert [layer[0] for layer in encoder.layers] == [4, 4, 4] and encoder.max_tokens == 96
    assert [layer[5].packed.unpack()[0].shape for layer in encoder.layers] == [(384, 384)] * 3
    # A head fitted on v4's recipe (a tenant's, say) still loads, with MiniLM's own first layers.
    head = DifficultyHead.load(DEFAULT_HEAD_DIR)
    head.meta["embedder"] = V4_RECIPE
    head.save(tmp_path / "v4")
    v4 = DifficultyClassifier.load(tmp_path / "v4").embedder
    assert v4.recipe == V4_RECIPE and [layer[0] for layer in v4.encoder.layers] == [12, 12, 12]  # type: ignore[attr-defined]


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
