"""How well a score ranks outcomes: AUC, with intervals. Shared by training (`weir router train
--holdout`), the benchmarks and the admin API's live check of a route's head on its compared traffic;
numpy only, so the gateway can use it without loading torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

# Rows of each kind (needed the strong model, did not) before a ranking is called better or worse
# than chance: with fewer, one lucky split separates perfectly and every interval collapses to a point.
VERDICT_MIN_EACH = 10


def mid_ranks(scores: np.ndarray) -> np.ndarray:
    """Each score's 1-based rank among `scores`, tied scores sharing their average rank."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    return (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """The share of (positive, negative) pairs the scores rank the right way round, ties half (the
    Mann-Whitney U over the pair count); NaN without both kinds of row."""
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = mid_ranks(scores)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def auc_interval(
    scores: dict[str, np.ndarray], positive: np.ndarray, rounds: int = 2000, seed: int = 0
) -> dict[str, tuple[float, float, float]]:
    """AUC (positive > negative) of each score with a 95% bootstrap interval (positive and negative
    rows resampled separately, the same draws for every score), and of each score minus the first one
    (paired), keyed "name - first"."""
    rng = np.random.default_rng(seed)
    pos, neg = np.flatnonzero(positive), np.flatnonzero(~positive)
    draws: dict[str, list[float]] = {name: [] for name in scores}
    for _ in range(rounds):
        pick = np.concatenate([rng.choice(pos, len(pos)), rng.choice(neg, len(neg))])
        for name, sc in scores.items():
            draws[name].append(auc(sc[pick], positive[pick]))
    first = next(iter(scores))
    out: dict[str, tuple[float, float, float]] = {}
    for name, sc in scores.items():
        lo, hi = np.percentile(draws[name], [2.5, 97.5])
        out[name] = (auc(sc, positive), float(lo), float(hi))
        if name != first:
            lo, hi = np.percentile(np.array(draws[name]) - np.array(draws[first]), [2.5, 97.5])
            out[f"{name} - {first}"] = (out[name][0] - out[first][0], float(lo), float(hi))
    return out


def auc_normal_interval(value: float, positives: int, negatives: int) -> tuple[float, float]:
    """95% interval of an AUC from its pair counts alone (Hanley and McNeil, 1982): cheap enough for
    a request handler, where `auc_interval`'s bootstrap is not, and close to it at a few hundred rows."""
    q1, q2 = value / (2 - value), 2 * value**2 / (1 + value)
    variance = (
        value * (1 - value) + (positives - 1) * (q1 - value**2) + (negatives - 1) * (q2 - value**2)
    ) / (positives * negatives)
    half = 1.96 * math.sqrt(max(variance, 0.0))
    return max(0.0, value - half), min(1.0, value + half)


@dataclass(frozen=True, slots=True)
class HeadRanking:
    """How a difficulty head's scores ranked requests a judge compared: `auc` is the chance that one
    only the strong model answered acceptably scored above one that did not (0.5: a coin toss)."""

    comparisons: int
    needs_strong: int
    auc: float | None  # None (and the interval too) until both kinds have been compared
    low: float | None
    high: float | None
    verdict: str  # "better than chance", "worse than chance" or "not yet clear"

    @property
    def enough(self) -> bool:
        """Whether there are enough of each kind for a verdict (and so an AUC and its interval)."""
        return min(self.needs_strong, self.comparisons - self.needs_strong) >= VERDICT_MIN_EACH


def head_ranking(scores: Sequence[float], needs_strong: Sequence[bool]) -> HeadRanking:
    positive = np.asarray(needs_strong, dtype=bool)
    positives = int(positive.sum())
    negatives = len(positive) - positives
    value = auc(np.asarray(scores, dtype=float), positive)
    if math.isnan(value):
        return HeadRanking(len(positive), positives, None, None, None, "not yet clear")
    low, high = auc_normal_interval(value, positives, negatives)
    found = HeadRanking(len(positive), positives, value, low, high, "not yet clear")
    if found.enough and (low > 0.5 or high < 0.5):
        found = replace(found, verdict="better than chance" if low > 0.5 else "worse than chance")
    return found
