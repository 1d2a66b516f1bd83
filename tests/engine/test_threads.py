"""The per-step thread-count tuner (engine/threads.py), on a simulated clock, and in the engine."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.threads import ThreadTuner, bucket


def run(tuner: ThreadTuner, steps: int, per_token: Callable[[int], float], num_tokens: int = 1) -> list[int]:
    chosen = []
    for _ in range(steps):
        threads = tuner.choose(num_tokens)
        tuner.record(num_tokens, threads, per_token(threads) * num_tokens)
        chosen.append(threads)
    return chosen


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 32, 10**6)] == [1, 1, 2, 2, 3, 3, 4, 6, 12]


def test_follows_the_faster_count_and_tries_the_other_less_and_less() -> None:
    tuner = ThreadTuner(max_threads=2)
    quiet = {2: 0.036, 1: 0.048}  # idle machine: two threads win
    chosen = run(tuner, 400, quiet.__getitem__)
    assert chosen[:2] == [2, 1]  # each count measured once first
    tries = [i for i, t in enumerate(chosen[2:], start=2) if t == 1]
    assert len(tries) <= 5  # 16, 32, 64, 128 (then 256) steps apart
    assert all(b - a >= 16 for a, b in itertools.pairwise(tries))
    assert tuner.best(1) == 2


def test_exploring_marks_exactly_the_tries() -> None:
    tuner = ThreadTuner(max_threads=2)
    quiet = {2: 0.036, 1: 0.048}
    flags = []
    for _ in range(100):
        threads = tuner.choose(1)
        flags.append((threads, tuner.exploring(1)))
        tuner.record(1, threads, quiet[threads])
    tries = [i for i, (threads, exploring) in enumerate(flags) if exploring]
    assert tries and all(flags[i][0] == 1 for i in tries)  # a try runs on the slower count
    assert all(not exploring for threads, exploring in flags[2:] if threads == 2)
    assert not tuner.exploring(1)  # a recorded try is over


def test_moves_to_one_thread_when_load_arrives_and_back_when_it_leaves() -> None:
    tuner = ThreadTuner(max_threads=2)
    run(tuner, 100, {2: 0.036, 1: 0.048}.__getitem__)
    busy = run(tuner, 100, {2: 0.50, 1: 0.07}.__getitem__)  # the second thread keeps being descheduled
    assert busy[:4].count(2) >= 1 and busy[10:].count(2) <= 4
    assert tuner.best(1) == 1
    idle_again = run(tuner, 300, {2: 0.036, 1: 0.048}.__getitem__)
    assert tuner.best(1) == 2 and idle_again[-50:].count(2) >= 48


def test_step_sizes_are_tuned_separately() -> None:
    tuner = ThreadTuner(max_threads=2)
    run(tuner, 60, {2: 0.02, 1: 0.03}.__getitem__, num_tokens=32)  # batches split well
    run(tuner, 60, {2: 0.05, 1: 0.04}.__getitem__, num_tokens=1)  # a lone decode does not
    assert tuner.best(32) == 2 and tuner.best(1) == 1


def test_a_new_prefill_size_follows_the_nearest_measured_one_without_a_try() -> None:
    tuner = ThreadTuner(max_threads=2)
    quiet = {2: 0.002, 1: 0.0036}  # compute-bound prefill on an idle machine: two threads win
    assert run(tuner, 3, quiet.__getitem__, num_tokens=128) == [2, 1, 2]  # the first large size measures both
    flags = []
    for _ in range(20):
        threads = tuner.choose(1024)
        flags.append((threads, tuner.exploring(1024)))
        tuner.record(1024, threads, quiet[threads] * 1024)
    assert flags[:15] == [(2, False)] * 15  # no one-thread try on the second 1,024-token prompt
    assert (1, True) in flags[15:]  # it is still measured here after the usual wait
    assert tuner.best(1024) == 2


def test_a_busy_verdict_carries_to_larger_steps_too() -> None:
    tuner = ThreadTuner(max_threads=2)
    run(
        tuner, 3, {2: 0.02, 1: 0.004}.__getitem__, num_tokens=256
    )  # the second thread keeps being descheduled
    assert tuner.choose(2048) == 1 and not tuner.exploring(2048)


def test_small_steps_do_not_borrow() -> None:
    tuner = ThreadTuner(max_threads=2)
    run(tuner, 3, {2: 0.002, 1: 0.0036}.__getitem__, num_tokens=128)
    assert run(tuner, 2, {2: 0.05, 1: 0.04}.__getitem__, num_tokens=1) == [2, 1]  # decodes measure both
    assert run(tuner, 2, {2: 0.05, 1: 0.04}.__getitem__, num_tokens=32) == [2, 1]


def test_one_thread_machine_never_switches() -> None:
    tuner = ThreadTuner(max_threads=1)
    assert run(tuner, 20, lambda t: 0.01) == [1] * 20


def test_engine_restores_the_thread_count_and_matches_fixed_threads(
    make_engine: Callable[..., LLMEngine],
) -> None:
    before = torch.get_num_threads()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40))]
    adaptive = make_engine()
    fixed = make_engine(adaptive_threads=False)
    assert adaptive.thread_tuner is not None and fixed.thread_tuner is None
    assert adaptive.generate(prompts, params) == fixed.generate(prompts, params)
    assert torch.get_num_threads() == before
