"""Helpers of the adaptation benchmark (`benchmarks/routing_adapt.py`): the simulated difficulty route
that decides which model's outcome each feedback row carries, and the paired APGR difference."""

from __future__ import annotations

import numpy as np

from benchmarks.routing_adapt import paired_difference, route_stream, subject_half


def test_the_simulated_route_sends_the_target_share_and_explores() -> None:
    scores = np.random.default_rng(5).random(4000)
    routed = route_stream(scores, share=0.3, explore=0.0, seed=0)
    assert abs(routed[200:].mean() - 0.3) < 0.03
    assert scores[routed].mean() > scores[~routed].mean() + 0.3  # the high scores go strong
    explored = route_stream(scores, share=0.3, explore=0.1, seed=0)
    flipped = explored != routed
    assert 0.08 < flipped.mean() < 0.12
    assert explored[routed].mean() < 1.0 and explored[~routed].mean() > 0.0  # both ways


def test_the_paired_difference_is_zero_for_one_router_and_positive_for_an_oracle() -> None:
    rng = np.random.default_rng(1)
    weak, strong = rng.random(600) < 0.6, rng.random(600) < 0.8
    noise = rng.random(600)
    assert paired_difference(noise, noise, weak, strong, rounds=50) == (0.0, 0.0, 0.0)
    oracle = (strong.astype(float) - weak) + 0.01 * noise
    point, lo, hi = paired_difference(oracle, noise, weak, strong, rounds=50)
    assert 0 < lo <= point <= hi


def test_subjects_split_in_two_by_name() -> None:
    halves = [subject_half(f"subject_{i}") for i in range(200)]
    assert set(halves) == {0, 1} and 60 < sum(halves) < 140
    assert subject_half("anatomy") == subject_half("anatomy")
