"""Weir's engine vs Hugging Face transformers, side by side on the same prompts, on this machine's CPU.

    .venv/bin/python benchmarks/engine_bench.py                # SmolLM2-135M, fp32, 2 threads
    .venv/bin/python benchmarks/engine_bench.py --quick        # smaller sizes, for a smoke run
    .venv/bin/python benchmarks/engine_bench.py --repeat 3     # 3 interleaved pairs: medians, ratio range

Measures, for each side: time to first token for 128- and 1024-token prompts, single-stream decode
tokens/s, total output tokens/s with 8 and 32 concurrent requests of 128 prompt + 128 output tokens
(transformers: one static, left-padded batch through `generate`; Weir: all requests added at once to the
continuous-batching engine), and the process's peak resident memory. Each side runs in its own
subprocess (so peak memory is its own) and the parent prints both and the ratios.

Prompts are random token ids (seeded, the same for both sides, distinct per request so no prefix cache
helps); generation is greedy and forced to its full length (ignore EOS) on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def median_time(fn: Callable[[int], None], reps: int) -> float:
    times = []
    for i in range(reps):
        start = time.perf_counter()
        fn(i)
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def progress(side: str, out: dict[str, float]) -> None:
    key = list(out)[-1]
    print(f"  {side}: {key} = {out[key]:.3f} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- Weir ---------------------------------------------------------------------------------------------


def read_bandwidth_gb_s() -> float:
    """Memory read bandwidth this process gets with its threads (a sum over 1 GiB, best of 5): what a
    single stream's decode is bound by, since every token reads every weight once."""
    import torch

    x = torch.ones(1 << 28)  # 1 GiB of fp32
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_bytes_per_token(model: object) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer but the embedding table (one
    row per token) and the rotary tables; a tied head counts once, as the head."""
    import torch

    seen: set[int] = set()
    total = 0
    params = dict(model.named_parameters(remove_duplicate=False))  # type: ignore[attr-defined]
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # type: ignore[attr-defined]
        if "embed_tokens" in name or "rotary" in name or id(t) in seen or not isinstance(t, torch.Tensor):
            continue
        if name.endswith(".packed") and f"{name[: -len('packed')]}weight" in params:  # DualLinear's 2nd copy
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    head = getattr(model.lm_head, "weight", None)  # type: ignore[attr-defined]
    if head is not None and head is model.embed_tokens.weight:  # type: ignore[attr-defined]
        total += head.numel() * head.element_size()
    return total


def run_weir(args: argparse.Namespace) -> dict[str, float]:
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    bandwidth = read_bandwidth_gb_s()
    engine = LLMEngine(
        args.model,
        dtype=args.dtype,
        packing=args.packing,
        fused_decode=args.fused_decode,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_memory,
        device=args.device,
        progress=False,
    )
    out: dict[str, float] = {}
    # the ceiling for one stream: bandwidth / bytes read per token (ignores attention and activations)
    out["roofline_decode_tok_s"] = bandwidth * 1e9 / decode_bytes_per_token(engine.model)

    def first_token(prompt: list[int]) -> None:
        engine.add_request("ttft", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    engine.generate(prompts(1, 32, 0), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for length in args.ttft_lengths:
        ps = prompts(args.reps, length, seed=length)
        out[f"ttft_{length}_s"] = median_time(lambda i, ps=ps: first_token(ps[i]), args.reps)
        progress("weir", out)

    n = args.decode_tokens
    [prompt] = prompts(1, args.prompt_len, seed=1)
    engine.add_request("decode", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    first_at = None
    while engine.has_unfinished_requests():
        if engine.step() and first_at is None:
            first_at = time.perf_counter()
    assert first_at is not None
    out["decode_tok_s"] = (n - 1) / (time.perf_counter() - first_at)
    progress("weir", out)

    for batch in args.batches:
        ps = prompts(batch, args.prompt_len, seed=100 + batch)
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = engine.generate(ps, params)
        elapsed = time.perf_counter() - start
        assert all(len(o) == args.output_len for o in outs)
        out[f"batch{batch}_tok_s"] = batch * args.output_len / elapsed
        progress("weir", out)
    return out


# --- transformers -------------------------------------------------------------------------------------


def run_hf(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from engine import registry

    hf_logging.set_verbosity_error()
    path = registry.resolve(args.model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.to(args.device).eval()
    out: dict[str, float] = {}

    def generate(batch: list[list[int]], new_tokens: int) -> torch.Tensor:
        # left padding, as transformers recommends for batched generation of decoder-only models
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            return model.generate(
                input_ids=ids.to(args.device),
                attention_mask=mask.to(args.device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    generate(prompts(1, 32, 0), 4)  # warm-up
    for length in args.ttft_lengths:
        ps = prompts(args.reps, length, seed=length)
        out[f"ttft_{length}_s"] = median_time(lambda i, ps=ps: generate([ps[i]], 1), args.reps)
        progress("hf", out)

    n = args.decode_tokens
    [prompt] = prompts(1, args.prompt_len, seed=1)
    one = median_time(lambda _: generate([prompt], 1), 2)
    start = time.perf_counter()
    generate([prompt], n)
    _sync()
    out["decode_tok_s"] = (n - 1) / (time.perf_counter() - start - one)
    progress("hf", out)

    for batch in args.batches:
        ps = prompts(batch, args.prompt_len, seed=100 + batch)
        start = time.perf_counter()
        result = generate(ps, args.output_len)
        _sync()
        elapsed = time.perf_counter() - start
        assert result.shape[1] == args.prompt_len + args.output_len
        out[f"batch{batch}_tok_s"] = batch * args.output_len / elapsed
        progress("hf", out)
    return out


# --- driver -------------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    result = run_weir(args) if args.side == "weir" else run_hf(args)
    result["load_avg"] = (load_before + os.getloadavg()[0]) / 2
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device.startswith("cuda"):
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / (1 << 20)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--packing",
        default="auto",
        choices=["auto", "dual", "on", "off"],
        help="Weir: CPU weight layout (engine/packed.py)",
    )
    parser.add_argument(
        "--fused-decode",
        default="auto",
        choices=["auto", "on", "off"],
        help="Weir: a lone sequence's decode step as one native call (engine/fused_step.py)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB of KV cache for Weir")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes: a smoke run, not numbers to record"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="pairs of runs (Weir then transformers); prints medians and the pairs' ratios (3+ on a busy VM)",
    )
    parser.add_argument("--side", choices=["weir", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.ttft_lengths = [128, 1024]
    args.reps = 3
    args.prompt_len, args.output_len, args.decode_tokens = 128, 128, 128
    args.batches = [8, 32]
    if args.quick:
        args.ttft_lengths, args.reps = [128, 256], 1
        args.output_len, args.decode_tokens, args.batches = 16, 32, [4, 8]

    if args.side:
        child(args)
        return

    from engine import registry

    registry.pull(args.model, quiet=True)  # no-op when present; both sides read the same GGUF
    print(
        f"# {args.model} {args.dtype}, {args.threads} threads, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )

    def run_side(side: str) -> dict[str, float]:
        cmd = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{side} failed:\n{proc.stdout}")
        return json.loads(lines[-1].removeprefix("RESULT "))

    # Pairs run back to back (Weir, then transformers), so each pair's ratio compares two runs that
    # met about the same machine; on a shared VM single runs swing by tens of percent.
    runs: dict[str, list[dict[str, float]]] = {"weir": [], "hf": []}
    for _ in range(args.repeat):
        for side in runs:
            runs[side].append(run_side(side))

    def speedup(key: str, weir: dict[str, float], hf: dict[str, float]) -> float:
        lower_is_better = key.startswith("ttft") or key.endswith("_mib")
        return hf[key] / weir[key] if lower_is_better else weir[key] / hf[key]

    def median_of(side: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[side])

    if args.repeat > 1:
        print(f"# {args.repeat} pairs; values are medians, weir/hf the median of the pairs' ratios [min-max]")
    print(f"{'metric':<22}{'weir':>12}{'transformers':>14}{'weir/hf':>10}")
    for key in runs["weir"][0]:
        if key == "roofline_decode_tok_s":
            roofline = median_of("weir", key)
            print(f"{'roofline decode tok/s':<22}{roofline:>12.1f}   (bandwidth / weight bytes per token)")
            print(f"{'weir decode/roofline':<22}{median_of('weir', 'decode_tok_s') / roofline:>12.2f}")
            continue
        if key == "load_avg":
            print(f"{'load average':<22}{median_of('weir', key):>12.1f}{median_of('hf', key):>14.1f}")
            continue
        ratios = [speedup(key, w, h) for w, h in zip(runs["weir"], runs["hf"], strict=True)]
        line = f"{key:<22}{median_of('weir', key):>12.3f}{median_of('hf', key):>14.3f}"
        line += f"{statistics.median(ratios):>9.2f}x"
        if len(ratios) > 1:
            line += f"  [{min(ratios):.2f}-{max(ratios):.2f}]"
        print(line)
    print("# ratios are speed-ups (>1: Weir better) for every row, including times and memory")


if __name__ == "__main__":
    main()
