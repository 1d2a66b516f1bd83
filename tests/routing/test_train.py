"""Training on the tiny MMLU slice and on feedback JSON lines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import routing.train as train_module
from routing.difficulty import DifficultyHead, encode, fallback_features
from routing.embed import StaticEmbedder
from routing.train import (
    MIN_BLEND_SLOPE,
    Outcomes,
    TrainConfig,
    blend_aucs,
    cross_fitted_components,
    fit_blend,
    fit_head,
    load_jsonl,
    load_mmlu,
    prompt_fold,
    question_stem,
    ridge_group_gain,
)

FAST = TrainConfig(epochs=15, sparse_buckets=1 << 16)


@pytest.fixture(scope="module")
def embedder() -> StaticEmbedder:
    return StaticEmbedder.from_minilm()


def apgr(score: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> float:
    order = np.argsort(-score, kind="stable")
    quality = weak.sum() + np.concatenate([[0.0], np.cumsum((strong.astype(float) - weak)[order])])
    pgr = (quality / len(score) - weak.mean()) / (strong.mean() - weak.mean())
    return float(np.mean((pgr[1:] + pgr[:-1]) / 2))


def test_loads_the_slice_and_drops_contaminated_prompts(fixture_dir: Path) -> None:
    data = load_mmlu(fixture_dir)
    assert len(data) == 299
    contaminated = json.loads((fixture_dir / "contaminated_prompts.jsonl").read_text())["eval_prompt"]
    assert contaminated not in data.prompts
    assert load_mmlu(fixture_dir, drop_contaminated=False).prompts.count(contaminated) == 1
    assert sorted(set(data.groups)) == ["conceptual_physics", "world_religions"]


def test_training_beats_chance_on_held_out_prompts(fixture_dir: Path, embedder: StaticEmbedder) -> None:
    data = load_mmlu(fixture_dir)
    enc = encode(embedder, data.prompts)
    test = np.array([prompt_fold(p, 3) == 0 for p in data.prompts])
    train_idx, test_idx = np.nonzero(~test)[0], np.nonzero(test)[0]
    head = fit_head(data.subset(train_idx), enc.subset(train_idx), FAST)
    score = head.p_strong(enc.subset(test_idx))
    assert np.all((score >= 0) & (score <= 1))
    ours = apgr(score, data.weak[test_idx], data.strong[test_idx])
    rng = np.random.default_rng(0)
    chance = np.mean(
        [apgr(rng.random(len(test_idx)), data.weak[test_idx], data.strong[test_idx]) for _ in range(200)]
    )
    assert chance == pytest.approx(0.5, abs=0.03)
    assert ours > chance + 0.15


def test_training_is_deterministic(fixture_dir: Path, embedder: StaticEmbedder) -> None:
    data = load_mmlu(fixture_dir)
    enc = encode(embedder, data.prompts)
    cfg = TrainConfig(epochs=3, sparse_buckets=1 << 16)
    a = fit_head(data, enc, cfg)
    b = fit_head(data, enc, cfg)
    np.testing.assert_array_equal(a.w1, b.w1)
    np.testing.assert_array_equal(a.sparse_w, b.sparse_w)
    np.testing.assert_array_equal(a.blend, b.blend)


def test_trains_from_feedback_without_groups(
    tmp_path: Path, fixture_dir: Path, embedder: StaticEmbedder
) -> None:
    data = load_mmlu(fixture_dir)
    path = tmp_path / "feedback.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"prompt": p, "weak_correct": bool(w), "strong_correct": bool(s)})
            for p, w, s in zip(data.prompts, data.weak, data.strong, strict=True)
        )
    )
    feedback = load_jsonl(path)
    assert feedback.groups is None and len(feedback) == len(data)
    head = fit_head(feedback, encode(embedder, feedback.prompts), TrainConfig(epochs=5))
    assert head.group_gain.shape == (0,)
    scores = head.p_strong(encode(embedder, data.prompts[:5]))
    assert np.all((scores >= 0) & (scores <= 1))


def test_refuses_too_little_data(embedder: StaticEmbedder, fixture_dir: Path) -> None:
    data = load_mmlu(fixture_dir).subset(np.arange(10))
    with pytest.raises(ValueError, match="at least 20"):
        fit_head(data, encode(embedder, data.prompts))
    # Prompts encoded without an embedder's recipe: the head could not say what it reads.
    full = load_mmlu(fixture_dir)
    unnamed = replace(encode(embedder, full.prompts), recipe=None)
    with pytest.raises(ValueError, match="not encoded by an embedder"):
        fit_head(full, unnamed)


def test_feedback_rows_may_score_only_one_model(
    tmp_path: Path, fixture_dir: Path, embedder: StaticEmbedder
) -> None:
    # Live feedback scores the answer of the model that served: each row knows one outcome.
    data = load_mmlu(fixture_dir)
    rows = []
    for i, (p, w, s) in enumerate(zip(data.prompts, data.weak, data.strong, strict=True)):
        rows.append(
            {"prompt": p, "weak_correct": bool(w)} if i % 2 else {"prompt": p, "strong_correct": bool(s)}
        )
    path = tmp_path / "partial.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    partial = load_jsonl(path)
    assert partial.partial and (partial.known().sum(axis=1) == 1).all()
    head = fit_head(partial, encode(embedder, partial.prompts), TrainConfig(epochs=5))
    assert head.meta["weak_labelled"] + head.meta["strong_labelled"] == len(data)
    scores = head.p_strong(encode(embedder, data.prompts[:5]))
    assert np.all((scores > 0) & (scores < 1))
    path.write_text(json.dumps({"prompt": "x", "weak_correct": None}))
    with pytest.raises(ValueError, match="neither"):
        load_jsonl(path)


def test_sparse_part_learns_and_version_1_heads_still_load(
    tmp_path: Path, fixture_dir: Path, embedder: StaticEmbedder
) -> None:
    data = load_mmlu(fixture_dir)
    enc = encode(embedder, data.prompts)
    head = fit_head(data, enc, TrainConfig(epochs=3, sparse_buckets=1 << 16, blend_inputs="components"))
    assert head.blend.shape == (4,) and head.components(enc).shape == (len(data), 3)
    # The sparse regressions fit their training rows better than a constant does.
    p = head.sparse_correct(enc)
    for column, y in enumerate((data.weak, data.strong)):
        base = y.mean()
        constant = -np.mean(y * np.log(base) + (1 - y) * np.log(1 - base))
        fitted = -np.mean(y * np.log(p[:, column]) + (1 - y) * np.log(1 - p[:, column]))
        assert fitted < constant
    head.save(tmp_path / "v2")
    np.testing.assert_allclose(
        DifficultyHead.load(tmp_path / "v2").p_strong(enc), head.p_strong(enc), atol=2e-3
    )
    old = fit_head(data, enc, TrainConfig(epochs=3, sparse_buckets=0, blend_inputs="components"))
    old.meta["version"] = 1
    old.save(tmp_path / "v1")
    assert not (
        set(load_file(str(tmp_path / "v1" / "difficulty_head.safetensors"))) & set(DifficultyHead.SPARSE)
    )
    np.testing.assert_allclose(
        DifficultyHead.load(tmp_path / "v1").p_strong(enc), old.p_strong(enc), atol=2e-3
    )


def test_blend_is_calibrated_on_scores_from_heads_that_never_saw_the_row(
    fixture_dir: Path, embedder: StaticEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = load_mmlu(fixture_dir)
    enc = encode(embedder, data.prompts)
    cfg = TrainConfig(epochs=3, sparse_buckets=1 << 16, calibration_folds=3, blend_inputs="components")
    seen: list[set[str]] = []
    fit_parts = train_module._fit_parts

    def recording(d: Outcomes, e: object, c: TrainConfig) -> DifficultyHead:
        seen.append(set(d.prompts))
        return fit_parts(d, e, c)  # type: ignore[arg-type]

    monkeypatch.setattr(train_module, "_fit_parts", recording)
    components, _, _ = cross_fitted_components(data, enc, cfg, 3)
    # One head per fold, and each fold's rows were left out of the head that scored them.
    assert len(seen) == 3
    fold = np.array([prompt_fold(p, 3) for p in data.prompts])
    for k, trained_on in enumerate(seen):
        assert not trained_on & {p for p, f in zip(data.prompts, fold, strict=True) if f == k}
        assert len(trained_on) == (fold != k).sum()
    monkeypatch.undo()
    head = fit_head(data, enc, cfg)
    target = (~data.weak & data.strong).astype(float)
    np.testing.assert_allclose(head.blend, fit_blend(components, target), rtol=1e-5, atol=1e-6)
    # The in-sample blend is a different fit (it sees the sparse part's near-memorised training rows).
    in_sample = fit_head(data, enc, replace(cfg, calibration_folds=0))
    assert not np.allclose(in_sample.blend, head.blend, rtol=1e-3)


def test_the_blend_takes_in_length_only_where_it_ranks_the_rows_better(
    tmp_path: Path, fixture_dir: Path, embedder: StaticEmbedder
) -> None:
    data = load_mmlu(fixture_dir)
    enc = encode(embedder, data.prompts)
    cfg = TrainConfig(epochs=3, sparse_buckets=1 << 16, calibration_folds=3)
    long = enc.length > np.median(enc.length)
    everyone_right = np.ones(len(data), bool)
    # The weak model fails exactly the long prompts: length ranks them perfectly.
    head = fit_head(Outcomes(data.prompts, ~long, everyone_right), enc, cfg)
    aucs, chosen = head.meta["blend_aucs"], head.meta["blend_inputs"]
    assert chosen == "components+length" and aucs[chosen] > aucs["components"]
    assert head.reads_length and head.blend.shape == (5,) and head.meta["version"] == 5
    p = head.p_strong(enc)
    assert train_module.auc(p, long) > 0.95
    head.save(tmp_path / "v5")
    loaded = DifficultyHead.load(tmp_path / "v5")
    assert loaded.reads_length
    np.testing.assert_allclose(loaded.p_strong(enc), p, atol=2e-3)
    # The weak model fails exactly the short prompts: length would rank them backwards, so it stays out.
    against = fit_head(Outcomes(data.prompts, long, everyone_right), enc, cfg)
    against_aucs = against.meta["blend_aucs"]
    assert against.meta["blend_inputs"] == "components"
    assert against_aucs["components+length"] < against_aucs["components"]
    assert not against.reads_length and against.blend.shape == (4,) and against.meta["version"] == 4
    # Asked for by name; and no choice without cross-fitted scores to choose on.
    named = fit_head(data, enc, replace(cfg, blend_inputs="components+length"))
    assert named.reads_length and "blend_aucs" not in named.meta
    assert named.blend.shape == (5,) and named.blend[3] > 0
    assert fit_head(data, enc, replace(cfg, calibration_folds=0)).meta["blend_inputs"] == "components"
    with pytest.raises(ValueError, match="blend_inputs"):
        fit_head(data, enc, replace(cfg, blend_inputs="everything"))
    # A head older than version 5 cannot read length: a blend one weight too long is refused.
    head.meta["version"] = 4
    with pytest.raises(ValueError, match="before version 5"):
        head.check("test")


def test_blend_aucs_read_feedback_rows_by_the_weak_outcome_they_know() -> None:
    rng = np.random.default_rng(3)
    n = 400
    length = rng.random(n)
    weak_known = rng.random(n) < 0.5
    # Where the weak model answered it failed the long prompts; the strong model's rows say nothing.
    data = Outcomes(
        [str(i) for i in range(n)], length < 0.5, rng.random(n) < 0.5, None, weak_known, ~weak_known
    )
    aucs = blend_aucs(rng.normal(size=(n, 3)), length, data)
    assert abs(aucs["components"] - 0.5) < 0.1 and aucs["components+length"] > aucs["components"] + 0.15


def test_fit_blend_weighs_components_equally_and_matches_the_base_rate() -> None:
    rng = np.random.default_rng(0)
    signal = rng.normal(size=5000)
    components = np.stack([signal, 10 * (signal + rng.normal(size=5000))], axis=1)
    target = (rng.random(5000) < 1 / (1 + np.exp(-(signal - 1.5)))).astype(float)
    blend = fit_blend(components, target)
    # Equal weight after scaling each component to unit spread.
    np.testing.assert_allclose(
        blend[0] * components[:, 0].std(), blend[1] * components[:, 1].std(), rtol=1e-5
    )
    assert blend[0] > 0
    # Platt scaling with a bias: the mean predicted probability equals the observed rate.
    p = 1 / (1 + np.exp(-(components @ blend[:-1] + blend[-1])))
    assert p.mean() == pytest.approx(target.mean(), abs=2e-3)


def test_fit_blend_never_turns_the_head_upside_down() -> None:
    # Cross-fitted scores that happen to rank the rows backwards (small data): the fitted slope would
    # be negative. The blend keeps the components' order with the smallest slope and the base rate.
    rng = np.random.default_rng(1)
    signal = rng.normal(size=400)
    target = (rng.random(400) < 1 / (1 + np.exp(signal))).astype(float)  # higher signal, fewer positives
    components = np.stack([signal, 3 * signal + rng.normal(size=400)], axis=1)
    blend = fit_blend(components, target)
    assert (blend[:-1] > 0).all()
    np.testing.assert_allclose(blend[:-1] * components.std(axis=0), MIN_BLEND_SLOPE, rtol=1e-5)
    p = 1 / (1 + np.exp(-(components @ blend[:-1] + blend[-1])))
    assert p.mean() == pytest.approx(target.mean(), abs=2e-3) and p.max() - p.min() < 0.01


def test_ridge_group_gain_learns_what_a_confused_posterior_means() -> None:
    # Two groups with gains 0.4 and 0.0; the posterior puts 0.6 on the right group, 0.4 on the other.
    rng = np.random.default_rng(0)
    group = rng.integers(0, 2, 4000)
    gain = np.where(group == 0, 0.4, 0.0) + rng.normal(0, 0.1, 4000)
    posterior = np.where(group[:, None] == np.arange(2), 0.6, 0.4)
    g = ridge_group_gain(posterior, gain, alpha=1e-3)
    # A posterior's expected gain reproduces its group's mean gain: the map undoes the confusion,
    # which the groups' own means would not (they give 0.6 * 0.4 = 0.24 and 0.4 * 0.4 = 0.16).
    np.testing.assert_allclose([0.6, 0.4] @ g, 0.4, atol=0.01)
    np.testing.assert_allclose([0.4, 0.6] @ g, 0.0, atol=0.01)
    # Strong regularisation pulls every group to the overall mean.
    np.testing.assert_allclose(ridge_group_gain(posterior, gain, alpha=1e9), gain.mean(), atol=1e-4)


def test_group_ridge_fits_the_group_gains_on_cross_fitted_posteriors(
    fixture_dir: Path, embedder: StaticEmbedder
) -> None:
    data = load_mmlu(fixture_dir)
    enc = encode(embedder, data.prompts)
    cfg = TrainConfig(
        epochs=3, sparse_buckets=1 << 16, calibration_folds=3, group_ridge=1.0, blend_inputs="components"
    )
    head = fit_head(data, enc, cfg)
    components, _, posterior = cross_fitted_components(data, enc, cfg, 3)
    assert posterior.shape == (len(data), 2)
    np.testing.assert_allclose(posterior.sum(axis=1), 1.0, rtol=1e-5)
    gain = data.strong.astype(float) - data.weak
    np.testing.assert_allclose(head.group_gain, ridge_group_gain(posterior, gain, 1.0), rtol=1e-5)
    components[:, 0] = posterior @ head.group_gain
    target = (~data.weak & data.strong).astype(float)
    np.testing.assert_allclose(head.blend, fit_blend(components, target), rtol=1e-5, atol=1e-6)
    # Off (the default), the group gains are the groups' shrunk mean gains.
    plain = fit_head(data, enc, replace(cfg, group_ridge=0.0))
    assert not np.allclose(plain.group_gain, head.group_gain, atol=1e-3)


def test_fallback_is_fitted_on_stems_of_groups_the_scoring_head_never_saw(
    tmp_path: Path, fixture_dir: Path, embedder: StaticEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = load_mmlu(fixture_dir)
    enc = encode(embedder, data.prompts)
    stems = encode(embedder, [question_stem(p) for p in data.prompts])
    assert enc.options is not None and enc.options.all()
    assert stems.options is not None and not stems.options.any()
    assert not any("\nA. " in s or s.endswith("Answer:") for s in map(question_stem, data.prompts))
    cfg = replace(FAST, epochs=3, calibration_folds=0, fallback_folds=2)
    seen: list[set[str]] = []
    fit_parts = train_module._fit_parts

    def spy(d: Outcomes, e: object, c: TrainConfig) -> DifficultyHead:
        seen.append(set(d.groups or []))
        return fit_parts(d, e, c)  # type: ignore[arg-type]

    monkeypatch.setattr(train_module, "_fit_parts", spy)
    head = fit_head(data, enc, cfg, stems)
    # The head itself, then two heads on folds by prompt hash (both subjects seen), then one head per
    # fold of whole subjects, each trained on the other subject only.
    both = {"conceptual_physics", "world_religions"}
    assert seen[:3] == [both, both, both]
    assert sorted(map(sorted, seen[3:])) == [["conceptual_physics"], ["world_religions"]]
    assert head.fallback.shape == (9,) and np.isfinite(head.fallback).all()
    # Plain prompts go through the fallback, multiple-choice ones through the blend; both survive saving.
    plain = encode(embedder, ["What is the speed of light?", data.prompts[0]])
    assert plain.options is not None and plain.options.tolist() == [False, True]
    p = head.p_strong(plain)
    components, confidence = head.components_and_confidence(plain)
    x = fallback_features(components, plain.length, confidence)[0]
    assert x[4:7] == pytest.approx(components[0] * confidence[0]) and x[-1] == pytest.approx(confidence[0])
    assert p[0] == pytest.approx(1 / (1 + np.exp(-(x @ head.fallback[:-1] + head.fallback[-1]))), rel=1e-5)
    blend = head.components(plain)[1] @ head.blend[:-1] + head.blend[-1]
    assert p[1] == pytest.approx(1 / (1 + np.exp(-blend)), rel=1e-5)
    head.save(tmp_path / "v3")
    np.testing.assert_allclose(DifficultyHead.load(tmp_path / "v3").p_strong(plain), p, atol=2e-3)
    # Without stems (e.g. a tenant's chat feedback) there is no fallback: every prompt gets the blend.
    monkeypatch.setattr(train_module, "_fit_parts", fit_parts)
    assert fit_head(data, enc, cfg).fallback.shape == (0,)


def test_logistic_matches_a_known_solution() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 2))
    y = rng.random(4000) < 1 / (1 + np.exp(-(1.5 * x[:, 0] - 0.5 * x[:, 1] + 0.3)))
    w = train_module._logistic(x, y, c=1e6)
    np.testing.assert_allclose(w, [1.5, -0.5, 0.3], atol=0.15)
    # A strong penalty shrinks the weights but not the intercept.
    shrunk = train_module._logistic(x, y, c=1e-5)
    assert np.abs(shrunk[:2]).max() < 0.05 and abs(shrunk[2]) > 0.1
