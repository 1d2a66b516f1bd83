"""One prepared GPU check: every Triton kernel against its PyTorch reference, decode GEMV bandwidth as a
fraction of the card's peak, and engine decode tok/s for none/int8/int4 (and fp8 on compute capability 8.9+).
Needs CUDA and Triton.

    .venv/bin/python benchmarks/gpu_kernels.py [--peak-gbs 4800] [--skip-engine] [--json out.json]

Prints one line per check (PASS/FAIL with the error against the tolerance), one per GEMV shape (GB/s,
% of peak, % of a device-to-device copy, speed-up over the dequantise-then-matmul baseline) and one per
engine run. Exits non-zero if any kernel check fails. Models use random weights (the real GGUF does not
travel to the GPU machine); decode speed does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.quant import quantize_int4, quantize_int8
from weir.kernels.fp8_matmul import fp8_matmul_ref, fp8_matmul_triton, fp8_triton_supported, quantize_fp8
from weir.kernels.int4_matmul import int4_matmul_ref, int4_matmul_triton
from weir.kernels.int8_matmul import int8_matmul_ref, int8_matmul_triton
from weir.kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton
from weir.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from weir.kernels.rotary import build_cos_sin_cache, rotary_embedding_ref, rotary_embedding_triton

# relative to the largest reference magnitude; tl.dot on fp32 inputs uses TF32 on tensor cores
TOLERANCE = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# HBM peak in GB/s for cards whose driver-reported clocks are unreliable or absent
PEAK_GBS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
    "A10G": 600,
    "A10": 600,
    "RTX 4090": 1008,
    "RTX 3090": 936,
    "V100": 900,
    "T4": 320,
}

failures: list[str] = []
results: dict[str, list[dict[str, object]]] = {"checks": [], "gemv": [], "engine": []}


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    err = (actual.float() - expected.float()).abs().max().item()
    scale = max(expected.float().abs().max().item(), 1.0)
    ok = math.isfinite(err) and err <= TOLERANCE[dtype] * scale
    results["checks"].append({"name": name, "dtype": str(dtype), "err": err, "scale": scale, "ok": ok})
    print(
        f"{'PASS' if ok else 'FAIL'} {name:<44} {dtype!s:<15} max err {err:.3g} (tol {TOLERANCE[dtype] * scale:.3g})"
    )
    if not ok:
        failures.append(f"{name} {dtype}")


def check_kernels(dev: torch.device) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for n, k in ((960, 576), (576, 1536), (4096, 4096), (11008, 4096)):
            w = torch.randn(n, k, device=dev, generator=g) * 0.02
            q8, s8 = quantize_int8(w.to(dtype))
            for m in (1, 4, 77, 512):
                x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
                ref = int8_matmul_ref(x.float(), q8, s8.float())
                check(f"int8 matmul m={m} n={n} k={k}", int8_matmul_triton(x, q8, s8), ref, dtype)
                if fp8_triton_supported(dev):
                    qf, sf = quantize_fp8(w)
                    ref = fp8_matmul_ref(x.float(), qf, sf)
                    check(f"fp8 matmul m={m} n={n} k={k}", fp8_matmul_triton(x, qf, sf), ref, dtype)
                for group in (32, 64, 128):
                    qw, sz = quantize_int4(w.to(dtype), group)
                    ref = int4_matmul_ref(x.float(), qw, sz.float(), group)
                    check(
                        f"int4-g{group} matmul m={m} n={n} k={k}",
                        int4_matmul_triton(x, qw, sz, group),
                        ref,
                        dtype,
                    )
        for heads, kv_heads, d in ((9, 3, 64), (32, 8, 128)):
            block, lens = 16, [1, 15, 16, 17, 300, 2048]
            blocks = sum(-(-n // block) for n in lens)
            kc = torch.randn(blocks + 3, block, kv_heads, d, device=dev, dtype=dtype, generator=g)
            vc = torch.randn_like(kc)
            table = torch.full((len(lens), -(-max(lens) // block)), -1, dtype=torch.int32, device=dev)
            perm = torch.randperm(blocks, device=dev, generator=g).int()
            used = 0
            for b, n in enumerate(lens):
                table[b, : -(-n // block)] = perm[used : used + -(-n // block)]
                used += -(-n // block)
            q = torch.randn(len(lens), heads, d, device=dev, dtype=dtype, generator=g)
            ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
            ref = paged_decode_attention_ref(q, kc, vc, table, ctx)
            check(
                f"paged decode attention h={heads}/{kv_heads} d={d}",
                paged_decode_attention_triton(q, kc, vc, table, ctx),
                ref,
                dtype,
            )
        for hidden in (576, 4096):
            x = torch.randn(300, hidden, device=dev, dtype=dtype, generator=g)
            r = torch.randn_like(x)
            w = torch.rand(hidden, device=dev, dtype=dtype, generator=g) + 0.5
            check(f"rms_norm h={hidden}", rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype)
            out, res = rms_norm_triton(x, w, 1e-5, r)
            ref_out, ref_res = rms_norm_ref(x, w, 1e-5, r)
            check(f"rms_norm+residual h={hidden}", out, ref_out, dtype)
            check(f"rms_norm+residual (sum) h={hidden}", res, ref_res, dtype)
        for is_neox in (True, False):
            cache = build_cos_sin_cache(128, 4096).to(dev)
            pos = torch.randint(0, 4096, (300,), device=dev, generator=g)
            q = torch.randn(300, 32, 128, device=dev, dtype=dtype, generator=g)
            k = torch.randn(300, 8, 128, device=dev, dtype=dtype, generator=g)
            tq, tk = rotary_embedding_triton(pos, q, k, cache, is_neox)
            rq, rk = rotary_embedding_ref(pos, q, k, cache, is_neox)
            check(f"rotary neox={is_neox} q", tq, rq, dtype)
            check(f"rotary neox={is_neox} k", tk, rk, dtype)


def bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=200)


def peak_gbs(dev: torch.device, override: float | None) -> tuple[float, str]:
    if override:
        return override, "--peak-gbs"
    props = torch.cuda.get_device_properties(dev)
    for name, gbs in PEAK_GBS.items():
        if name.lower() in props.name.lower():
            return float(gbs), f"table ({name})"
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "driver clocks"
    return float("nan"), "unknown (pass --peak-gbs)"


def copy_gbs(dev: torch.device) -> float:
    """What a plain device-to-device copy achieves: the practical ceiling for a streaming kernel."""
    buf = torch.empty(2**30, dtype=torch.uint8, device=dev)
    return 2 * buf.numel() / bench_ms(buf.clone) / 1e6


def gemv_rows(n: int, k: int, dev: torch.device) -> list[tuple[str, float, int, float]]:
    """(kernel, ms, weight bytes read, ms of its baseline) for one decode GEMV shape."""
    dtype = torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
    x = torch.randn(1, k, device=dev, dtype=dtype)
    dense_ms = bench_ms(lambda: x @ w.t())
    rows = [("bf16 (cuBLAS)", dense_ms, n * k * 2, dense_ms)]
    q8, s8 = quantize_int8(w)
    dequant_ms = bench_ms(lambda: x @ (q8.to(dtype) * s8[:, None]).t())
    int8_ms = bench_ms(lambda: int8_matmul_triton(x, q8, s8))
    rows.append(("int8 triton gemv", int8_ms, q8.numel() + s8.numel() * 2, dequant_ms))
    if fp8_triton_supported(dev):
        qf, sf = quantize_fp8(w)
        fp8_ms = bench_ms(lambda: fp8_matmul_triton(x, qf, sf))
        rows.append(("fp8 triton gemv", fp8_ms, qf.numel() + sf.numel() * 4, dequant_ms))
    for group in (32, 64, 128):
        qw, sz = quantize_int4(w, group)
        ms = bench_ms(lambda qw=qw, sz=sz, group=group: int4_matmul_triton(x, qw, sz, group))
        rows.append((f"int4-g{group} triton gemv", ms, qw.numel() + sz.numel() * 2, dequant_ms))
    return rows


def bench_gemv(dev: torch.device, peak: float) -> None:
    copy = copy_gbs(dev)
    print(f"device-to-device copy: {copy:.0f} GB/s ({copy / peak:.0%} of peak)")
    for n, k in ((3072, 576), (49152, 576), (4096, 4096), (11008, 4096), (4096, 11008), (128256, 2048)):
        rows = gemv_rows(n, k, dev)
        dense_ms = rows[0][1]
        for label, ms, weight_bytes, base_ms in rows:
            gbs = (weight_bytes + 2 * (k + n)) / ms / 1e6
            row = {
                "shape": f"{n}x{k}",
                "kernel": label,
                "ms": ms,
                "gbs": gbs,
                "peak_frac": gbs / peak,
                "copy_frac": gbs / copy,
                "vs_dense": dense_ms / ms,
                "vs_dequant_matmul": base_ms / ms,
            }
            results["gemv"].append(row)
            print(
                f"gemv {n:>6}x{k:<6} {label:<22} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s {gbs / peak:6.1%} of peak "
                f"{gbs / copy:6.1%} of copy  {dense_ms / ms:5.2f}x vs bf16  {base_ms / ms:5.2f}x vs dequant+matmul"
            )


def bench_engine(dev: torch.device) -> None:
    from engine.config import KNOWN_MODELS
    from engine.llm_engine import LLMEngine
    from engine.quant import quantize_model, weight_bytes
    from engine.sampling import SamplingParams

    for model in ("smollm2-135m", "llama-3.2-1b"):
        base: float | None = None
        schemes = ["none", "int8", "int4-g64", "int4-g32"] + (["fp8"] if fp8_triton_supported(dev) else [])
        for scheme in schemes:
            config = KNOWN_MODELS[model].with_(max_position_embeddings=2048)
            engine = LLMEngine.from_config(config, dtype="bfloat16", device=str(dev), num_kv_blocks=2048)
            quantize_model(engine.model, scheme)
            greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
            prompt = list(range(100, 164))
            engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate([prompt], greedy)
            torch.cuda.synchronize()
            single = 128 / (time.perf_counter() - start)
            start = time.perf_counter()
            engine.generate([[*prompt, i] for i in range(32)], greedy)
            torch.cuda.synchronize()
            batch = 32 * 128 / (time.perf_counter() - start)
            base = base or single
            row = {
                "model": model,
                "scheme": scheme,
                "weight_mb": weight_bytes(engine.model) / 1e6,
                "decode_tok_s": single,
                "batch32_tok_s": batch,
            }
            results["engine"].append(row)
            print(
                f"engine {model:<13} {scheme:<9} weights {row['weight_mb']:8.1f} MB  single-stream "
                f"{single:7.1f} tok/s ({single / base:.2f}x)  batch-32 {batch:8.1f} tok/s"
            )
            del engine
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peak-gbs", type=float, help="the card's peak memory bandwidth (default: detect)")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev = torch.device("cuda")
    peak, source = peak_gbs(dev, args.peak_gbs)
    print(f"{torch.cuda.get_device_name(dev)}: peak {peak:.0f} GB/s from {source}; torch {torch.__version__}")
    sections: list[tuple[str, Callable[[], None]]] = [
        ("kernels", lambda: check_kernels(dev)),
        ("gemv", lambda: bench_gemv(dev, peak)),
    ]
    if not args.skip_engine:
        sections.append(("engine", lambda: bench_engine(dev)))
    for name, run in sections:  # one section failing must not hide the others' numbers
        try:
            run()
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"ERROR in {name}: {type(exc).__name__}: {exc}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"{len(failures)} failure(s)" + (": " + "; ".join(failures) if failures else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
