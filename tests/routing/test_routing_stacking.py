"""Helpers of the stacking experiments (`benchmarks/routing_stacking.py`): option parsing, structure
features, and fitting on other folds only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.routing_stacking import (
    STRUCTURE,
    across_folds,
    cross_fitted,
    encode_by_depth,
    equal_blend,
    learned_table,
    option_similarity,
    ridge_blend,
    split_options,
    structure_features,
)
from routing.difficulty import encode
from routing.train import TrainConfig, load_mmlu

MMLU_SHAPED = "Which of these is NOT a prime number?\nA. 2\nB. 3\nC. 9\nD. 11\nAnswer:"


def test_split_options_of_an_mmlu_prompt_and_of_a_chat_prompt(fixture_dir: Path) -> None:
    assert split_options(MMLU_SHAPED) == ("Which of these is NOT a prime number?", ["2", "3", "9", "11"])
    assert split_options("Write a haiku about autumn.") == ("Write a haiku about autumn.", [])
    for prompt in load_mmlu(fixture_dir).prompts:
        stem, options = split_options(prompt)
        assert len(options) == 4 and prompt.startswith(stem)
        assert not any(o.endswith("Answer:") for o in options)


def test_structure_features_see_negations_numbers_and_missing_options() -> None:
    names = {name: i for i, name in enumerate(STRUCTURE)}
    mmlu = structure_features(MMLU_SHAPED)
    chat = structure_features("Which colour is the sky on a clear day?")
    assert mmlu.shape == chat.shape == (len(STRUCTURE),)
    assert mmlu[names["NOT/EXCEPT/LEAST/FALSE"]] == 1 and chat[names["NOT/EXCEPT/LEAST/FALSE"]] == 0
    assert mmlu[names["numeric options share"]] == 1
    assert mmlu[names["options"]] == 4 and chat[names["options"]] == 0
    assert chat[names["stem ends with '?'"]] == 1


class _Mean:
    """A "model" that predicts the mean target of the rows it was fitted on."""

    def fit(self, x: np.ndarray, y: np.ndarray) -> _Mean:
        self.mean = float(y.mean())
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.full(len(x), self.mean)


def test_across_folds_never_fits_on_the_fold_it_scores() -> None:
    fold = np.repeat(np.arange(3), 4)
    y = np.repeat([0.0, 10.0, 20.0], 4)  # each fold's own target is distinct
    out = across_folds(_Mean, np.zeros((12, 1)), y, fold)
    # Fold 0 sees only folds 1 and 2 (mean 15), and so on.
    assert np.allclose(out, np.repeat([15.0, 10.0, 5.0], 4))


def test_equal_blend_scales_each_component_by_the_other_folds_spread() -> None:
    rng = np.random.default_rng(0)
    fold = np.arange(400) % 2
    comps = np.column_stack([rng.normal(0, 1, 400), rng.normal(0, 100, 400)])
    out = equal_blend(comps, fold)
    for k in (0, 1):
        scale = 1 / comps[fold != k].std(axis=0)
        assert np.allclose(out[fold == k], comps[fold == k] @ scale)
    # Neither component dominates: both correlate with the blend.
    assert min(abs(np.corrcoef(out, comps[:, j])[0, 1]) for j in (0, 1)) > 0.5


def test_cross_fitted_posterior_puts_held_out_subjects_in_their_own_columns(
    fixture_dir: Path, classifier
) -> None:
    data = load_mmlu(fixture_dir)
    subjects = sorted(set(data.groups))
    enc = encode(classifier.embedder, data.prompts)
    # Two folds of whole subjects: each head knows one subject, and its posterior has one column.
    fold = np.array([subjects.index(g) for g in data.groups])
    out = cross_fitted(data, enc, fold, TrainConfig(epochs=1, sparse_buckets=0, calibration_folds=0))
    assert out["posterior"].shape == (len(data), len(subjects))
    assert np.allclose(out["posterior"].sum(axis=1), 1.0)
    # A prompt's own subject was held out, so its head puts all mass on the other subject's column.
    own = out["posterior"][np.arange(len(data)), fold]
    assert np.allclose(own, 0.0)


def test_ridge_blend_fits_each_fold_on_the_other_folds_chosen_rows() -> None:
    rng = np.random.default_rng(0)
    n = 3000
    fold = rng.integers(0, 3, n)
    group = rng.integers(0, 4, n)
    parts = {
        "posterior": np.eye(4)[group] * 0.7 + 0.075,
        "components": rng.normal(size=(n, 3)),
    }
    gain = group * 0.1 + rng.normal(0, 0.3, n)
    fit_rows = group != 3
    score, used = ridge_blend(parts, gain, fold, fit_rows)
    assert len(used) == 3
    # Changing a fold's own gains, or the gains of rows left out of the fit, leaves its scores alone.
    other = gain.copy()
    other[(fold == 0) | ~fit_rows] = rng.normal(size=((fold == 0) | ~fit_rows).sum())
    again, _ = ridge_blend(parts, other, fold, fit_rows)
    np.testing.assert_allclose(again[fold == 0], score[fold == 0])
    assert not np.allclose(again[fold == 1], score[fold == 1])


def test_option_similarity_sees_an_option_that_repeats_the_question(classifier) -> None:
    embedder = classifier.embedder
    echo = "Which gas do plants absorb from the air?\nA. Which gas do plants absorb from the air?\nB. oxygen\nC. helium\nD. neon\nAnswer:"
    spread = "Which gas do plants absorb from the air?\nA. carbon dioxide\nB. a violin sonata\nC. tax law\nD. 42\nAnswer:"
    closest, margin, mean_between, max_between = option_similarity(embedder, echo)
    assert closest == pytest.approx(1.0, abs=1e-5) and margin > 0.2
    assert max_between <= 1.0 + 1e-6 and mean_between <= max_between
    assert option_similarity(embedder, spread)[0] < closest
    # A prompt without answer options has nothing to compare.
    assert not option_similarity(embedder, "Write a haiku about autumn.").any()


def test_learned_table_reproduces_targets_and_moves_unseen_tokens() -> None:
    """The learned table fits what its rows show (pooled rows close to the targets), and a token no
    row uses still changes, through the shared linear map, instead of staying in the old space."""
    import torch

    torch.manual_seed(0)
    base = torch.nn.functional.normalize(torch.randn(50, 8), dim=1)
    secret = torch.randn(8, 8)
    x = torch.zeros(30, 50)
    for row in range(30):
        x[row, torch.randperm(40)[:4]] = 0.25  # tokens 40-49 appear in no row
    target = torch.nn.functional.normalize(x @ base @ secret, dim=1)
    table = learned_table(x.to_sparse_csr(), target, base, l2=1e-4, steps=400)
    before = torch.nn.functional.cosine_similarity(x @ base, target).mean()
    after = torch.nn.functional.cosine_similarity(x @ table, target).mean()
    assert before < 0.8 and after > 0.95
    assert not torch.allclose(table[45], base[45], atol=1e-2)


def test_encode_by_depth_pools_after_every_layer_in_input_order() -> None:
    from routing.minilm import MiniLMEncoder

    prompts = ["a much longer prompt about the history of the Roman empire", "hi", MMLU_SHAPED]
    model = MiniLMEncoder(max_tokens=32, num_layers=3)
    by_depth = encode_by_depth(model, prompts, batch_size=2)  # sorted by length, batched with padding
    assert by_depth.shape == (3, len(prompts), 384)
    for layers in (1, 3):
        alone = MiniLMEncoder(max_tokens=32, num_layers=layers).encode(prompts, batch_size=1).numpy()
        np.testing.assert_allclose(by_depth[layers - 1], alone, atol=1e-5)
    assert not np.allclose(by_depth[0], by_depth[2], atol=1e-2)
