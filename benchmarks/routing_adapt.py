"""Does a head refit on a tenant's own feedback beat the generic head on traffic it was not trained on?

Real outcomes (GPT-4 vs Mixtral on MMLU, ../shared/data/routing-mmlu) stand in for a tenant whose
traffic the generic head never saw: the 57 subjects are split in two by a hash of their names.

- The *generic* head is trained on half A as `weir router train --data` trains the shipped one (both
  outcomes, subjects as groups).
- Half B is the tenant. Its prompts (all but a held-out test share, chosen by prompt hash) arrive as a
  stream routed by the generic head under a difficulty route with `strong_share`, plus an exploration
  share routed the other way at random (what docs/routing.md advises before a refit). Each answer's
  correctness comes back as feedback on the model that answered: one outcome per prompt, as `POST
  /v1/feedback` gives, and biased by the routing that chose the model.
- After the first n feedback rows, a *tenant* head is fitted on them as `weir router train --tenant`
  does (partial labels, no groups). For scale, a head fitted on the same n prompts with both outcomes
  known (an offline two-model evaluation of the tenant's prompts) is shown too, and heads fitted on
  both outcomes as a judge would grade them (a route's `compare` option, routing.compare): each
  outcome flipped with probability `--judge-errors`, independently, for a judge that is sometimes
  wrong.

Every head is scored on the held-out B prompts, which no head saw, with APGR, CPT(50%) and quality at
30% strong calls (bootstrap 95% intervals), and the paired APGR difference against the generic head.

    .venv/bin/python benchmarks/routing_adapt.py --data ../shared/data/routing-mmlu
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_eval import bootstrap, metrics, print_table
from routing.difficulty import StrongShareCalibrator, encode, length_feature
from routing.embed import STATIC_RECIPE, load_embedder
from routing.train import Outcomes, TrainConfig, fit_head, load_mmlu, prompt_fold


def subject_half(subject: str) -> int:
    return hashlib.sha256(subject.encode()).digest()[0] % 2


def route_stream(p_strong: np.ndarray, share: float, explore: float, seed: int) -> np.ndarray:
    """Which prompts of the stream the route sends to the strong model (feedback then labels only
    that model's answer): the top `share` of recent scores, with an `explore` share flipped at random."""
    rng = np.random.default_rng(seed)
    calibrator = StrongShareCalibrator(share)
    to_strong = np.array([calibrator.route_strong(float(p)) for p in p_strong])
    return to_strong ^ (rng.random(len(p_strong)) < explore)


def paired_difference(
    a: np.ndarray, b: np.ndarray, weak: np.ndarray, strong: np.ndarray, rounds: int
) -> tuple[float, float, float]:
    """APGR(a) - APGR(b) on the same rows, with a 95% bootstrap interval (the same draws for both)."""
    rng = np.random.default_rng(1)
    point = metrics(a, weak, strong)["APGR"] - metrics(b, weak, strong)["APGR"]
    draws = []
    for _ in range(rounds):
        i = rng.integers(0, len(a), len(a))
        draws.append(metrics(a[i], weak[i], strong[i])["APGR"] - metrics(b[i], weak[i], strong[i])["APGR"])
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return point, float(lo), float(hi)


def table(
    title: str, scores: dict[str, np.ndarray], data: Outcomes, rounds: int, against: str, diff: str
) -> None:
    """APGR, CPT(50%) and Q@30% of each router with bootstrap intervals, and column `diff`: its
    paired APGR difference against the router `against`."""
    results = {}
    for name, score in scores.items():
        full = bootstrap(score, data.weak, data.strong, rounds)
        results[name] = {k: full[k] for k in ("APGR", "CPT(50%)", "Q@30%")}
        results[name][diff] = (
            paired_difference(score, scores[against], data.weak, data.strong, rounds)
            if name != against
            else (float("nan"),) * 3
        )
    print_table(title, results)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/routing-mmlu"))
    parser.add_argument(
        "--embedder", default=STATIC_RECIPE, help="embedder recipe of every head (routing.embed)"
    )
    parser.add_argument(
        "--sizes", default="250,500,1000,2000,0", help="feedback rows per tenant head (0: all)"
    )
    parser.add_argument("--share", type=float, default=0.3, help="the route's strong_share")
    parser.add_argument("--explore", type=float, default=0.1, help="share of the stream routed the other way")
    parser.add_argument("--test-folds", type=int, default=3, help="held-out B prompts: this many tenths")
    parser.add_argument(
        "--judge-errors",
        default="0.1,0.2",
        help="share of wrong grades of each simulated judge ('' for none)",
    )
    parser.add_argument("--rounds", type=int, default=1000, help="bootstrap rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration-folds", type=int, default=TrainConfig.calibration_folds)
    args = parser.parse_args()
    cfg = replace(TrainConfig(), seed=args.seed, calibration_folds=args.calibration_folds, fallback_folds=0)

    started = time.perf_counter()
    data = load_mmlu(args.data)
    assert data.groups is not None
    half = np.array([subject_half(g) for g in data.groups])
    embedder = load_embedder(args.embedder)
    enc = encode(embedder, data.prompts)
    a_rows = np.flatnonzero(half == 0)
    b_rows = np.flatnonzero(half == 1)
    test_mask = np.array([prompt_fold(data.prompts[i], 10) < args.test_folds for i in b_rows])
    test_rows = b_rows[test_mask]
    stream_rows = np.random.default_rng(args.seed).permutation(b_rows[~test_mask])
    print(
        f"A (generic head): {len(a_rows)} prompts, {len(set(data.groups[i] for i in a_rows))} subjects; "
        f"B (tenant): stream {len(stream_rows)}, held-out test {len(test_rows)}, "
        f"{len(set(data.groups[i] for i in b_rows))} subjects; embedder {args.embedder}",
        flush=True,
    )

    generic = fit_head(data.subset(a_rows), enc.subset(a_rows), cfg)
    print(f"generic head fitted ({time.perf_counter() - started:.0f} s)", flush=True)
    stream = data.subset(stream_rows)
    to_strong = route_stream(generic.p_strong(enc.subset(stream_rows)), args.share, args.explore, args.seed)
    print(
        f"stream routed at strong_share {args.share} with {args.explore:.0%} exploration: "
        f"{to_strong.mean():.1%} answered by the strong model",
        flush=True,
    )

    test = data.subset(test_rows)
    test_enc = enc.subset(test_rows)
    scores: dict[str, np.ndarray] = {
        "generic head (half A)": generic.p_strong(test_enc),
        "prompt length": np.array([length_feature(p) for p in test.prompts]),
        "random": np.random.default_rng(7).random(len(test_rows)),
    }
    sizes = [int(s) or len(stream_rows) for s in args.sizes.split(",")]
    judge_errors = [float(e) for e in args.judge_errors.split(",") if e]
    for n in sizes:
        idx = np.arange(n)
        partial = Outcomes(
            [stream.prompts[i] for i in idx],
            stream.weak[idx],
            stream.strong[idx],
            None,
            ~to_strong[idx],
            to_strong[idx],
        )
        full = Outcomes(partial.prompts, partial.weak, partial.strong)
        sub_enc = enc.subset(stream_rows[idx])
        arms = [
            (f"tenant head, {n} feedback rows", partial, sub_enc),
            (f"  both outcomes, {n} rows", full, sub_enc),
        ]
        for error in judge_errors:
            flip = np.random.default_rng(args.seed + 11).random((n, 2)) < error
            judged = Outcomes(full.prompts, full.weak ^ flip[:, 0], full.strong ^ flip[:, 1])
            arms.append((f"  judged, {error:.0%} wrong, {n} rows", judged, sub_enc))
            # `both_orders`: graded again with the answers swapped, kept where both verdicts agree.
            again = np.random.default_rng(args.seed + 12).random((n, 2)) < error
            kept = np.flatnonzero((flip == again).all(axis=1))
            arms.append(
                (
                    f"  judged twice, {error:.0%} wrong, {len(kept)} of {n} kept",
                    judged.subset(kept),
                    sub_enc.subset(kept),
                )
            )
        for name, outcomes, rows_enc in arms:
            head = fit_head(outcomes, rows_enc, cfg)
            scores[name] = head.p_strong(test_enc)
        print(f"tenant heads on {n} rows fitted ({time.perf_counter() - started:.0f} s)", flush=True)

    table(
        f"Held-out tenant prompts (half B, {len(test_rows)} prompts; weak {test.weak.mean():.3f}, "
        f"strong {test.strong.mean():.3f})",
        scores,
        test,
        args.rounds,
        "generic head (half A)",
        "APGR - generic",
    )
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
