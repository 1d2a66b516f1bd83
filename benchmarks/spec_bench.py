"""Speculative decoding vs plain decoding in Weir's engine, side by side, with the real SmolLM2-135M.

    .venv/bin/python benchmarks/spec_bench.py                 # chat + input-grounded, 1 and 8 streams
    .venv/bin/python benchmarks/spec_bench.py --quick         # fewer, shorter requests (smoke run)

Two tasks: chat (open-ended questions: drafts from prompt lookup are rarely right, so this measures the
cost of speculating when acceptance is poor, i.e. whether adaptive k backs off) and input-grounded
(rewrite a given paragraph: the answer copies long spans of the prompt). Greedy decoding; the script
checks the speculative output is token-identical to the plain one. For each task and concurrency it
prints decode tokens/s for both engines, the ratio, acceptance rate per draft position and mean tokens
per verification step. Both engines live in one process and run alternately on the same prompts.
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    import torch

    from engine import registry
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    registry.pull(args.model, quiet=True)
    kw = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 1024, "progress": False}
    plain = LLMEngine(args.model, **kw)
    spec = LLMEngine(args.model, speculative="ngram", num_speculative_tokens=args.k, **kw)
    n_single, n_multi = (2, 8) if args.quick else (4, 16)
    max_tokens = 48 if args.quick else args.max_tokens
    print(
        f"# {args.model} fp32, {args.threads} threads, {platform.machine()}, speculative=ngram k={args.k}, "
        f"max_tokens={max_tokens}, load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'task':<10} {'streams':>7} {'plain tok/s':>12} {'ngram tok/s':>12} {'ratio':>6} {'accept':>7}"
        f" {'tok/step':>8}  acceptance by position"
    )
    for task in ("grounded", "chat"):
        for concurrency, count in ((1, n_single), (8, n_multi)):
            prompts = build_prompts(plain.tokenizer, task, count)
            run(plain, prompts[:1], 1, 4)  # warm-up
            run(spec, prompts[:1], 1, 4)
            before = spec.speculator.metrics
            spec.speculator.metrics = type(before)()
            base, expected = run(plain, prompts, concurrency, max_tokens)
            fast, got = run(spec, prompts, concurrency, max_tokens)
            if got != expected:
                raise SystemExit(f"{task}/{concurrency}: speculative output differs from plain decoding")
            m = spec.speculator.metrics
            by_pos = " ".join(f"{r:.2f}" for r in m.acceptance_rate_by_position())
            print(
                f"{task:<10} {concurrency:>7} {base:>12.1f} {fast:>12.1f} {fast / base:>6.2f} "
                f"{m.acceptance_rate:>7.2f} {m.mean_tokens_per_step:>8.2f}  {by_pos}",
                flush=True,
            )
    print(f"# load avg at end {os.getloadavg()[0]:.1f}; outputs token-identical to plain decoding")


if __name__ == "__main__":
    main()
