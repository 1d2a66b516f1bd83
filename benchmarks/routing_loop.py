"""Retraining on a schedule (`weir router train --install`): how many nights of a tenant's compared
requests before the loop replaces the generic head, and what each night's served head is worth.

Real outcomes (GPT-4 vs Mixtral on MMLU, ../shared/data/routing-mmlu) stand in for a tenant whose
traffic the generic head never saw, as in `routing_adapt.py`: the 57 subjects are split in two by a
hash of their names; the *generic* head is fitted on half A (both outcomes, subjects as groups, as the
shipped head is), and half B is the tenant. A held-out share of B (by prompt hash) is never used for
training and scores every head.

Each night `--per-night` more of the tenant's prompts arrive with both outcomes (what a route's
`compare` records; `--judge-error` flips each grade with that probability). The loop does what
`--install` does: hold out each fifth of the rows so far in turn (`--single-fifth`: one), rank it with
a head fitted on the rest and with the head in use (once that is one of the loop's own, refitted in
each fold on the rows it had; `--rows-since`: as it is, on the rows it was not trained on), and if
the rule says the new head is better (`routing.train.should_promote`), fit on every row and serve it.
Printed per night: the decision, the held-out comparison it rested on, and the APGR on the tenant's
test prompts of the head served after it, next to never retraining (the generic head) and swapping
every night unchecked.

    .venv/bin/python benchmarks/routing_loop.py --data ../shared/data/routing-mmlu

`--tenant-outcomes FILE` makes the tenant another dataset's prompts with both outcomes (RouteLLM's
GSM8K CSV, as `routing_transfer.py` reads it) and starts it on the shipped head of the embedder, as a
new tenant's route is: the loop on traffic unlike anything the generic head was fitted on.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_adapt import subject_half
from benchmarks.routing_eval import metrics
from benchmarks.routing_transfer import load_outcomes
from routing.difficulty import DEFAULT_HEAD_DIR, STATIC_HEAD_DIR, DifficultyHead, encode
from routing.embed import STATIC_RECIPE, load_embedder
from routing.train import (
    Outcomes,
    TrainConfig,
    decisive,
    fit_head,
    holdout_check,
    load_mmlu,
    should_promote,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/routing-mmlu"))
    parser.add_argument(
        "--tenant-outcomes",
        type=Path,
        help="the tenant's prompts and both outcomes from another dataset, served first by the shipped head",
    )
    parser.add_argument(
        "--embedder", default=STATIC_RECIPE, help="embedder recipe of every head (routing.embed)"
    )
    parser.add_argument("--per-night", type=int, default=250, help="compared requests a night")
    parser.add_argument("--nights", type=int, default=8)
    parser.add_argument("--rule", choices=("significant", "better"), default="significant")
    parser.add_argument("--judge-error", type=float, default=0.0, help="share of grades flipped at random")
    parser.add_argument(
        "--test-share", type=float, default=0.3, help="share of B prompts held out as the test"
    )
    parser.add_argument(
        "--single-fifth",
        action="store_true",
        help="decide on one held-out fifth (the check `weir router train` prints) instead of every fifth in "
        "turn (what --install does)",
    )
    parser.add_argument(
        "--rows-since",
        action="store_true",
        help="once the loop serves a head of its own, rank it as it is on the rows since instead of "
        "refitting it per fold on the rows it had (what --install does for a head of another recipe)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = replace(TrainConfig(), seed=args.seed, fallback_folds=0)

    started = time.perf_counter()
    embedder = load_embedder(args.embedder)
    if args.tenant_outcomes:
        data = load_outcomes(args.tenant_outcomes)
        enc = encode(embedder, data.prompts)
        b_rows = np.arange(len(data))
        generic = DifficultyHead.load(STATIC_HEAD_DIR if args.embedder == STATIC_RECIPE else DEFAULT_HEAD_DIR)
        if generic.embedder != args.embedder:
            raise SystemExit(f"no shipped head reads {args.embedder}")
        generic_name = f"shipped head; tenant: {args.tenant_outcomes.name}"
    else:
        data = load_mmlu(args.data)
        assert data.groups is not None
        half = np.array([subject_half(g) for g in data.groups])
        enc = encode(embedder, data.prompts)
        a_rows, b_rows = np.flatnonzero(half == 0), np.flatnonzero(half == 1)
        generic = fit_head(data.subset(a_rows), enc.subset(a_rows), cfg)
        generic_name = f"generic head on half A ({len(a_rows)} prompts); tenant: MMLU half B"
    # Test rows at random, not by prompt_fold: the held-out check's fifth is prompt_fold(p, 5) == 0,
    # which a prompt_fold(p, 10) split would skew (hash % 10 in {0, 5}).
    test_mask = np.random.default_rng(args.seed + 5).random(len(b_rows)) < args.test_share
    test_rows = b_rows[test_mask]
    stream_rows = np.random.default_rng(args.seed).permutation(b_rows[~test_mask])
    need = args.per_night * args.nights
    if need > len(stream_rows):
        raise SystemExit(
            f"--per-night x --nights = {need} is more than the tenant's {len(stream_rows)} prompts"
        )
    stream = data.subset(stream_rows[:need])
    flip = np.random.default_rng(args.seed + 11).random((need, 2)) < args.judge_error
    graded = Outcomes(stream.prompts, stream.weak ^ flip[:, 0], stream.strong ^ flip[:, 1])
    stream_enc = enc.subset(stream_rows[:need])
    test, test_enc = data.subset(test_rows), enc.subset(test_rows)

    def apgr(head: DifficultyHead) -> float:
        return metrics(head.p_strong(test_enc), test.weak, test.strong)["APGR"]

    generic_apgr = apgr(generic)
    print(
        f"{generic_name}, {len(test_rows)} test prompts, "
        f"{args.per_night} compared a night (grades {args.judge_error:.0%} wrong), rule {args.rule}, "
        f"{'one held-out fifth' if args.single_fifth else 'every fifth held out in turn'}, "
        f"embedder {args.embedder}; that head's APGR on the test prompts {generic_apgr:.3f} "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    serving, serving_apgr, trained_on = generic, generic_apgr, 0  # rows the head in use was fitted on
    print(
        "| night | rows | held-out rows ranked | AUC new / in use | difference [95%] | decision | APGR served "
        "| APGR if swapped unchecked |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for night in range(1, args.nights + 1):
        n = night * args.per_night
        rows, rows_enc = graded.subset(np.arange(n)), stream_enc.subset(np.arange(n))
        unseen = np.arange(n) >= trained_on
        replay = ~unseen if trained_on and not args.rows_since else None
        _, results = holdout_check(
            rows, rows_enc, serving, cfg, 0.2, unseen=unseen, cross_fit=not args.single_fifth, replay=replay
        )
        result = decisive(results)
        fitted = fit_head(rows, rows_enc, cfg)  # what --install would serve; also the unchecked swap
        fitted_apgr = apgr(fitted)
        if result is not None and should_promote(result, args.rule):
            serving, serving_apgr, trained_on, decision = fitted, fitted_apgr, n, "**promote**"
        else:
            decision = "keep" if result is not None else "keep (nothing to rank)"
        ranked = f"{result.positives} + {result.negatives}" if result else "0"
        aucs = f"{result.trained:.3f} / {result.baseline:.3f}" if result else "-"
        diff = (
            f"{result.trained - result.baseline:+.3f} [{result.difference[0]:+.3f}, {result.difference[1]:+.3f}]"
            if result
            else "-"
        )
        print(
            f"| {night} | {n} | {ranked} | {aucs} | {diff} | {decision} | {serving_apgr:.3f} | {fitted_apgr:.3f} |",
            flush=True,
        )
    # Random order scores 0.5 in expectation on any prompts; on a few hundred its spread is what tells
    # a head worse than a coin toss from an unlucky test set.
    draws = np.random.default_rng(args.seed + 17).random((400, len(test_rows)))
    lo, hi = np.percentile([metrics(d, test.weak, test.strong)["APGR"] for d in draws], [2.5, 97.5])
    print(
        f"\nnever retrained: APGR {generic_apgr:.3f}; random order on these test prompts: 95% of draws "
        f"in [{lo:.3f}, {hi:.3f}]; {time.perf_counter() - started:.0f} s in all"
    )


if __name__ == "__main__":
    main()
