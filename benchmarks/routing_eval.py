"""Offline evaluation of the difficulty router on the RouteLLM MMLU outcomes, cross-fitted.

    .venv/bin/python benchmarks/routing_eval.py --data ../shared/data/routing-mmlu

Every prompt is scored by a head trained without it: folds by prompt hash (5), and a harder split
that leaves whole subjects out (5 folds of subjects), which shows how much of the result is "knows the
subject". Contaminated prompts are dropped. Metrics (RouteLLM, arXiv 2406.18665), each with a 95%
bootstrap interval over prompts:
- APGR: area under PGR(share of strong calls), PGR = (quality - weak) / (strong - weak); random = 0.5;
- CPT(50%) / CPT(80%): the share of strong calls needed to recover 50% / 80% of the quality gap;
- quality (accuracy) when 20 / 30 / 50% of calls go to the strong model.
Baselines: always-weak, always-strong, random, prompt length (longer = harder) and, as a reference
that needs labels a router never sees at request time, a per-subject prior learned on the training
folds. Then a latency benchmark of `DifficultyClassifier.score` over real prompts, one at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from routing.difficulty import HEADS, DifficultyClassifier, Encoded, HeadChoice, encode, scoring_time
from routing.embed import DEFAULT_RECIPE, load_embedder
from routing.ranking import auc as ranking_auc
from routing.ranking import auc_interval
from routing.train import (
    Outcomes,
    TrainConfig,
    fit_blend,
    fit_head,
    group_folds,
    load_mmlu,
    prompt_fold,
    question_stem,
)

SHARES = (0.2, 0.3, 0.5)


def quality_curve(score: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> np.ndarray:
    """Accuracy when the k highest-scoring prompts go strong, for k = 0..n.

    Ties are broken at random (fixed seed): a constant or coarse score must not inherit whatever
    order the data happens to be in.
    """
    tiebreak = np.random.default_rng(12345).random(len(score))
    order = np.lexsort((tiebreak, -score))
    gain = (strong.astype(np.float64) - weak)[order]
    return (weak.sum() + np.concatenate([[0.0], np.cumsum(gain)])) / len(score)


def metrics(score: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> dict[str, float]:
    n = len(score)
    q = quality_curve(score, weak, strong)
    w, s = weak.mean(), strong.mean()
    pgr = (q - w) / (s - w)
    out = {"APGR": float(np.sum((pgr[1:] + pgr[:-1]) / 2) / n)}
    for target in (0.5, 0.8):
        reached = np.nonzero(pgr >= target)[0]
        out[f"CPT({target:.0%})"] = float(reached[0] / n) if len(reached) else float("nan")
    for share in SHARES:
        out[f"Q@{share:.0%}"] = float(q[round(share * n)])
    return out


def fold_apgr(score: np.ndarray, weak: np.ndarray, strong: np.ndarray, rows: list[np.ndarray]) -> float:
    """The mean over folds of each fold's APGR, `rows[k]` being fold k's rows (or a resample of them):
    each fold ranked by its own head alone, as a strong-share route ranks one head's scores. Pooled
    scores would also rank the fold heads' calibrations against each other."""
    return float(np.mean([metrics(score[r], weak[r], strong[r])["APGR"] for r in rows]))


def bootstrap(score: np.ndarray, weak: np.ndarray, strong: np.ndarray, rounds: int, seed: int = 0) -> dict:
    point = metrics(score, weak, strong)
    rng = np.random.default_rng(seed)
    draws = {k: [] for k in point}
    for _ in range(rounds):
        idx = rng.integers(0, len(score), len(score))
        for k, v in metrics(score[idx], weak[idx], strong[idx]).items():
            draws[k].append(v)
    return {k: (point[k], *np.nanpercentile(draws[k], [2.5, 97.5])) for k in point}


def subject_folds(groups: list[str], folds: int) -> np.ndarray:
    return group_folds(groups, folds)


def cross_fit(
    data: Outcomes,
    enc: Encoded,
    fold: np.ndarray,
    cfg: TrainConfig,
    stems: Encoded | None = None,
    fallback: bool = False,
) -> dict[str, np.ndarray]:
    """Cross-fitted scores of every prompt: each fold is scored by a head trained on the other folds.

    Returns the heads' components ("components", and "stem components" for the question stems when
    `stems` is given) and "in-sample platt": p_strong with the blend fitted on each head's own training
    rows (the v2 recipe, kept to show its calibration). `blend_across_folds` turns the components into
    the shipped recipe's p_strong. With `fallback`, each fold head also fits its own fallback on its
    training rows' stems (as `weir router train` does) and "stem fallback" is its p_strong of the
    held-out stems (which have no answer options, so the fallback scores them).
    """
    out: dict[str, np.ndarray] = {}
    for k in np.unique(fold):
        train = np.nonzero(fold != k)[0]
        test = np.nonzero(fold == k)[0]
        head = fit_head(
            data.subset(train), enc.subset(train), cfg, stems.subset(train) if fallback and stems else None
        )
        parts = {
            "components": head.components(enc.subset(test)),
            "in-sample platt": head.p_strong(enc.subset(test)),
        }
        if stems is not None:
            parts["stem components"] = head.components(stems.subset(test))
            if fallback:
                parts["stem fallback"] = head.p_strong(stems.subset(test))
        for name, value in parts.items():
            out.setdefault(name, np.zeros((len(data), *value.shape[1:])))[test] = value
        print(f"  fold {k}: trained on {len(train)}, scored {len(test)}", flush=True)
    return out


def blend_across_folds(
    components: np.ndarray, target: np.ndarray, fold: np.ndarray, *also: np.ndarray
) -> list[np.ndarray]:
    """p_strong of each fold from a blend and calibration fitted on the other folds' cross-fitted
    components, as `fit_head` does with its inner folds: no prompt's own label enters its score.
    The same per-fold blends also score each array in `also` (e.g. the question stems' components)."""
    out = [np.zeros(len(components)) for _ in range(1 + len(also))]
    for k in np.unique(fold):
        test = fold == k
        blend = fit_blend(components[~test], target[~test])
        for p, c in zip(out, (components, *also), strict=True):
            p[test] = 1.0 / (1.0 + np.exp(-(c[test] @ blend[:-1] + blend[-1])))
    return out


def subject_prior(data: Outcomes, fold: np.ndarray) -> np.ndarray:
    groups = np.array(data.groups)
    gain = data.strong.astype(float) - data.weak
    score = np.zeros(len(data))
    for k in np.unique(fold):
        train, test = fold != k, fold == k
        overall = gain[train].mean()
        for g in np.unique(groups[test]):
            rows = train & (groups == g)
            score[test & (groups == g)] = gain[rows].mean() if rows.any() else overall
    return score


def print_table(title: str, results: dict[str, dict]) -> None:
    print(f"\n{title}")
    keys = list(next(iter(results.values())))
    width = max(28, *(len(name) + 1 for name in results))
    print(f"{'router':<{width}}" + "".join(f"{k:>24}" for k in keys))
    for name, res in results.items():
        cells = []
        for k in keys:
            v, lo, hi = res[k]
            cells.append(f"{v:.3f} [{lo:.3f},{hi:.3f}]" if not np.isnan(v) else "n/a")
        print(f"{name:<{width}}" + "".join(f"{c:>24}" for c in cells))


# Prompts unlike MMLU: no answer options, chat style, in four kinds of request. "easy" ones any small
# model answers; "hard" ones need multi-step reasoning or specialist knowledge. Not labelled by real
# model outcomes: a check of whether the score moves in the right direction off-distribution, and
# whether it does so for more than prompt length (the length baseline's AUC is printed beside it).
# The first ten of each list are the original probe (kept so figures stay comparable).
PROBE: dict[str, list[tuple[str, str]]] = {
    "easy": [
        ("chat", "hi!"),
        ("chat", "Thanks, that's all for today."),
        ("facts", "What is the capital of France?"),
        ("writing", "Translate 'good morning' into Spanish."),
        ("writing", "Write a haiku about autumn leaves."),
        ("writing", "Give me three synonyms for happy."),
        ("facts", "What day comes after Monday?"),
        ("math", "Convert 5 kilometres to metres."),
        ("chat", "Suggest a name for my new puppy."),
        ("writing", "Summarise in one sentence: The cat sat on the mat all afternoon."),
        ("code", "Write a Python function that returns the sum of a list of numbers."),
        ("code", "How do I print 'hello world' in JavaScript?"),
        ("code", "What does the SQL keyword SELECT do?"),
        ("code", "Reverse a string in Python."),
        ("code", "What is the difference between a list and a tuple in Python, in one line?"),
        ("math", "What is 12 times 11?"),
        ("math", "If I buy 3 apples at 50 cents each, how much do I pay?"),
        ("math", "Is 17 an odd number?"),
        ("math", "Round 3.14159 to two decimal places."),
        ("facts", "How many days are there in a week?"),
        ("facts", "Who wrote Romeo and Juliet?"),
        ("facts", "What colour is the sky on a clear day?"),
        ("chat", "Tell me a short joke about cats."),
        ("chat", "Can you recommend a good book for a long flight?"),
        ("writing", "Write a two-line birthday message for my sister."),
        ("writing", "Fix the spelling: 'I recieved the pakage yesturday.'"),
        # Long but easy: the score should not simply follow length.
        (
            "writing",
            "My neighbour watered my plants and fed my cat for the whole two weeks I was away on holiday, "
            "and I would like to leave a short thank-you note on her door tomorrow morning. Could you "
            "write three friendly sentences I can use?",
        ),
        (
            "chat",
            "I'm having a few friends over on Saturday evening, nothing fancy, maybe six people. Can you "
            "suggest a simple menu with a main course, a side and a dessert that I can mostly prepare in "
            "the afternoon?",
        ),
        (
            "facts",
            "My daughter asked me tonight why leaves change colour in the autumn and I did not know what "
            "to tell her. Can you explain it in a couple of simple sentences that a seven-year-old would "
            "understand?",
        ),
        (
            "code",
            "I have a Python list called names with about twenty strings in it, for example Alice, Bob "
            "and Carol, and I just want to print each one on its own line in alphabetical order. What is "
            "the simplest way to do that?",
        ),
        (
            "math",
            "We are splitting the bill for dinner: the total came to 84 dollars and there were four of us, "
            "and we want to add a tip of about 10 percent on top. How much should each person pay?",
        ),
        (
            "writing",
            "Please rewrite this sentence so it sounds a little more formal for an email to my manager: "
            "'Hey, I can't come in tomorrow because my kid is sick, I'll check emails from home though.'",
        ),
        (
            "chat",
            "I have been feeling a bit unmotivated to go running in the mornings now that it is dark and "
            "cold outside. Can you give me a few simple tips to make it easier to get out of the door?",
        ),
        (
            "facts",
            "I always forget this when I travel: which side of the road do people drive on in the United "
            "Kingdom, and is it the same in Ireland? Just a quick answer is fine, thank you very much.",
        ),
    ],
    "hard": [
        (
            "math",
            "Prove that there is no rational number whose square is 2, then generalise to any non-square integer.",
        ),
        (
            "math",
            "A function f: R -> R satisfies f(x + y) = f(x) f(y) and is continuous. Find all such f and justify.",
        ),
        (
            "code",
            "Derive the time complexity of Dijkstra's algorithm with a Fibonacci heap and explain the amortisation.",
        ),
        (
            "facts",
            "Under the Uniform Commercial Code, when does a merchant's firm offer remain irrevocable without consideration?",
        ),
        (
            "facts",
            "Explain why the Lagrangian of the electromagnetic field is gauge invariant and what Noether current follows.",
        ),
        (
            "writing",
            "Evaluate whether the doctrine of double effect permits a doctor to give pain relief that hastens death.",
        ),
        (
            "math",
            "Compute the determinant of a 4x4 matrix whose (i, j) entry is 1/(i + j - 1), step by step.",
        ),
        (
            "facts",
            "In econometrics, why is OLS inconsistent with a lagged dependent variable and autocorrelated errors?",
        ),
        (
            "facts",
            "Which enzyme deficiency causes Lesch-Nyhan syndrome, and how does it lead to hyperuricemia?",
        ),
        (
            "code",
            "Write a lock-free single-producer single-consumer ring buffer in C11 and argue its memory ordering.",
        ),
        (
            "code",
            "Implement a persistent red-black tree in Haskell with insertion and deletion, and prove the balance invariant is kept.",
        ),
        (
            "code",
            "My Rust async service deadlocks under load when a tokio Mutex guard is held across an await; explain the cause and restructure it.",
        ),
        (
            "code",
            "Write a CUDA kernel for a fused softmax over rows of 8,192 floats and explain how you avoid bank conflicts.",
        ),
        (
            "code",
            "Design a consistent-hashing scheme with bounded loads and show the expected maximum load per server.",
        ),
        (
            "math",
            "How many ways can 10 identical balls be placed into 4 distinct boxes so that no box holds more than 4?",
        ),
        (
            "math",
            "Find the probability that a random chord of a circle is longer than the side of the inscribed equilateral triangle, and explain Bertrand's paradox.",
        ),
        (
            "math",
            "Three people pick numbers from 1 to 100; the closest to two thirds of the mean wins. What should a rational player pick, and why?",
        ),
        (
            "facts",
            "Compare the mechanisms of resistance to carbapenems in Klebsiella pneumoniae and Pseudomonas aeruginosa.",
        ),
        (
            "facts",
            "What did the Treaty of Westphalia change about sovereignty, and how do historians dispute its importance?",
        ),
        (
            "facts",
            "Explain how the Basel III liquidity coverage ratio is computed and which assets count as Level 2B.",
        ),
        (
            "writing",
            "Write a sonnet in strict iambic pentameter whose first letters spell ENTROPY, about the heat death of the universe.",
        ),
        (
            "writing",
            "Draft a contract clause limiting liability for consequential damages that is enforceable under both English and New York law.",
        ),
        (
            "writing",
            "Summarise the argument of Kant's transcendental deduction and the main objection Strawson raised to it.",
        ),
        (
            "chat",
            "I have chest pain radiating to my left arm, I take warfarin and I just fell. What should I consider before going to hospital?",
        ),
        (
            "chat",
            "My startup has 14 months of runway and churn of 6% a month; walk me through whether to raise now or cut burn.",
        ),
        (
            "chat",
            "Plan a 3-week rail trip through Central Asia with visa rules, border crossings and the seasons to avoid.",
        ),
        # Short but hard: the score should not simply follow length.
        ("math", "Factor x^4 + 4 over the integers."),
        ("math", "Is the sum of 1/p over all primes p finite?"),
        ("math", "Evaluate the integral of e^(-x^2) over R."),
        ("code", "Why is std::vector<bool> not a container?"),
        ("code", "Prove the halting problem undecidable."),
        ("facts", "Who proved the Poincare conjecture, and how?"),
        ("facts", "What causes the Lamb shift?"),
        ("writing", "Translate 'Dasein' from Heidegger, with justification."),
        ("chat", "Should I exercise my ISOs before an IPO?"),
        ("math", "Solve x^x = 2 exactly."),
    ],
}


# GPT-4 is right on 3% of this subject's questions (Mixtral 32%, chance 25%): a grading artefact in the
# source data, which a router scores points for learning (it sends the subject to the weak model).
ARTEFACT_SUBJECT = "high_school_mathematics"


def artefact_free(routers: dict[str, np.ndarray], data: Outcomes) -> None:
    """APGR of each router on the prompts outside `ARTEFACT_SUBJECT` (same scores, fewer prompts)."""
    keep = np.array([g != ARTEFACT_SUBJECT for g in data.groups])
    if keep.all():
        return
    w, s = data.weak[keep].astype(float), data.strong[keep].astype(float)
    cells = [
        f"{name} {metrics(score[keep], w, s)['APGR']:.4f}"
        for name, score in routers.items()
        if not name.startswith("always")
    ]
    print(f"  APGR without {ARTEFACT_SUBJECT} ({keep.sum()} prompts): {'; '.join(cells)}")


def auc(hard: np.ndarray, easy: np.ndarray) -> float:
    """The chance that a random hard prompt outscores a random easy one (ties count half)."""
    return ranking_auc(np.concatenate([hard, easy]), np.arange(len(hard) + len(easy)) < len(hard))


PROBE_FILE = Path(__file__).resolve().parent / "data" / "routing_probe.jsonl"


def probe_aucs(
    clf: DifficultyClassifier, title: str, prompts: list[str], hard: np.ndarray, kinds: np.ndarray
) -> None:
    """AUC (hard > easy) on a probe, each with a bootstrap interval: the shipped head with and without
    its fallback for prompts without answer options, and prompt length; then by kind."""
    import dataclasses

    enc = encode(clf.embedder, prompts)
    blend_only = dataclasses.replace(clf.head, fallback=np.zeros(0, np.float32))
    scores = {
        "blend only (v3)": blend_only.p_strong(enc),
        "shipped head": clf.head.p_strong(enc),
        "prompt length": np.array([len(p) for p in prompts], float),
    }
    print(
        f"\n{title}: {(~hard).sum()} easy, {hard.sum()} hard prompts; 95% bootstrap intervals, 2,000 rounds"
    )
    for name, (v, lo, hi) in auc_interval(scores, hard).items():
        print(f"  AUC {name:<34} {v:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    for kind in sorted(set(kinds)):
        k = kinds == kind
        cells = "  ".join(f"{name} {auc(sc[k & hard], sc[k & ~hard]):.2f}" for name, sc in scores.items())
        print(f"  {kind:<10} {cells}")


def held_out_probe(clf: DifficultyClassifier) -> None:
    """The held-out non-MMLU probe (`PROBE_FILE`, written and committed before any head scored it)."""
    import json

    rows = [json.loads(line) for line in PROBE_FILE.read_text().splitlines() if line.strip()]
    hard = np.array([r["label"] == "hard" for r in rows])
    kinds = np.array([r["kind"] for r in rows])
    probe_aucs(clf, f"held-out non-MMLU probe ({PROBE_FILE.name})", [r["prompt"] for r in rows], hard, kinds)


def off_distribution_probe(clf: DifficultyClassifier) -> None:
    held_out_probe(clf)
    rows = PROBE["easy"] + PROBE["hard"]
    hard = np.arange(len(rows)) >= len(PROBE["easy"])
    probe_aucs(clf, "non-MMLU probe (PROBE)", [p for _, p in rows], hard, np.array([k for k, _ in rows]))
    scores = {kind: np.array(clf.score_many([p for _, p in rows])) for kind, rows in PROBE.items()}
    kinds = {kind: np.array([k for k, _ in rows]) for kind, rows in PROBE.items()}
    lengths = {kind: np.array([len(p) for _, p in rows], float) for kind, rows in PROBE.items()}
    easy, hard = scores["easy"], scores["hard"]
    print(f"\nnon-MMLU probe ({len(easy)} easy prompts, {len(hard)} hard ones), shipped head")
    print(
        f"  mean p_strong easy={easy.mean():.3f} hard={hard.mean():.3f}  AUC(hard > easy)={auc(hard, easy):.2f}"
        f"  (prompt length alone: AUC {auc(lengths['hard'], lengths['easy']):.2f});"
        f" the original 10 + 10: AUC {auc(hard[:10], easy[:10]):.2f}"
    )
    for kind in sorted(set(kinds["easy"]) | set(kinds["hard"])):
        e, h = easy[kinds["easy"] == kind], hard[kinds["hard"] == kind]
        le, lh = lengths["easy"][kinds["easy"] == kind], lengths["hard"][kinds["hard"] == kind]
        print(
            f"  {kind:<8} easy {e.mean():.3f} (n={len(e)})  hard {h.mean():.3f} (n={len(h)})"
            f"  AUC {auc(h, e):.2f}  length AUC {auc(lh, le):.2f}"
        )
    # Within a length band: whether the score separates easy from hard prompts of similar length.
    both = np.concatenate([lengths["easy"], lengths["hard"]])
    lo, hi = np.percentile(both, [33, 67])
    e = easy[(lengths["easy"] >= lo) & (lengths["easy"] <= hi)]
    h = hard[(lengths["hard"] >= lo) & (lengths["hard"] <= hi)]
    if len(e) and len(h):
        print(
            f"  prompts of {lo:.0f}-{hi:.0f} characters only: {len(e)} easy, {len(h)} hard, AUC {auc(h, e):.2f}"
        )


def reliability(score: np.ndarray, needs_strong: np.ndarray, bins: int = 10) -> tuple[float, list[str]]:
    """Expected calibration error over `bins` equal-count bins of the score, and each bin as
    "predicted->observed" (mean p_strong, observed share of weak-wrong-strong-right prompts)."""
    edges = np.quantile(score, np.linspace(0, 1, bins + 1))
    which = np.clip(np.searchsorted(edges, score, side="right") - 1, 0, bins - 1)
    ece, cells = 0.0, []
    for b in range(bins):
        rows = which == b
        if not rows.any():
            continue
        predicted, observed = score[rows].mean(), needs_strong[rows].mean()
        ece += rows.mean() * abs(predicted - observed)
        cells.append(f"{predicted:.2f}->{observed:.2f}")
    return float(ece), cells


def calibration(name: str, score: np.ndarray, needs_strong: np.ndarray) -> None:
    ece, cells = reliability(score, needs_strong)
    print(f"  calibration, {name}: ECE {ece:.3f}; by decile (predicted->observed): {' '.join(cells)}")


def latency(prompts: list[str], n: int, what: str = "MMLU prompts", head: HeadChoice = "auto") -> None:
    t0 = time.perf_counter()
    clf = DifficultyClassifier.default(head)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    sample = [prompts[i] for i in rng.integers(0, len(prompts), n)]
    for p in sample[:50]:
        clf.score(p)  # warm-up
    wall, cpu = [], []
    for p in sample:
        t, c = time.perf_counter(), time.thread_time()
        clf.score(p)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    ms, cpu_ms = np.array(wall) * 1e3, np.array(cpu) * 1e3
    chars = np.array([len(p) for p in sample])
    load = os.getloadavg()
    import torch

    print(
        f"\nlatency of DifficultyClassifier.score, one prompt per call, {n} {what}; "
        f"{clf.kind} head (asked: {head}), embedder {clf.embedder.recipe}, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print(
        f"  prompt chars p50={np.percentile(chars, 50):.0f} p99={np.percentile(chars, 99):.0f} max={chars.max()}"
    )
    print(
        f"  p50={np.percentile(ms, 50):.3f} ms  p90={np.percentile(ms, 90):.3f} ms  "
        f"p99={np.percentile(ms, 99):.3f} ms  max={ms.max():.3f} ms  wall clock (load time {load_s:.1f} s)"
    )
    # CPU time of the scoring thread: what a request costs, without the wait for a free core that
    # wall clock includes on an oversubscribed machine. With more than one torch thread the encoder's
    # helper threads are not counted: read wall clock then.
    print(
        f"  p50={np.percentile(cpu_ms, 50):.3f} ms  p90={np.percentile(cpu_ms, 90):.3f} ms  "
        f"p99={np.percentile(cpu_ms, 99):.3f} ms  max={cpu_ms.max():.3f} ms  CPU time of the scoring thread"
    )
    print(
        f"  load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs"
    )
    # Real traffic has prompts far longer than MMLU's (pasted documents): the cost must not grow with them.
    joined = "\n\n".join(sample)
    cells = []
    for chars in (2_000, 10_000, 100_000):
        text = (joined * (1 + chars // max(len(joined), 1)))[:chars]
        cells.append(f"{chars:,} chars {scoring_time(clf, runs=21, prompt=text) * 1e3:.2f} ms")
    print(f"  long prompts (MMLU prompts joined), median of 21: {', '.join(cells)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/routing-mmlu"
    )
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    ap.add_argument("--latency-samples", type=int, default=5000)
    ap.add_argument(
        "--threads", type=int, help="torch threads for the encoder (default: torch's, one per core)"
    )
    ap.add_argument("--skip-subject-folds", action="store_true")
    ap.add_argument("--probe-only", action="store_true", help="only the non-MMLU probe and latency")
    ap.add_argument(
        "--head",
        choices=HEADS,
        default="auto",
        help="the shipped head the probe and latency read: encoder (v4), static (v3), or auto as the "
        "gateway picks it on this machine (default)",
    )
    ap.add_argument(
        "--embedder",
        default=DEFAULT_RECIPE,
        help=f"the fold heads' embedder recipe (routing.embed), {DEFAULT_RECIPE} by default",
    )
    ap.add_argument("--save-scores", type=Path, help="write the cross-fitted scores here (.npz)")
    ap.add_argument(
        "--inner-folds",
        type=int,
        default=0,
        help="train each fold head as shipped, with this many inner calibration folds (6x the time)",
    )
    ap.add_argument(
        "--fallback",
        action="store_true",
        help="each fold head fits its own fallback for prompts without options, as shipped (11x the time)",
    )
    ap.add_argument(
        "--group-ridge",
        type=float,
        default=0.0,
        help="TrainConfig.group_ridge for the fold heads (implies --inner-folds 5 unless given)",
    )
    args = ap.parse_args()

    data = load_mmlu(args.data)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.probe_only:
        off_distribution_probe(DifficultyClassifier.default(args.head))
        latency(data.prompts, args.latency_samples, head=args.head)
        latency(
            [question_stem(p) for p in data.prompts],
            args.latency_samples,
            "question stems (the fallback)",
            head=args.head,
        )
        return
    w, s = data.weak.astype(float), data.strong.astype(float)
    print(
        f"{len(data)} prompts after dropping contaminated ones; weak accuracy {w.mean():.4f}, strong {s.mean():.4f}"
    )
    t0 = time.perf_counter()
    embedder = load_embedder(args.embedder)
    enc = encode(embedder, data.prompts)
    stems = encode(embedder, [question_stem(p) for p in data.prompts])
    print(f"embedded (prompts and their question stems) in {time.perf_counter() - t0:.1f} s")
    # Fold heads without their own inner calibration folds: the blend is fitted across the outer folds
    # instead (blend_across_folds), which is the same recipe at a fifth of the training time.
    # The ridge map is fitted on posteriors cross-fitted inside each fold head's training rows.
    inner = args.inner_folds or (5 if args.group_ridge else 0)
    cfg = TrainConfig(epochs=args.epochs, calibration_folds=inner, group_ridge=args.group_ridge)
    rng = np.random.default_rng(0)
    lengths = np.array([len(p) for p in data.prompts], dtype=float)
    needs_strong = ~data.weak & data.strong

    hash_fold = np.array([prompt_fold(p, args.folds) for p in data.prompts])
    splits = {"folds by prompt hash": hash_fold}
    if not args.skip_subject_folds:
        splits["leave-subjects-out folds"] = subject_folds(data.groups, args.folds)
    saved: dict[str, np.ndarray] = {}
    for split, fold in splits.items():
        t0 = time.perf_counter()
        print(f"\n{split}: training {args.folds} heads", flush=True)
        res = cross_fit(data, enc, fold, cfg, stems, args.fallback)
        fit_s = time.perf_counter() - t0
        ours, ours_stems = blend_across_folds(res["components"], needs_strong, fold, res["stem components"])
        # With inner folds (--group-ridge) each head's own blend is the shipped recipe exactly: fitted on
        # its inner folds' cross-fitted scores. Without them it is the v2 recipe (its training rows).
        own = "ours, head's own blend (inner folds)" if cfg.calibration_folds else "ours, blend on train rows"
        saved |= {f"{split}: {k}": v for k, v in res.items()}
        saved |= {f"{split}: ours": ours, f"{split}: ours, stems": ours_stems, f"{split}: fold": fold}
        routers = {
            "weir difficulty (ours)": ours,
            "ours, options removed": ours_stems,
            **(
                {"ours, options removed, head's fallback": res["stem fallback"]}
                if "stem fallback" in res
                else {}
            ),
            own: res["in-sample platt"],
            "always weak": np.zeros(len(data)),
            "always strong": np.zeros(len(data)),
            "random": rng.random(len(data)),
            "prompt length": lengths,
        }
        if split == "folds by prompt hash":
            # With whole subjects held out there is no prior to look up: the row would only rank folds.
            routers["subject prior (labels)"] = subject_prior(data, fold)
        results = {name: bootstrap(sc, w, s, args.bootstrap) for name, sc in routers.items()}
        # Always-weak and always-strong are the two ends of the curve, not routers along it: only
        # their quality is meaningful (always-strong reaches any CPT target at 100% strong calls).
        for name, quality, cpt in (("always weak", w.mean(), np.nan), ("always strong", s.mean(), 1.0)):
            results[name] = {k: (cpt,) * 3 if k.startswith("CPT") else (np.nan,) * 3 for k in results[name]}
            results[name] |= {f"Q@{share:.0%}": (quality,) * 3 for share in SHARES}
        print_table(
            f"{split} ({args.folds}), cross-fitted in {fit_s:.0f} s; 95% bootstrap CIs, {args.bootstrap} rounds",
            results,
        )
        calibration(
            "each head's own blend and Platt (v2 recipe; shipped recipe with inner folds)",
            res["in-sample platt"],
            needs_strong,
        )
        calibration("blend and Platt fitted on cross-fitted scores (v3, shipped)", ours, needs_strong)
        base = results["random"]["APGR"][0]
        print(f"  APGR ratio ours / random = {results['weir difficulty (ours)']['APGR'][0] / base:.2f}")
        rows = [np.flatnonzero(fold == k) for k in np.unique(fold)]
        print(
            "  APGR fold by fold, mean (each fold ranked by its own head alone): "
            + ", ".join(
                f"{name} {fold_apgr(routers[name], w, s, rows):.4f}"
                for name in ("weir difficulty (ours)", own, "prompt length", "random")
            )
        )
        artefact_free(routers, data)
    if args.save_scores:
        np.savez(args.save_scores, **saved)

    off_distribution_probe(DifficultyClassifier.default(args.head))
    latency(data.prompts, args.latency_samples, head=args.head)


if __name__ == "__main__":
    main()
