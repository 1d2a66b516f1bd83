"""Prefill time with the native CPU ops (kernels/cpu_ops.c) and without them, interleaved in one process.

    .venv/bin/python benchmarks/cpu_ops_ab.py                                   # bf16, 4 x 128 tokens
    .venv/bin/python benchmarks/cpu_ops_ab.py --dtype float32 --prompts 1 --tokens 1024

Each round prefills fresh random prompts (greedy, one output token, so no prefix cache helps) once with
the ops and once with PyTorch's (`WEIR_CPU_OPS=0`, the library reloaded), in alternating order; it
prints the medians and the range of the rounds' ratios. Interleaving in one process keeps a shared VM's
slow and fast phases out of the ratio, which separate runs minutes apart do not.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per prefill (one step of 512 tokens)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from weir.kernels import cpu_ops

    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, dtype=args.dtype, max_num_seqs=max(args.prompts, 8), progress=False)
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size

    def prefill() -> float:
        prompts = [[rng.randrange(100, vocab) for _ in range(args.tokens)] for _ in range(args.prompts)]
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    def use_ops(on: bool) -> None:
        os.environ["WEIR_CPU_OPS"] = "1" if on else "0"
        cpu_ops.library.cache_clear()
        if on and cpu_ops.library() is None:
            sys.exit("the native ops did not build here (no C compiler?)")

    times: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False):  # warm-up: builds, first-touch allocations
        use_ops(on)
        prefill()
    for r in range(args.rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            use_ops(on)
            times[on].append(prefill())
    ratios = sorted(off / on for off, on in zip(times[False], times[True], strict=True))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"# {args.model} {args.dtype}, {args.threads} threads, {args.prompts} x {args.tokens} tokens")
    print(f"without the ops {off * 1e3:.0f} ms, with {on * 1e3:.0f} ms (medians of {args.rounds})")
    print(f"speed-up {off / on:.2f}x, rounds {ratios[0]:.2f}-{ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
