"""Where one prefill's time goes: Weir's engine vs Hugging Face transformers, per op category.

    .venv/bin/python benchmarks/prefill_profile.py --side weir --threads 1 --tokens 1024
    .venv/bin/python benchmarks/prefill_profile.py --side hf --threads 2 --tokens 1024 --reps 3

Runs `--reps` single-request prefills of a random `--tokens`-token prompt (greedy, one output token)
after a warm-up of the same length, and prints for each: wall time, process CPU time, the first token.
Then profiles one more with `torch.profiler` and sums each op's self CPU time into categories: the
linears split by layer (qkv/q/k/v, o, gate_up/gate/up, down, head) and by backend (`mkldnn` is oneDNN's
packed kernel, `mm/addmm` MKL), attention (SDPA), paged-cache writes and gathers, norms, rotary,
activations, the embedding lookup, and "other". Self CPU time is summed over threads, so at 2 threads it
reads as CPU seconds, not wall.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# aten/mkldnn op name -> category (the linears are split further by weight shape below)
_CATEGORIES = {
    "mkldnn::_linear_pointwise": "linear",
    "aten::addmm": "linear",
    "aten::mm": "linear",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_scaled_dot_product_attention_math": "attention",
    "aten::bmm": "attention",
    "aten::_softmax": "attention",
    "aten::index_copy_": "kv write",
    "aten::index_select": "kv gather",
    "aten::_fused_rms_norm": "norm",
    "aten::rms_norm": "norm",
    "aten::pow": "norm",
    "aten::mean": "norm",
    "aten::rsqrt": "norm",
    "aten::roll": "rotary",
    "aten::neg": "rotary",
    "aten::cat": "rotary",
    "aten::silu": "activation",
    "aten::embedding": "embedding",
    "aten::argmax": "sampling",
    "aten::topk": "sampling",
}


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(length)]


def weir_runner(
    args: argparse.Namespace,
) -> tuple[Callable[[list[int]], list[int]], dict[tuple[int, int], str]]:
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    engine = LLMEngine(
        args.model,
        dtype="float32",
        packing=args.packing,
        max_num_batched_tokens=args.budget,
        kv_cache_memory_gb=0.5,
        adaptive_threads=args.adaptive,
        progress=False,
    )

    def run(ids: list[int]) -> list[int]:
        engine.add_request("p", ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        out: list[int] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                out += o.new_token_ids
        return out

    return run, layer_shapes(engine.model)


def hf_runner(
    args: argparse.Namespace,
) -> tuple[Callable[[list[int]], list[int]], dict[tuple[int, int], str]]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from engine import registry

    hf_logging.set_verbosity_error()
    path = registry.resolve(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()

    def run(ids: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=1,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(ids) :].tolist()

    return run, layer_shapes(model)


def layer_shapes(model: object) -> dict[tuple[int, int], str]:
    """(in_features, out_features) -> layer kind, from the module names (`...mlp.down_proj` -> down_proj)."""
    from torch import nn

    shapes: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():  # type: ignore[attr-defined]
        if isinstance(module, nn.Linear) or hasattr(module, "packed"):
            kind = name.rsplit(".", 1)[-1]
            key = (module.in_features, module.out_features)
            if key in shapes and kind not in shapes[key].split("|"):
                kind = f"{shapes[key]}|{kind}"  # e.g. q_proj|o_proj share 576x576
            shapes[key] = kind
    return shapes


def linear_kind(event: object, shapes: dict[tuple[int, int], str]) -> str:
    """Layer kind of an mm/addmm/_linear_pointwise event from its recorded input shapes."""
    dims = [list(s) for s in event.input_shapes if s]  # type: ignore[attr-defined]
    name = event.key  # type: ignore[attr-defined]
    backend = "oneDNN" if name.startswith("mkldnn") else "MKL"
    try:
        if name == "aten::addmm":  # (bias, x [n, in], w^T [in, out])
            in_f, out_f = dims[1][1], dims[2][1]
        elif name == "aten::mm":  # (x [n, in], w^T [in, out])
            in_f, out_f = dims[0][1], dims[1][1]
        else:  # (x [n, in], packed weight [out, in] as oneDNN reports it)
            in_f, out_f = dims[0][-1], dims[1][0]
    except (IndexError, TypeError):
        return f"linear ? ({backend})"
    rows = dims[0][0] if name != "aten::addmm" else dims[1][0]
    return f"linear {shapes.get((in_f, out_f), f'{in_f}x{out_f}')} ({backend}, {rows} rows)"


def profile_once(
    run: Callable[[list[int]], list[int]], ids: list[int], shapes: dict[tuple[int, int], str]
) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        run(ids)
        wall = time.perf_counter() - start
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        us = event.self_cpu_time_total
        if us <= 0:
            continue
        category = _CATEGORIES.get(event.key, "other")
        if category == "linear":
            category = linear_kind(event, shapes)
        elif category == "other":
            category = f"other: {event.key}"
        totals[category] += us / 1e6
    total = sum(totals.values())
    print(f"profiled: wall {wall:.3f} s (profiler on), self CPU over ops {total:.3f} s")
    shown = 0.0
    for category, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        if seconds < 0.002 * total:
            continue
        shown += seconds
        print(f"  {category:<48}{seconds:>9.3f} s{100 * seconds / total:>7.1f}%")
    print(f"  {'(smaller ops)':<48}{total - shown:>9.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--side", choices=["weir", "hf"], required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget", type=int, default=1024, help="Weir: max_num_batched_tokens")
    parser.add_argument("--packing", default="auto", help="Weir: engine/packed.py mode")
    parser.add_argument("--adaptive", action="store_true", help="Weir: let the thread tuner choose")
    parser.add_argument("--warmup-tokens", type=int, help="warm-up prompt length (default: --tokens)")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    run, shapes = (weir_runner if args.side == "weir" else hf_runner)(args)
    run(prompt(args.warmup_tokens or args.tokens, seed=0))  # warm-up (primitive caches, allocator)
    for rep in range(args.reps):
        ids = prompt(args.tokens, seed=rep + 1)
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        token = run(ids)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(
            f"{args.side} threads={args.threads} tokens={args.tokens} rep={rep}: wall {wall:.3f} s, "
            f"cpu {cpu:.3f} s, token {token}, load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    if not args.no_profile:
        profile_once(run, prompt(args.tokens, seed=99), shapes)


if __name__ == "__main__":
    main()
