"""A/B of `DifficultyClassifier.score` between this checkout and another: same scores, and how fast.

Each checkout scores in a worker process of its own (its whole `routing` package, with this
interpreter), and both are handed the same prompts in turn, the order flipped every round, so the
machine's drift and other load fall on both alike. Prints each side's time per score (wall clock
and the scoring thread's CPU time; median, p90, p99) over MMLU prompts and over the classifier's
`TIMING_PROMPT`, and the largest difference in score, which must stay within `--tolerance` (the
head was fitted on the baseline's numbers): exit status 1 otherwise.

    git worktree add /tmp/weir-base <commit>
    .venv/bin/python benchmarks/routing_scorepath.py --baseline /tmp/weir-base \\
        --data ../shared/data/routing-mmlu --prompts 2000 --timing-rounds 1000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from routing.difficulty import HEADS, TIMING_PROMPT  # noqa: E402
from routing.train import load_mmlu  # noqa: E402

# Reads a JSON string (a prompt) a line, answers [p_strong, wall seconds, thread CPU seconds].
WORKER = """
import json, sys, time
import torch
from routing.difficulty import DifficultyClassifier
if int(sys.argv[2]):
    torch.set_num_threads(int(sys.argv[2]))
clf = DifficultyClassifier.default(sys.argv[1])
print(json.dumps(clf.kind), flush=True)
for line in sys.stdin:
    prompt = json.loads(line)
    t, c = time.perf_counter(), time.thread_time()
    p = clf.score(prompt)
    print(json.dumps([p, time.perf_counter() - t, time.thread_time() - c]), flush=True)
"""


class Worker:
    def __init__(self, tree: Path, head: str, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, head, str(threads)],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.kind = json.loads(self._read())

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited with status {self.proc.wait()}")
        return line

    def score(self, prompt: str) -> tuple[float, float, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(prompt) + "\n")
        self.proc.stdin.flush()
        p, wall, cpu = json.loads(self._read())
        return p, wall, cpu

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def interleaved(workers: dict[str, Worker], prompts: list[str]) -> dict[str, np.ndarray]:
    """(len(prompts), 3) per side: score, wall seconds, CPU seconds; the side going first alternates."""
    out: dict[str, list[tuple[float, float, float]]] = {name: [] for name in workers}
    names = list(workers)
    for i, prompt in enumerate(prompts):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(workers[name].score(prompt))
    return {name: np.array(rows) for name, rows in out.items()}


def report(title: str, results: dict[str, np.ndarray]) -> None:
    load = os.getloadavg()
    print(f"\n{title} (load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs)")
    base = np.median(results["baseline"][:, 1])
    for name, rows in results.items():
        wall, cpu = rows[:, 1] * 1e3, rows[:, 2] * 1e3
        print(
            f"  {name:8s} wall p50 {np.percentile(wall, 50):.3f}  p90 {np.percentile(wall, 90):.3f}  "
            f"p99 {np.percentile(wall, 99):.3f} ms | CPU p50 {np.percentile(cpu, 50):.3f}  "
            f"p99 {np.percentile(cpu, 99):.3f} ms | median {np.median(rows[:, 1]) / base:.3f}x the baseline's"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout (its repository root)")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared/data/routing-mmlu")
    ap.add_argument("--head", choices=HEADS, default="encoder")
    ap.add_argument("--prompts", type=int, default=2000, help="MMLU prompts, each scored once by each side")
    ap.add_argument("--timing-rounds", type=int, default=1000, help="scores of TIMING_PROMPT by each side")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--tolerance", type=float, default=1e-5, help="largest score difference allowed")
    args = ap.parse_args()

    data = load_mmlu(args.data)
    rng = np.random.default_rng(0)
    prompts = [data.prompts[i] for i in rng.choice(len(data.prompts), args.prompts, replace=False)]
    workers = {
        "baseline": Worker(args.baseline.resolve(), args.head, args.threads),
        "this": Worker(REPO, args.head, args.threads),
    }
    try:
        kinds = {name: w.kind for name, w in workers.items()}
        threads = args.threads or "torch's default"
        print(f"heads: {kinds}; torch threads: {threads}; baseline {args.baseline}, this {REPO}")
        interleaved(workers, prompts[: args.warmup])
        mmlu = interleaved(workers, prompts)
        report(f"{len(prompts)} MMLU prompts, one score each", mmlu)
        if args.timing_rounds:
            report(
                f"TIMING_PROMPT ({len(TIMING_PROMPT)} characters), {args.timing_rounds} scores each",
                interleaved(workers, [TIMING_PROMPT] * args.timing_rounds),
            )
    finally:
        for worker in workers.values():
            worker.close()
    diff = np.abs(mmlu["this"][:, 0] - mmlu["baseline"][:, 0])
    print(
        f"\nscores: largest difference {diff.max():.3g} over {len(prompts)} prompts "
        f"({(diff == 0).sum()} identical); tolerance {args.tolerance:g}"
    )
    if diff.max() > args.tolerance:
        sys.exit(1)


if __name__ == "__main__":
    main()
