"""The offline evaluation's helpers (`benchmarks/routing_eval.py`): metrics, question stems, the probe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.routing_eval import (
    ARTEFACT_SUBJECT,
    PROBE,
    artefact_free,
    auc,
    blend_across_folds,
    metrics,
    question_stem,
    reliability,
)
from routing.train import Outcomes, load_mmlu


def test_question_stem_drops_the_options_of_every_fixture_prompt(fixture_dir: Path) -> None:
    data = load_mmlu(fixture_dir)
    stems = [question_stem(p) for p in data.prompts]
    for prompt, stem in zip(data.prompts, stems, strict=True):
        assert stem and prompt.startswith(stem)
        assert "\nA. " not in stem and not stem.endswith("Answer:")
    # A prompt without options keeps its text (only a trailing "Answer:" goes).
    assert question_stem("What is 2 + 2?\nAnswer:") == "What is 2 + 2?"
    assert question_stem("hi") == "hi"


def test_apgr_of_a_perfect_a_random_and_a_reversed_ranking() -> None:
    rng = np.random.default_rng(0)
    weak = rng.random(4000) < 0.6
    strong = rng.random(4000) < 0.8
    gain = strong.astype(float) - weak
    perfect = metrics(gain, weak, strong)["APGR"]
    chance = metrics(rng.random(4000), weak, strong)["APGR"]
    reversed_ = metrics(-gain, weak, strong)["APGR"]
    assert perfect > 0.9 and reversed_ < 0.1
    assert abs(chance - 0.5) < 0.05


def test_auc_counts_ties_as_half() -> None:
    assert auc(np.array([2.0, 3.0]), np.array([1.0])) == 1.0
    assert auc(np.array([1.0]), np.array([1.0])) == 0.5
    assert auc(np.array([0.0]), np.array([1.0, 2.0])) == 0.0


def test_the_probe_is_not_separable_by_length_alone() -> None:
    # The probe must test more than "long prompts are hard": the easy and hard lists overlap in length.
    lengths = {kind: np.array([len(p) for _, p in rows], float) for kind, rows in PROBE.items()}
    assert auc(lengths["hard"], lengths["easy"]) < 0.75
    assert lengths["easy"].max() > np.median(lengths["hard"]) > lengths["hard"].min()
    assert len({p for rows in PROBE.values() for _, p in rows}) == sum(len(r) for r in PROBE.values())


def test_blend_across_folds_never_uses_a_folds_own_labels() -> None:
    rng = np.random.default_rng(0)
    components = rng.normal(size=(3000, 3))
    target = (rng.random(3000) < 1 / (1 + np.exp(-components.sum(axis=1) + 1))).astype(float)
    fold = rng.integers(0, 5, 3000)
    (p,) = blend_across_folds(components, target, fold)
    assert np.all((p > 0) & (p < 1))
    # Flipping every label of fold 0 moves the other folds' scores, never fold 0's own.
    flipped = np.where(fold == 0, 1 - target, target)
    (q,) = blend_across_folds(components, flipped, fold)
    np.testing.assert_array_equal(p[fold == 0], q[fold == 0])
    assert not np.allclose(p[fold != 0], q[fold != 0])


def test_reliability_of_a_calibrated_and_an_over_confident_score() -> None:
    rng = np.random.default_rng(0)
    p = rng.uniform(0.0, 0.6, 20000)
    outcome = rng.random(20000) < p
    ece, cells = reliability(p, outcome)
    assert ece < 0.02 and len(cells) == 10
    over, _ = reliability(np.clip(2 * p - 0.1, 0, 1), outcome)
    assert over > 0.08


def test_artefact_free_scores_only_the_prompts_outside_the_artefact_subject(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = np.random.default_rng(0)
    n = 2000
    weak, strong = rng.random(n) < 0.6, rng.random(n) < 0.8
    groups = np.where(np.arange(n) < 500, ARTEFACT_SUBJECT, "other")
    data = Outcomes([str(i) for i in range(n)], weak, strong, list(groups))
    score = rng.random(n)
    artefact_free({"ours": score, "always weak": np.zeros(n)}, data)
    out = capsys.readouterr().out
    keep = groups == "other"
    expected = metrics(score[keep], weak[keep].astype(float), strong[keep].astype(float))["APGR"]
    assert f"(1500 prompts): ours {expected:.4f}" in out and "always" not in out
    # Without the subject in the data there is nothing to print.
    artefact_free({"ours": score}, Outcomes(data.prompts, weak, strong, ["other"] * n))
    assert capsys.readouterr().out == ""
