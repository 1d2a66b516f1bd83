"""The shipped difficulty classifier: loads, scores in [0, 1], deterministic, sensible on MMLU."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from routing.difficulty import DEFAULT_HEAD_DIR, DifficultyClassifier, DifficultyHead, encode, prompt_text
from routing.embed import StaticEmbedder


def fixture_prompts(fixture_dir: Path, subject: str) -> list[str]:
    with (fixture_dir / f"mmlu_{subject}.csv").open(newline="") as fh:
        return [row[0] for row in list(csv.reader(fh))[1:]]


def test_shipped_head_loads_with_its_metadata() -> None:
    head = DifficultyHead.load(DEFAULT_HEAD_DIR)
    assert head.meta["rows"] > 10_000
    assert len(head.meta["groups"]) == 57
    assert head.group_gain.shape == (57,)
    assert head.static_dim == 384
    # Calibrated on cross-fitted scores (v3 recipe), not on the rows the head was trained on.
    assert head.meta["config"]["calibration_folds"] >= 2


def test_scores_are_probabilities_and_deterministic(classifier: DifficultyClassifier) -> None:
    prompts = [
        "",
        "hi",
        "What is the capital of France?",
        "Prove that every bounded monotone sequence of real numbers converges." * 3,
        "x" * 20_000,
        "¿Cuál es la derivada de sin(x)·eˣ? 用中文回答。",
    ]
    first = [classifier.score(p) for p in prompts]
    assert all(0.0 <= s <= 1.0 for s in first)
    assert first == [classifier.score(p) for p in prompts]
    np.testing.assert_allclose(classifier.score_many(prompts), first, rtol=1e-5, atol=1e-7)
    assert classifier.score_many([]) == []


def test_ranks_subjects_by_how_much_the_strong_model_helps(
    classifier: DifficultyClassifier, fixture_dir: Path
) -> None:
    # On conceptual physics GPT-4 beats Mixtral by 25 points; on world religions it is no better.
    physics = classifier.score_many(fixture_prompts(fixture_dir, "conceptual_physics"))
    religions = classifier.score_many(fixture_prompts(fixture_dir, "world_religions"))
    assert np.mean(physics) > np.mean(religions) + 0.05


def test_head_round_trips_and_refuses_other_versions(tmp_path: Path) -> None:
    head = DifficultyHead.load(DEFAULT_HEAD_DIR)
    head.save(tmp_path / "copy")
    again = DifficultyHead.load(tmp_path / "copy")
    enc = encode(StaticEmbedder.from_minilm(), ["one prompt", "and another, longer prompt"])
    np.testing.assert_array_equal(head.p_strong(enc), again.p_strong(enc))
    again.meta["version"] = 999
    again.save(tmp_path / "future")
    with pytest.raises(ValueError, match="version"):
        DifficultyHead.load(tmp_path / "future")


def test_prompt_text_reads_the_last_user_turn() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "answer"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is"},
                {"type": "image_url"},
                {"type": "text", "text": "2+2?"},
            ],
        },
    ]
    assert prompt_text(messages) == "What is\n2+2?"
    assert prompt_text([{"role": "system", "content": "only system"}]) == ""
