"""Speculative decoding vs plain decoding in Weir's engine, side by side, with the real SmolLM2-135M.

    .venv/bin/python benchmarks/spec_bench.py                 # chat + input-grounded, 1 and 8 streams
    .venv/bin/python benchmarks/spec_bench.py --quick         # fewer, shorter requests (smoke run)
    .venv/bin/python benchmarks/spec_bench.py --dtype float32,bfloat16 --quantization none,int8 \
        --speculative ngram,self:layers=8                     # every combination, each beside plain

Two tasks: chat (open-ended questions: drafts from prompt lookup are rarely right, so this measures the
cost of speculating when acceptance is poor, i.e. whether adaptive k backs off) and input-grounded
(rewrite a given paragraph: the answer copies long spans of the prompt). Greedy decoding. For each
dtype x quantization, a plain engine and one engine per speculative method live in one process and run
alternately on the same prompts; per task and concurrency it prints decode tokens/s of plain and
speculative decoding, the ratio, acceptance (overall and per draft position), mean tokens per
verification step, and `same`: how much of the plain output the speculative run reproduced (1.00 in
fp32; bf16 rounding may differ between a (k+1)-row and a 1-row matmul).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHAT = [
    "What are three tips for staying healthy?",
    "Write a haiku about autumn leaves.",
    "Explain what a CPU does in two sentences.",
    "Give me a name for a friendly robot and explain why.",
    "What is the capital of France, and what is it known for?",
    "Describe the water cycle briefly.",
    "Suggest a quick vegetarian dinner.",
    "Why is the sky blue?",
]

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The dog did not move, because it was very tired after a"
    " long day in the garden. The fox looked at the dog, and then it ran away into the forest to find its"
    " family. In the evening, the farmer came home and gave the dog a big bowl of food and fresh water.",
    "Our team met on Monday to plan the new website. We agreed that the home page should be simple and"
    " fast, and that every page should work well on phones. Anna will write the text, Ben will make the"
    " pictures, and Carla will build the pages. We will meet again next Monday to check our progress.",
    "To make a cup of tea, first boil some fresh water. Put a tea bag in a cup, and pour the hot water over"
    " it. Wait for three to five minutes, then take out the tea bag. You can add milk, sugar or lemon if"
    " you like. Drink it while it is warm, and enjoy a quiet moment.",
    "The library will be closed on Friday for cleaning. All books that are due on Friday can be returned on"
    " Saturday without a fine. The reading room will open again on Saturday morning at nine o'clock. Please"
    " ask the staff at the front desk if you have any questions about your books.",
]


def build_prompts(tokenizer, task: str, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    prompts = []
    for i in range(n):
        if task == "chat":
            content = CHAT[i % len(CHAT)]
        else:
            content = (
                f"Rewrite the following text, keeping its meaning and wording:\n\n{TEXTS[i % len(TEXTS)]}"
            )
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        prompts.append(tokenizer.encode(text))
    return prompts


def run(engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    """Output tokens/s over all prompts, `concurrency` at a time (prefill time included, as a user sees)."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs.extend(engine.generate(prompts[i : i + concurrency], params))
    elapsed = time.perf_counter() - start
    return sum(len(o) for o in outputs) / elapsed, outputs


def row_costs(engines: dict[str, object], rows: tuple[int, ...], trials: int) -> dict[str, dict[int, float]]:
    """Median ms of one target forward (+ head) over n new tokens of one request at a 200-token context,
    per engine; all engines and row counts interleaved so load from other processes hits them alike.
    This is what a verification step of k = n - 1 drafts costs next to a plain decode step (n = 1)."""
    from engine.sampling import SamplingParams
    from engine.scheduler import ScheduledBatch

    seqs = {}
    for name, engine in engines.items():
        engine.add_request(
            "rows", [1 + i % 200 for i in range(200)], SamplingParams(max_tokens=4, ignore_eos=True)
        )  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]  # the prefill
        seqs[name] = engine.scheduler.running[0]  # type: ignore[attr-defined]
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in engines}
    for _ in range(trials):
        for name, engine in engines.items():
            seq = seqs[name]
            for n in rows:
                seq.draft_token_ids = [5] * (n - 1)  # the KV slots past the real tokens are scratch
                engine.block_manager.allocate(seq, n)  # type: ignore[attr-defined]
                start = time.perf_counter()
                engine.runner.execute(ScheduledBatch([seq], [n]))  # type: ignore[attr-defined]
                times[name][n].append(time.perf_counter() - start)
                seq.draft_token_ids = []
    for engine in engines.values():
        engine.abort_request("rows")  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
    return {name: {n: 1000 * sorted(v)[len(v) // 2] for n, v in per.items()} for name, per in times.items()}


def agreement(got: list[list[int]], expected: list[list[int]]) -> float:
    """Fraction of the plain run's tokens that the speculative run reproduced before first diverging
    (1.0: token-identical). In fp32 verification is exact; in bf16 a (k+1)-row matmul may round
    differently from a 1-row one, so a near-tie can flip and the texts diverge from there on."""
    same = total = 0
    for g, e in zip(got, expected, strict=True):
        total += len(e)
        for a, b in zip(g, e, strict=False):
            if a != b:
                break
            same += 1
    return same / total if total else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--speculative",
        default="ngram",
        help="comma-separated methods, each beside plain decoding: ngram, draft:<model>, self:int4, self:layers=N",
    )
    parser.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--quantization", default="none", help="comma-separated: none, int8, int4, ...")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="alternate runs per case; best tok/s counts")
    parser.add_argument("--tasks", default="grounded,chat")
    parser.add_argument("--streams", default="1,8", help="comma-separated concurrency levels")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--row-cost",
        action="store_true",
        help="only measure one forward's cost by new-token rows (--rows) per dtype x quantization",
    )
    parser.add_argument(
        "--trials", type=int, default=15, help="--row-cost: forwards per engine and row count"
    )
    parser.add_argument("--rows", default="1,2,4,6,8", help="--row-cost: comma-separated new-token rows")
    args = parser.parse_args()

    import torch

    from engine import registry
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    registry.pull(args.model, quiet=True)
    if args.row_cost:
        engines = {
            f"{dtype} {quant}": LLMEngine(
                args.model, dtype=dtype, quantization=quant, device="cpu", num_kv_blocks=64, progress=False
            )
            for dtype in args.dtype.split(",")
            for quant in args.quantization.split(",")
        }
        rows = tuple(int(n) for n in args.rows.split(","))
        print(
            f"# {args.model}, {args.threads} threads, median of {args.trials}, load avg {os.getloadavg()[0]:.1f}"
        )
        print(
            f"{'dtype quant':<16} "
            + " ".join(f"{f'{n} rows ms':>10}" for n in rows)
            + f"   {rows[-1]} rows / 1 row"
        )
        for name, ms in row_costs(engines, rows, args.trials).items():
            print(
                f"{name:<16} " + " ".join(f"{ms[n]:>10.1f}" for n in rows) + f"   {ms[rows[-1]] / ms[1]:.2f}"
            )
        print(f"# load avg at end {os.getloadavg()[0]:.1f}")
        return
    methods = args.speculative.split(",")
    n_single, n_multi = (2, 8) if args.quick else (4, 16)
    max_tokens = 48 if args.quick else args.max_tokens
    print(
        f"# {args.model}, {args.threads} threads, {platform.machine()}, k={args.k}, max_tokens={max_tokens}, "
        f"best of {args.repeats}, load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'dtype':<9} {'quant':<5} {'method':<14} {'task':<9} {'streams':>7} {'plain':>7} {'spec':>7} "
        f"{'ratio':>6} {'accept':>7} {'tok/step':>8} {'same':>5}  acceptance by position"
    )
    for dtype in args.dtype.split(","):
        for quant in args.quantization.split(","):
            kw = {
                "dtype": dtype,
                "device": "cpu",
                "num_kv_blocks": 256,
                "progress": False,
                "quantization": quant,
            }
            plain = LLMEngine(args.model, **kw)
            specs = {
                m: LLMEngine(args.model, speculative=m, num_speculative_tokens=args.k, **kw) for m in methods
            }
            for task in args.tasks.split(","):
                for concurrency in (int(c) for c in args.streams.split(",")):
                    count = n_single if concurrency == 1 else n_multi
                    prompts = build_prompts(plain.tokenizer, task, count)
                    for engine in (plain, *specs.values()):
                        run(engine, prompts[:1], 1, 4)  # warm-up
                    for engine in specs.values():
                        engine.speculator.metrics = type(engine.speculator.metrics)()
                    best: dict[str, float] = {}
                    outs: dict[str, list[list[int]]] = {}
                    for _ in range(args.repeats):
                        for name, engine in (("plain", plain), *specs.items()):
                            rate, outs[name] = run(engine, prompts, concurrency, max_tokens)
                            best[name] = max(best.get(name, 0.0), rate)
                    for m, engine in specs.items():
                        sm = engine.speculator.metrics
                        by_pos = " ".join(f"{r:.2f}" for r in sm.acceptance_rate_by_position())
                        print(
                            f"{dtype:<9} {quant:<5} {m:<14} {task:<9} {concurrency:>7} {best['plain']:>7.1f} "
                            f"{best[m]:>7.1f} {best[m] / best['plain']:>6.2f} {sm.acceptance_rate:>7.2f} "
                            f"{sm.mean_tokens_per_step:>8.2f} {agreement(outs[m], outs['plain']):>5.2f}  {by_pos}",
                            flush=True,
                        )
            del plain, specs
    print(
        f"# load avg at end {os.getloadavg()[0]:.1f}; same = share of plain tokens reproduced before divergence"
    )


if __name__ == "__main__":
    main()
