"""StrongShareCalibrator: a target share of strong calls becomes a threshold on recent scores."""

from __future__ import annotations

import math
import random
import threading

import pytest

from routing.difficulty import StrongShareCalibrator


def routed_share(cal: StrongShareCalibrator, scores: list[float]) -> float:
    return sum(cal.route_strong(s) for s in scores) / len(scores)


@pytest.mark.parametrize("target", [0.1, 0.3, 0.5, 0.8])
def test_hits_target_share_on_steady_traffic(target: float) -> None:
    rng = random.Random(7)
    cal = StrongShareCalibrator(target, window=1000, min_samples=100)
    routed_share(cal, [rng.betavariate(2, 5) for _ in range(1000)])  # warm up the window
    share = routed_share(cal, [rng.betavariate(2, 5) for _ in range(4000)])
    assert share == pytest.approx(target, abs=0.03)


def test_follows_a_shift_in_traffic() -> None:
    rng = random.Random(1)
    cal = StrongShareCalibrator(0.2, window=500, min_samples=50)
    routed_share(cal, [rng.uniform(0.0, 0.5) for _ in range(1000)])
    low_threshold = cal.threshold()
    # Traffic gets harder across the board: a fixed threshold would send most of it strong.
    harder = [rng.uniform(0.5, 1.0) for _ in range(3000)]
    assert sum(s > low_threshold for s in harder) / len(harder) > 0.9
    routed_share(cal, harder[:500])  # one window of the new traffic
    assert routed_share(cal, harder[500:]) == pytest.approx(0.2, abs=0.03)
    assert cal.threshold() > 0.5 > low_threshold


def test_uses_initial_threshold_until_enough_samples() -> None:
    cal = StrongShareCalibrator(0.5, window=100, min_samples=10, initial_threshold=0.9)
    assert cal.threshold() == 0.9
    assert cal.route_strong(0.95) is True
    assert cal.route_strong(0.8) is False
    for s in [0.1] * 10:
        cal.observe(s)
    assert cal.threshold() != 0.9
    assert len(cal) == 12


def test_extreme_targets() -> None:
    never = StrongShareCalibrator(0.0, min_samples=1)
    always = StrongShareCalibrator(1.0, min_samples=1)
    scores = [i / 100 for i in range(100)]
    assert routed_share(never, scores) == 0.0
    assert routed_share(always, scores) == 1.0


def test_window_forgets_old_scores() -> None:
    cal = StrongShareCalibrator(0.5, window=10, min_samples=1)
    for s in [0.9] * 10 + [0.1] * 10:
        cal.observe(s)
    assert len(cal) == 10
    assert cal.threshold() == 0.1  # the 0.9s left the window


@pytest.mark.parametrize(
    "kwargs", [{"target_share": 1.5}, {"target_share": -0.1}, {"target_share": 0.5, "window": 0}]
)
def test_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StrongShareCalibrator(**kwargs)


def test_thread_safe_under_concurrent_observers() -> None:
    cal = StrongShareCalibrator(0.25, window=400, min_samples=10)
    streams = [[rng.random() for _ in range(2000)] for rng in map(random.Random, range(4))]

    def feed(scores: list[float]) -> None:
        for score in scores:
            cal.route_strong(score)

    threads = [threading.Thread(target=feed, args=(scores,)) for scores in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Which 400 scores end up in the window depends on the interleaving, so check the invariants a
    # race would break (the sorted index and the window hold the same scores, and the threshold is
    # their exact quantile) rather than a statistical band, which fails now and then by chance.
    window = sorted(cal._recent)
    assert len(cal) == 400 and window == cal._sorted
    assert set(window) <= {score for scores in streams for score in scores}
    assert cal.threshold() == window[400 - round(0.25 * 400) - 1]
    assert 0.6 < cal.threshold() < 0.9  # 0.75 +- 7 standard deviations of a 400-sample quantile


@pytest.mark.parametrize(
    ("target", "window"),
    [(0.3, 1), (0.6, 1), (0.25, 10), (0.5, 10), (0.004, 100), (0.002, 200), (0.3, 7)],
)
def test_keeps_the_target_share_in_a_window_of_any_size(target: float, window: int) -> None:
    """The top share of a window is rarely a whole number of scores. Rounded to one, a window of 1
    never went strong below a share of 0.7, one of 10 sent 20% for 25% (round half to even), and
    shares under half a score of the window never went strong."""
    rng = random.Random(11)
    cal = StrongShareCalibrator(target, window=window)
    runs = 40000  # dozens of strong calls at the smallest share
    share = routed_share(cal, [rng.random() for _ in range(runs)])
    assert share == pytest.approx(target, rel=0.05)


def test_a_burst_of_tied_scores_decided_before_any_is_counted_keeps_the_share() -> None:
    """Requests are decided when planned and counted once sent, so a burst is decided on one window.
    The credit that spreads tied scores over the share moved only when they were counted: every
    request of the burst read the same credit and all went weak (or all strong)."""
    cal = StrongShareCalibrator(0.3, window=200)
    routed_share(cal, [0.4] * 200)
    burst = [cal.call(0.4) for _ in range(100)]
    for call in burst:
        cal.count(call)
    assert sum(call.strong for call in burst) == pytest.approx(30, abs=1)


def test_a_cold_burst_keeps_the_share() -> None:
    """A fresh window decides a burst with only each request's own score in it: by rank alone, each
    is owed the target share, which the credit spreads over the burst."""
    rng = random.Random(4)
    cal = StrongShareCalibrator(0.3)
    burst = [cal.call(rng.random()) for _ in range(100)]
    assert sum(call.strong for call in burst) == pytest.approx(30, abs=1)


@pytest.mark.parametrize("score", [math.nan, math.inf, -math.inf])
def test_non_finite_scores_leave_the_window_ordered(score: float) -> None:
    """NaN is no order: inserted into the sorted window, the window later dropped other scores in its
    place and a look-up failed (IndexError, ZeroDivisionError). It goes weak and is not counted;
    infinities rank like any score."""
    rng = random.Random(9)
    cal = StrongShareCalibrator(0.3, window=20)
    routed_share(cal, [rng.random() for _ in range(10)])
    assert cal.route_strong(score) is (score == math.inf)
    share = routed_share(cal, [rng.random() for _ in range(3000)])
    assert sorted(cal._recent) == cal._sorted
    assert share == pytest.approx(0.3, abs=0.03)


def test_a_target_a_hair_below_1_sends_all_strong() -> None:
    rng = random.Random(3)
    cal = StrongShareCalibrator(1 - 1e-12, window=50)
    assert routed_share(cal, [rng.random() for _ in range(500)]) == 1.0


@pytest.mark.parametrize("target", [0.0, 1.0])
def test_shares_of_0_and_1_hold_on_an_empty_window(target: float) -> None:
    cal = StrongShareCalibrator(target)
    assert cal.threshold() == (math.inf if target == 0 else -math.inf)
    assert cal.route_strong(0.5) is (target == 1)
