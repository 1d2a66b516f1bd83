"""Batched paged decode attention alone (engine/model.py `_decode_attention`, which uses the fused CPU
kernel where it builds, and the gather + SDPA path it replaces) at SmolLM2-135M's shapes: CPU ms per
decode step (30 layers, each with its own KV cache), min over interleaved rounds.

    nice -n 10 .venv/bin/python benchmarks/decode_attention_bench.py --threads 2 --dtype float32

Batches 1, 8 and 32 at contexts around 150, 300 and 1,000 tokens (each sequence's length drawn from
[n - 32, n + 32), blocks scattered over the pool as in a long-running cache). Findings: docs/engine.md.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import model as M  # noqa: E402
from engine.config import KNOWN_MODELS  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402

CFG = KNOWN_MODELS["smollm2-135m"]
H, KVH, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim or 0
BS, LAYERS, POOL = 16, 30, 728  # block size, layers, blocks per layer (engine_bench's 0.5 GiB)
EXTRA: dict[str, Callable] = {}  # other implementations to time beside it (same signature)


def make_step(batch: int, ctx: int, dtype: torch.dtype, seed: int = 0):
    rng = random.Random(seed)
    lens = [max(1, ctx + rng.randrange(-32, 32)) for _ in range(batch)] if batch > 1 else [ctx]
    pool = max(POOL, sum(-(-n // BS) for n in lens) + 8)
    free = list(range(pool))
    rng.shuffle(free)
    width = -(-max(lens) // BS)
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = M.AttentionMetadata(
        positions=torch.tensor([n - 1 for n in lens]),
        slot_mapping=torch.zeros(batch, dtype=torch.long),
        num_decodes=batch,
        block_tables=padded,
        context_lens=torch.tensor(lens, dtype=torch.int32),
        max_context_len=max(lens),
        prefills=[],
        block_size=BS,
    )
    caches = [
        (torch.randn(pool, BS, KVH, D).to(dtype), torch.randn(pool, BS, KVH, D).to(dtype))
        for _ in range(LAYERS)
    ]
    q = torch.randn(batch, H, D).to(dtype)
    return q, caches, meta


def step_fn(fn: Callable, q: torch.Tensor, caches, meta) -> Callable[[], None]:
    def run() -> None:
        meta._decode_cache = None  # per step, as the runner builds fresh metadata
        for k, v in caches:
            fn(q, k, v, meta, D**-0.5)

    return run


def gather_sdpa(*args: object) -> torch.Tensor:
    """The engine's path without the fused CPU kernel: index_select gather + SDPA."""
    fused, pa.FUSED_CPU = pa.FUSED_CPU, False
    try:
        return M._decode_attention(*args)  # type: ignore[arg-type]
    finally:
        pa.FUSED_CPU = fused


def cpu_ms(fns: dict[str, Callable[[], None]], rounds: int, reps: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            start = time.process_time()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.process_time() - start) / reps * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="150,300,1000")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    variants = {"engine": M._decode_attention, "gather+sdpa": gather_sdpa}
    variants.update(EXTRA)
    print(f"threads {args.threads} {args.dtype} load {os.getloadavg()}")
    with torch.inference_mode():
        for b in map(int, args.batches.split(",")):
            for n in map(int, args.contexts.split(",")):
                q, caches, meta = make_step(b, n, dtype)
                ref = M._decode_attention(q, *caches[0], meta, D**-0.5)
                for name, fn in variants.items():
                    meta._decode_cache = None
                    out = fn(q, *caches[0], meta, D**-0.5)
                    if out is not None:  # None: a part of the work only (timed, not checked)
                        err = (out.float() - ref.float()).abs().max().item()
                        assert err < 2e-2, (name, err)
                reps = max(1, 64 // b)
                got = cpu_ms({k: step_fn(f, q, caches, meta) for k, f in variants.items()}, args.rounds, reps)
                row = "  ".join(f"{k} {v:7.2f}" for k, v in got.items())
                print(f"batch {b:2d} ctx {n:4d}: {row}  (ms CPU per 30-layer step)", flush=True)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
