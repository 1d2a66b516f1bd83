"""The shipped difficulty heads on real two-model outcomes *off* MMLU, and tenant heads fitted on them.

    .venv/bin/python benchmarks/routing_transfer.py --outcomes path/to/gsm8k_responses.csv

`--outcomes` is any file of per-prompt outcomes of a weak and a strong model: RouteLLM's CSV format
(`prompt, <weak model>, <strong model>, ...`, True/False, as in ../shared/data/routing-mmlu; RouteLLM's
`routellm/evals/gsm8k/gsm8k_responses.csv` holds Mixtral-8x7B and GPT-4 on the 1,319 GSM8K test
questions, the same two models as the MMLU data), AlpacaEval's judged pairs (`results/<model>/
alpaca_eval_gpt4_turbo_fn/annotations.json` in tatsu-lab/alpaca_eval: the model against GPT-4-1106's
reference answers on 805 chat instructions, graded by GPT-4-1106) or the JSON lines `weir router train
--feedback` reads. Nothing here is trained on it before it is scored:

1. **The shipped heads as they are** (static v3 and encoder v4, both, whatever this CPU would serve),
   scored on every prompt against prompt length and random: APGR, CPT(50%), quality at 30% strong
   calls, and AUC for "needs the strong model" (weak wrong, strong right), 95% bootstrap intervals.
2. **Tenant heads**, cross-fitted: the prompts are split into `--folds` folds by a hash, and each fold
   is scored by heads fitted on the first n prompts of a stream drawn from the other folds, as `weir
   router train --tenant` fits them: on both outcomes (what a route's `compare` option collects, exact
   or graded twice by a judge wrong `--judge-error` of the time, keeping agreeing verdicts; and, for
   comparison, with the blend's inputs pinned either way) and on feedback (one outcome per prompt, on
   the model the shipped static head's route chose at `--share` with `--explore` sent the other way).
   APGR is taken fold by fold (each fold ranked by its own heads, as a strong-share route ranks one
   head's scores) and averaged, with the paired difference against the shipped static head.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_adapt import route_stream, table
from benchmarks.routing_eval import fold_apgr, print_table
from routing.difficulty import DifficultyClassifier, encode, has_answer_options
from routing.embed import STATIC_RECIPE, load_embedder
from routing.ranking import auc_interval
from routing.train import Outcomes, TrainConfig, fit_head, load_jsonl, prompt_fold


def load_outcomes(path: Path) -> Outcomes:
    """RouteLLM's CSV (the first three columns: prompt, weak, strong), AlpacaEval's annotations (a
    `.json` list) or feedback JSON lines."""
    if path.suffix == ".json":
        return load_alpaca_eval(path)
    if path.suffix != ".csv":
        return load_jsonl(path)
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        rows = [(r[0], r[1] == "True", r[2] == "True") for r in reader if r]
    print(f"{path.name}: weak = {header[1]}, strong = {header[2]}")
    return Outcomes([r[0] for r in rows], np.array([r[1] for r in rows]), np.array([r[2] for r in rows]))


def load_alpaca_eval(path: Path) -> Outcomes:
    """AlpacaEval's `results/<model>/<annotator>/annotations.json`: a judge's verdict between the
    reference answer (`output_1`, the strong model) and the evaluated model's (`output_2`, the weak
    one) on each instruction. `preference` is 1 where the reference wins, 2 where the model does, 1.5
    (or 0) for a draw. A verdict is what a route's `compare` records: the preferred answer counts as
    right, and a draw as right for both, so "needs the strong model" is exactly "the reference won"."""
    records = json.loads(path.read_text())
    preference = np.array([float(r["preference"]) for r in records])
    if not np.isin(preference, (0.0, 1.0, 1.5, 2.0)).all():
        raise ValueError(f"{path}: preferences must be 0, 1, 1.5 or 2 (AlpacaEval's discrete verdicts)")
    draw = np.isin(preference, (0.0, 1.5))
    weak, strong = records[0].get("generator_2", "output_2"), records[0].get("generator_1", "output_1")
    print(f"{path.name}: weak = {weak}, strong = {strong} (judged pairwise; {draw.sum()} draws)")
    return Outcomes([r["instruction"] for r in records], (preference == 2) | draw, (preference == 1) | draw)


def fold_table(
    title: str, scores: dict[str, np.ndarray], data: Outcomes, fold: np.ndarray, rounds: int, against: str
) -> None:
    """APGR of cross-fitted scores fold by fold, averaged: each fold is ranked by its own heads alone,
    as a strong-share route ranks one head's scores. (Pooled, the folds' heads' different calibrations
    would mix into the ranking: a fold head that scores everything higher sends its whole fold first.)
    Bootstrap: rows resampled within each fold, the same draws for every router."""
    rng = np.random.default_rng(0)
    folds = [np.flatnonzero(fold == k) for k in np.unique(fold)]
    draws = [[rng.choice(r, len(r)) for r in folds] for _ in range(rounds)]
    base = np.array([fold_apgr(scores[against], data.weak, data.strong, d) for d in draws])
    base_point = fold_apgr(scores[against], data.weak, data.strong, folds)
    results = {}
    for name, score in scores.items():
        values = np.array([fold_apgr(score, data.weak, data.strong, d) for d in draws])
        point = fold_apgr(score, data.weak, data.strong, folds)
        diff = point - base_point
        results[name] = {
            "APGR, fold mean": (point, *np.percentile(values, [2.5, 97.5])),
            "APGR diff": (diff, *np.percentile(values - base, [2.5, 97.5]))
            if name != against
            else (float("nan"),) * 3,
        }
    print_table(f"{title}; APGR diff: paired, against {against}", results)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--outcomes", type=Path, required=True)
    parser.add_argument(
        "--embedder", default=STATIC_RECIPE, help="embedder recipe of the tenant heads (routing.embed)"
    )
    parser.add_argument("--sizes", default="250,500,0", help="stream prompts per tenant head (0: all)")
    parser.add_argument("--share", type=float, default=0.3, help="the route's strong_share")
    parser.add_argument("--explore", type=float, default=0.1, help="share of the stream routed the other way")
    parser.add_argument("--folds", type=int, default=5, help="folds of the tenant heads' cross-fitting")
    parser.add_argument(
        "--judge-error", type=float, default=0.1, help="share of a simulated judge's wrong grades"
    )
    parser.add_argument("--rounds", type=int, default=1000, help="bootstrap rounds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()

    data = load_outcomes(args.outcomes)
    needs_strong = ~data.weak & data.strong
    options = np.mean([has_answer_options(p) for p in data.prompts])
    print(
        f"{len(data)} prompts; weak right {data.weak.mean():.3f}, strong right {data.strong.mean():.3f}, "
        f"needs the strong model {needs_strong.mean():.3f}; multiple-choice {options:.1%}; "
        f"median {np.median([len(p) for p in data.prompts]):.0f} characters",
        flush=True,
    )

    shipped = {
        f"shipped {head} head": np.array(DifficultyClassifier.default(head).score_many(data.prompts))
        for head in ("static", "encoder")
    }
    lengths = np.array([len(p) for p in data.prompts], float)
    baselines = {"prompt length": lengths, "random": np.random.default_rng(7).random(len(data))}
    table(
        f"1. Every prompt ({len(data)}), no head trained on any of them; 95% bootstrap CIs, {args.rounds} "
        "rounds; APGR diff: paired, against prompt length",
        {**shipped, **baselines},
        data,
        args.rounds,
        "prompt length",
        "APGR diff",
    )
    print("\n   AUC, needs the strong model (weak wrong, strong right) vs the rest:")
    for name, (v, lo, hi) in auc_interval({**shipped, "prompt length": lengths}, needs_strong).items():
        print(f"   {name:<24} {v:.3f} [{lo:.3f}, {hi:.3f}]")

    # Tenant heads, cross-fitted: each fold of prompts (by hash) is scored by heads fitted on the
    # first n prompts of a stream drawn from the other folds, so every prompt is scored once, by heads
    # that never saw it, and the comparison runs over all of them.
    fold = np.array([prompt_fold(p, args.folds) for p in data.prompts])
    generic = shipped["shipped static head"]
    embedder = load_embedder(args.embedder)
    enc = encode(embedder, data.prompts)
    cfg = replace(TrainConfig(), seed=args.seed, fallback_folds=0)
    # The recipe before head version 5: the blend weighs the components only, never the length.
    components_only = replace(cfg, blend_inputs="components")
    with_length = replace(cfg, blend_inputs="components+length")
    chosen: dict[str, list[str]] = {}
    sizes = [int(s) for s in args.sizes.split(",")]
    scores: dict[str, np.ndarray] = {
        "shipped static head": generic,
        "shipped encoder head": shipped["shipped encoder head"],
        "prompt length": lengths,
        "random": baselines["random"],
    }
    kept_counts: dict[str, list[int]] = {}
    routed = []
    for k in range(args.folds):
        test_rows = np.flatnonzero(fold == k)
        stream_rows = np.random.default_rng(args.seed + k).permutation(np.flatnonzero(fold != k))
        stream = data.subset(stream_rows)
        to_strong = route_stream(generic[stream_rows], args.share, args.explore, args.seed + k)
        routed.append(to_strong.mean())
        test_enc = enc.subset(test_rows)
        for size in sizes:
            n = min(size or len(stream_rows), len(stream_rows))
            idx = np.arange(n)
            full = stream.subset(idx)
            partial = replace(full, weak_known=~to_strong[idx], strong_known=to_strong[idx])
            flip = np.random.default_rng(args.seed + 11 + k).random((n, 2)) < args.judge_error
            again = np.random.default_rng(args.seed + 12 + k).random((n, 2)) < args.judge_error
            kept = np.flatnonzero((flip == again).all(axis=1))
            judged = Outcomes(full.prompts, full.weak ^ flip[:, 0], full.strong ^ flip[:, 1]).subset(kept)
            rows_enc = enc.subset(stream_rows[idx])
            label = str(size) if size else "all"
            judged_name = f"tenant, {label} compared, judge {args.judge_error:.0%} wrong x2"
            kept_counts.setdefault(judged_name, []).append(len(kept))
            arms = [
                (f"tenant, {label} feedback rows", partial, rows_enc, cfg),
                (f"tenant, {label} compared (exact)", full, rows_enc, cfg),
                (f"  {label} compared, components only", full, rows_enc, components_only),
                (f"  {label} compared, components+length", full, rows_enc, with_length),
                (judged_name, judged, rows_enc.subset(kept), cfg),
            ]
            for name, outcomes, outcomes_enc, arm_cfg in arms:
                head = fit_head(outcomes, outcomes_enc, arm_cfg)
                scores.setdefault(name, np.zeros(len(data)))[test_rows] = head.p_strong(test_enc)
                chosen.setdefault(name, []).append(head.meta["blend_inputs"])
        print(f"   fold {k}: {len(test_rows)} scored ({time.perf_counter() - started:.0f} s)", flush=True)
    print(
        f"\n2. Tenant heads, {args.folds} folds by prompt hash: each fold scored by heads fitted on a "
        f"stream of the other folds' prompts (the first n; 'all' = {len(data) - len(data) // args.folds} or so), "
        f"routed by the shipped static head at strong_share {args.share} with {args.explore:.0%} "
        f"exploration ({np.mean(routed):.1%} to the strong model); embedder {args.embedder}; judged "
        f"rows kept per fold: "
        + "; ".join(
            f"{name.split(',')[1].strip().split()[0]}: {counts}" for name, counts in kept_counts.items()
        )
    )
    for name, picks in chosen.items():
        print(f"   blend inputs chosen, {name.strip()}: {', '.join(picks)}")
    fold_table(
        f"Every prompt ({len(data)}), cross-fitted; 95% bootstrap CIs, {args.rounds} rounds",
        scores,
        data,
        fold,
        args.rounds,
        "shipped static head",
    )
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
