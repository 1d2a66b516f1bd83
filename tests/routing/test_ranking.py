"""routing.ranking: the AUC the benchmarks, training's holdout check and the admin API share."""

from __future__ import annotations

import numpy as np

from routing.ranking import auc, auc_interval, auc_normal_interval


def test_auc_counts_ordered_pairs_with_ties_half() -> None:
    assert auc(np.array([0.9, 0.1, 0.5, 0.5]), np.array([True, False, True, False])) == 0.875
    assert np.isnan(auc(np.array([0.3, 0.4]), np.array([True, True])))


def test_the_normal_interval_agrees_with_the_bootstrap_at_a_few_hundred_rows() -> None:
    rng = np.random.default_rng(3)
    positive = rng.random(600) < 0.3
    scores = rng.normal(size=600) + 0.6 * positive  # an AUC of about 0.66
    value, lo, hi = auc_interval({"s": scores}, positive, rounds=2000)["s"]
    low, high = auc_normal_interval(value, int(positive.sum()), int((~positive).sum()))
    assert 0.6 < value < 0.72
    assert abs(low - lo) < 0.01 and abs(high - hi) < 0.01
    assert auc_normal_interval(1.0, 5, 5)[1] == 1.0 and auc_normal_interval(0.0, 5, 5)[0] == 0.0
