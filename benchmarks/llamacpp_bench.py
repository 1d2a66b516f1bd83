"""Weir's quantized engine vs llama.cpp (llama-cpp-python) on the same model, threads and prompts.

    .venv/bin/pip install -e '.[bench]'     # builds llama.cpp from source (slow on 2 cores)
    .venv/bin/python benchmarks/llamacpp_bench.py [--threads 2] [--quick]

For each side: single-stream decode tok/s (one sequence, after its prompt) and total output tok/s for
32 parallel sequences (prompts prefilled, then every step decodes one token for each; the clock covers
prefill and decode, as in ``engine_bench``). llama.cpp runs through its C API (``llama_batch`` with one
sequence id per request and a unified KV cache, what ``llama-batched-bench`` does), greedy by argmax of
the logits. Its GGUFs are written from the registry model (Q4_1) with llama.cpp's own quantizer:
Q8_0 (requantized, i.e. the same weights on llama.cpp's 8-bit grid) plus the Q4_1 file itself.
Weir runs none/int8/int4 with float32 and bfloat16 activations. Every configuration runs in its own
subprocess, one after the other; prompts are random token ids, seeded, the same on both sides.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.engine_bench import prompts  # noqa: E402

_quiet_log = None
LLAMA_FTYPES = {"q8_0": 7, "q4_0": 2, "f16": 1}  # llama_ftype values (llama.h)


def gguf_for(kind: str, model: str) -> Path:
    """The registry GGUF itself for its own type, else a requantized copy next to it (made once)."""
    from engine import registry

    source = registry.resolve(model)
    if kind in source.stem.lower():
        return source
    out = source.with_name(f"{source.stem.rsplit('.', 1)[0]}.{kind.upper()}.gguf")
    if not out.exists():
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPES[kind]
        params.allow_requantize = True  # the source is already quantized (Q4_1)
        params.nthread = 2
        tmp = out.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize -> {rc}")
        tmp.rename(out)
    return out


# --- llama.cpp ----------------------------------------------------------------------------------------


def request_amx() -> None:
    """Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); ggml built with
    GGML_NATIVE on an AMX CPU runs tile instructions without asking and dies with SIGILL (seen here with
    llama-cpp-python 0.3.36). PyTorch's oneDNN asks for itself. Harmless where AMX is absent."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    libc.syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata)


def run_llamacpp(args: argparse.Namespace) -> dict[str, float]:
    import llama_cpp as L
    import numpy as np

    path = gguf_for(args.gguf, args.model)
    request_amx()
    L.llama_backend_init()
    global _quiet_log  # ctypes callbacks must outlive the call that registers them
    _quiet_log = L.llama_log_callback(lambda *_: None)
    L.llama_log_set(_quiet_log, ctypes.c_void_p())
    mp = L.llama_model_default_params()
    # the extra buffer types hold weights repacked for AMX / AVX-512 kernels; the AMX one dies with SIGILL
    # here (tilezero in ggml_backend_amx_mul_mat, even with tile permission granted), so off by default
    mp.use_extra_bufts = args.extra_bufts
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    n_seq = args.batch
    cp = L.llama_context_default_params()
    cp.n_ctx = n_seq * (args.prompt_len + args.output_len) + 256
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = n_seq
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.kv_unified = True
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, n_seq)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, sequence, want logits) -> argmax token of every entry that wants logits."""
        out = []
        for start in range(0, len(entries), 512):
            chunk = entries[start : start + 512]
            batch.n_tokens = len(chunk)
            for i, (tok, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for i, (*_, logits) in enumerate(chunk):
                if logits:
                    row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                    out.append(int(row.argmax()))
        return out

    def generate(ps: list[list[int]], n: int) -> tuple[float, float]:
        """-> (seconds for everything, seconds from the first generated token on)."""
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        start = time.perf_counter()
        entries = [(t, i, s, i == len(p) - 1) for s, p in enumerate(ps) for i, t in enumerate(p)]
        last = decode(entries)
        first_at = time.perf_counter()
        for step in range(n - 1):
            last = decode([(t, len(ps[s]) + step, s, True) for s, t in enumerate(last)])
        L.llama_synchronize(ctx)
        end = time.perf_counter()
        return end - start, end - first_at

    generate(prompts(1, 16, 0), 4)  # warm-up
    out: dict[str, float] = {}
    _, decode_s = generate(prompts(1, args.prompt_len, seed=1), args.decode_tokens)
    out["decode_tok_s"] = (args.decode_tokens - 1) / decode_s
    total_s, _ = generate(prompts(n_seq, args.prompt_len, seed=100 + n_seq), args.output_len)
    out[f"batch{n_seq}_tok_s"] = n_seq * args.output_len / total_s
    out["file_mb"] = path.stat().st_size / 1e6
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return out


# --- Weir ---------------------------------------------------------------------------------------------


def run_weir(args: argparse.Namespace) -> dict[str, float]:
    from engine.llm_engine import LLMEngine
    from engine.quant import weight_bytes
    from engine.sampling import SamplingParams

    engine = LLMEngine(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.batch,
        max_num_batched_tokens=1024,
        kv_cache_memory_gb=0.5,
        device="cpu",
        progress=False,
    )
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.generate(prompts(1, 16, 0), greedy)  # warm-up
    out: dict[str, float] = {}
    n = args.decode_tokens
    engine.add_request(
        "decode",
        prompts(1, args.prompt_len, seed=1)[0],
        greedy.__class__(max_tokens=n, temperature=0, ignore_eos=True),
    )
    first_at = None
    while engine.has_unfinished_requests():
        if engine.step() and first_at is None:
            first_at = time.perf_counter()
    assert first_at is not None
    out["decode_tok_s"] = (n - 1) / (time.perf_counter() - first_at)
    ps = prompts(args.batch, args.prompt_len, seed=100 + args.batch)
    start = time.perf_counter()
    outs = engine.generate(ps, SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True))
    assert all(len(o) == args.output_len for o in outs)
    out[f"batch{args.batch}_tok_s"] = args.batch * args.output_len / (time.perf_counter() - start)
    out["weights_mb"] = weight_bytes(engine.model) / 1e6
    return out


# --- driver -------------------------------------------------------------------------------------------

CONFIGS = [
    ("llama.cpp", "q8_0", ""),
    ("llama.cpp", "q4_1", ""),
    ("weir", "none", "float32"),
    ("weir", "none", "bfloat16"),
    ("weir", "int8", "float32"),
    ("weir", "int8", "bfloat16"),
    ("weir", "int4-g32", "float32"),
    ("weir", "int4-g32", "bfloat16"),
]


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    result = run_llamacpp(args) if args.side == "llama.cpp" else run_weir(args)
    result["load_avg"] = (load + os.getloadavg()[0]) / 2
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64, help="tokens per sequence in the batch run")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens of the single stream")
    parser.add_argument(
        "--only", nargs="+", help="configurations to run, e.g. llama.cpp:q8_0 weir:int8:bfloat16"
    )
    parser.add_argument(
        "--extra-bufts", action="store_true", help="llama.cpp: repacked (AMX/AVX-512) weight buffers"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not numbers")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.prompt_len, args.output_len, args.decode_tokens = 4, 16, 8, 16
    if args.side:
        child(args)
        return

    from engine import registry

    registry.pull(args.model, quiet=True)
    configs = [c for c in CONFIGS if not args.only or ":".join(filter(None, c)) in args.only]
    print(f"# {args.model}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'config':<26}{'decode tok/s':>14}{f'batch{args.batch} tok/s':>16}{'MB':>9}{'load':>7}")
    for side, quant, dtype in configs:
        extra = ["--gguf", quant] if side == "llama.cpp" else ["--quantization", quant, "--dtype", dtype]
        common = [
            *("--model", args.model, "--threads", str(args.threads), "--batch", str(args.batch)),
            *("--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)),
            *("--decode-tokens", str(args.decode_tokens)),
            *(["--extra-bufts"] if args.extra_bufts else []),
        ]
        proc = subprocess.run(
            [sys.executable, __file__, "--side", side, *extra, *common],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        name = f"{side} {quant} {dtype}".strip()
        if proc.returncode != 0 or not lines:
            print(f"{name:<26} FAILED: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}", flush=True)
            continue
        r = json.loads(lines[-1].removeprefix("RESULT "))
        mb = r.get("file_mb", r.get("weights_mb", 0.0))
        print(
            f"{name:<26}{r['decode_tok_s']:>14.1f}{r[f'batch{args.batch}_tok_s']:>16.1f}{mb:>9.1f}"
            f"{r['load_avg']:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
