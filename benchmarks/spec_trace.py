"""Per-step trace of speculative decoding beside plain decoding (where does a poor-acceptance loss go?).

    nice -n 10 .venv/bin/python benchmarks/spec_trace.py --dtype float32 --tasks grounded,chat

Builds a plain and an n-gram engine (as benchmarks/spec_bench.py does), runs the tasks in order on
both, alternating, and for each request of the speculative engine prints: decode steps, steps that
verified drafts with their k and accepted counts, seconds in speculative vs plain steps (mean per step),
thread counts the engine's tuner chose, and time spent outside the forward (draft lookup in
`begin_step`, `verify`). The engines' own code is untouched: methods are wrapped on the instances.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.spec_bench import build_prompts  # noqa: E402


def instrument(engine: Any, log: list[dict[str, Any]]) -> None:
    """Wrap runner.execute, speculator.begin_step and speculator.verify to append one row per step."""
    import torch

    runner, spec = engine.runner, engine.speculator
    execute = runner.execute

    def timed_execute(batch: Any) -> Any:
        start = time.perf_counter()
        out = execute(batch)
        row = {
            "seconds": time.perf_counter() - start,
            "threads": torch.get_num_threads(),
            "tokens": list(batch.num_tokens),
            "drafts": [len(s.draft_token_ids) for s in batch.seqs],
            "ids": [s.request_id for s in batch.seqs],
            "accepted": [],
            "verify_s": 0.0,
            "begin_s": pending.pop("begin_s", 0.0),
        }
        log.append(row)
        return out

    pending: dict[str, float] = {}
    runner.execute = timed_execute
    if spec is None:
        return
    begin, verify = spec.begin_step, spec.verify

    def timed_begin(*a: Any, **kw: Any) -> None:
        start = time.perf_counter()
        begin(*a, **kw)
        pending["begin_s"] = time.perf_counter() - start

    def timed_verify(seq: Any, *a: Any, **kw: Any) -> list[int]:
        n = len(seq.draft_token_ids)
        start = time.perf_counter()
        tokens = verify(seq, *a, **kw)
        log[-1]["verify_s"] += time.perf_counter() - start
        log[-1]["accepted"].append((n, len(tokens) - 1))
        return tokens

    spec.begin_step, spec.verify = timed_begin, timed_verify


def summarise(name: str, log: list[dict[str, Any]], wall: float, tokens: int) -> None:
    per: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    ks: dict[str, list[str]] = defaultdict(list)
    for row in log:
        if len(row["ids"]) != 1 or row["tokens"][0] != 1 + row["drafts"][0]:
            continue  # prefill or mixed
        rid = row["ids"][0]
        d = per[rid]
        if row["drafts"][0]:
            n, acc = row["accepted"][0] if row["accepted"] else (row["drafts"][0], -1)
            d["spec_steps"] += 1
            d["spec_s"] += row["seconds"]
            d["drafted"] += n
            d["accepted"] += acc
            ks[rid].append(f"{n}/{acc}@{row['threads']}:{1000 * row['seconds']:.0f}ms")
        else:
            d["plain_steps"] += 1
            d["plain_s"] += row["seconds"]
            d[f"plain_t{row['threads']}"] += 1
        d["begin_s"] += row["begin_s"]
        d["verify_s"] += row["verify_s"]
    print(f"## {name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s")
    for rid, d in per.items():
        ps = d["plain_s"] / d["plain_steps"] if d["plain_steps"] else 0.0
        ss = d["spec_s"] / d["spec_steps"] if d["spec_steps"] else 0.0
        print(
            f"  {rid}: plain {int(d['plain_steps'])} x {1000 * ps:.1f} ms"
            f" (t1 {int(d['plain_t1'])}), spec {int(d['spec_steps'])} x {1000 * ss:.1f} ms,"
            f" drafted {int(d['drafted'])} accepted {int(d['accepted'])},"
            f" begin {1000 * d['begin_s']:.1f} ms verify {1000 * d['verify_s']:.1f} ms"
        )
        if ks[rid]:
            print("     k/accepted@threads:ms", " ".join(ks[rid]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tasks", default="grounded,chat")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from engine import registry
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    registry.pull(args.model, quiet=True)
    kw: dict[str, Any] = {"dtype": args.dtype, "device": "cpu", "num_kv_blocks": 256, "progress": False}
    engines = {
        "plain": LLMEngine(args.model, **kw),
        "ngram": LLMEngine(args.model, speculative="ngram", num_speculative_tokens=5, **kw),
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    print(f"# load avg {os.getloadavg()}")
    for task in args.tasks.split(","):
        prompts = build_prompts(engines["plain"].tokenizer, task, args.prompts)
        for e in engines.values():
            e.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))
        for rep in range(args.repeats):
            for name, engine in engines.items():
                log: list[dict[str, Any]] = []
                instrument(engine, log)
                start = time.perf_counter()
                outs = [engine.generate([p], params)[0] for p in prompts]
                wall = time.perf_counter() - start
                del engine.runner.execute  # back to the class's method
                if engine.speculator is not None:
                    del engine.speculator.begin_step, engine.speculator.verify
                summarise(f"{task} rep {rep} {name}", log, wall, sum(len(o) for o in outs))
                sp = engine.speculator
                if sp is not None:
                    print(
                        f"  cost fit: fixed {sp.cost.fixed:.3f} per_token {sp.cost.per_token:.3f}"
                        f" plain_s {[(b, round(1000 * s, 1)) for b, s in sp.cost.plain_s.items()]}"
                        f" rates {[(b, round(sp.rates.rate(b), 2)) for b in range(5)]}"
                    )
    print(f"# load avg {os.getloadavg()}")


if __name__ == "__main__":
    main()
