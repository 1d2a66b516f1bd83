"""Does TorchInductor (`torch.compile`) speed up CPU decode here? Eager engine paths vs compiled ones at
SmolLM2-135M's shapes (random weights), CPU time per call, min over interleaved rounds.

    .venv/bin/python benchmarks/inductor_probe.py attention --threads 1   # (a) paged decode attention
    .venv/bin/python benchmarks/inductor_probe.py int8 --threads 1        # (b) all linears of a step, int8
    .venv/bin/python benchmarks/inductor_probe.py step --threads 1 --batch 1   # (c) a whole decode step

Run under `nice`; set TORCH_LOGS=recompiles to see recompiles. Findings: docs/engine.md, Performance notes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import KNOWN_MODELS  # noqa: E402
from engine.model import AttentionMetadata, Transformer, _decode_attention, attention_metadata  # noqa: E402

CFG = KNOWN_MODELS["smollm2-135m"]
H, KVH, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim or 0
BS = 16  # the engine's default KV block size


def cpu_ms(fns: dict[str, Callable[[], object]], reps: int, rounds: int = 7) -> dict[str, float]:
    """Min over interleaved rounds of CPU ms per call (CPU time: the machine is shared)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            start = time.process_time()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.process_time() - start) / reps * 1e3)
    return best


def decode_inputs(lens: list[int], num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Block tables (scattered blocks, -1 padded), slots of each sequence's last token, and metadata."""
    width = -(-max(lens) // BS)
    tables = [[(s * 40 + j) % num_blocks for j in range(-(-n // BS))] for s, n in enumerate(lens)]
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([tables[s][p // BS] * BS + p % BS for s, p in enumerate(positions.tolist())])
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=slots,
        num_decodes=len(lens),
        block_tables=padded,
        context_lens=torch.tensor(lens, dtype=torch.int32),
        max_context_len=max(lens),
        prefills=[],
        block_size=BS,
    )
    return padded.clamp(min=0).long(), slots, meta


def paged_attention_plain(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """Gather + matmul + masked softmax + matmul over the padded block width (no data-dependent shapes)."""
    b = q.shape[0]
    flat = block_ids.reshape(-1)
    keys = k_cache.index_select(0, flat).view(b, -1, KVH, D).permute(0, 2, 3, 1)
    values = v_cache.index_select(0, flat).view(b, -1, KVH, D).transpose(1, 2)
    scores = torch.matmul(q.reshape(b, KVH, H // KVH, D), keys) * D**-0.5
    valid = torch.arange(scores.shape[-1]) < lens.view(b, 1, 1, 1)
    p = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1)
    return torch.matmul(p, values).reshape(b, H, D)


def probe_attention() -> None:
    num_blocks = 2048
    k_cache, v_cache = torch.randn(num_blocks, BS, KVH, D), torch.randn(num_blocks, BS, KVH, D)
    compiled = torch.compile(paged_attention_plain, dynamic=True)
    for label, lens in (("1 x 150", [150]), ("1 x 300", [300]), ("32 x 140-171", list(range(140, 172)))):
        ids, _, meta = decode_inputs(lens, num_blocks)
        q, lens_t = torch.randn(len(lens), H, D), torch.tensor(lens)
        start = time.perf_counter()
        err = compiled(q, k_cache, v_cache, ids, lens_t) - _decode_attention(
            q, k_cache, v_cache, meta, D**-0.5
        )
        first = time.perf_counter() - start
        ms = cpu_ms(
            {
                "eager": lambda q=q, meta=meta: _decode_attention(q, k_cache, v_cache, meta, D**-0.5),
                "inductor": lambda q=q, ids=ids, lens_t=lens_t: compiled(q, k_cache, v_cache, ids, lens_t),
            },
            reps=200 if len(lens) == 1 else 20,
        )
        print(f"attention {label}: {_fmt(ms)}; max |diff| {err.abs().max():.1e}; first call {first:.1f} s")


def pack_int8_words(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> float32 bit view [N, K/4]: byte j of word i holds input j*K/4 + i, stored +128. A
    float tensor because Inductor loads int vectors through a stack buffer on AVX2 (store-forward stall)."""
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    return u.view(n, 4, k // 4).transpose(1, 2).contiguous().view(n, k).view(torch.int32).view(torch.float32)


def int8_linear_words(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor
) -> torch.Tensor:
    byte = ((words.view(torch.int32).unsqueeze(-2) >> shifts) & 0xFF) | 0x4B000000  # the float 2^23 + byte
    w = byte.view(torch.float32) - 8388736.0  # minus 2^23 + 128: the int8 value, with no int->float convert
    return (x.view(x.shape[0], 1, 4, -1) * w).sum((-1, -2)) * scales


def probe_int8(rows: int) -> None:
    from engine.quant import quantize_int8
    from weir.kernels.int8_matmul import int8_matmul

    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32).view(4, 1)
    compiled = torch.compile(int8_linear_words, dynamic=False)
    layers = []
    shapes = [(CFG.hidden_size, H * D + 2 * KVH * D), (H * D, CFG.hidden_size)]
    shapes += [(CFG.hidden_size, 2 * CFG.intermediate_size), (CFG.intermediate_size, CFG.hidden_size)]
    for k, n in shapes * CFG.num_layers + [(CFG.hidden_size, CFG.vocab_size)]:
        w = torch.randn(n, k) * 0.05
        q, s = quantize_int8(w)
        layers.append((w.t().contiguous().t(), q, s, pack_int8_words(q)))
    xs = {k: torch.randn(rows, k) for k in (CFG.hidden_size, CFG.intermediate_size)}

    def run(kind: str) -> None:
        for w_col, q, s, words in layers:
            x = xs[w_col.shape[1]]
            if kind == "fp32_column_major":
                F.linear(x, w_col)
            elif kind == "int8pack":
                int8_matmul(x, q, s)
            else:
                compiled(x, words, s, shifts)

    start = time.perf_counter()
    run("inductor_int8")
    print(f"compile + first pass {time.perf_counter() - start:.1f} s")
    ms = cpu_ms(
        {kind: lambda kind=kind: run(kind) for kind in ("fp32_column_major", "int8pack", "inductor_int8")}, 1
    )
    print(f"all {len(layers)} linears of a decode step, {rows} row(s): {_fmt(ms)}")


def decode_step(
    model: Transformer,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_ids: torch.Tensor,
    lens: torch.Tensor,
    caches: list[torch.Tensor],
) -> torch.Tensor:
    """One decode token per sequence, the engine's forward written without data-dependent branches."""
    b = ids.shape[0]
    x = F.embedding(ids, model.embed_tokens.weight)
    cos, sin = model.rotary.cos[positions].unsqueeze(1), model.rotary.sin[positions].unsqueeze(1)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, layer.input_layernorm.eps)
        qkv = F.linear(h, attn.qkv_proj.weight)
        qk = qkv[:, : attn.q_size + attn.kv_size].view(b, H + KVH, D)
        qk = qk * cos + qk.roll(D // 2, -1) * sin
        v = qkv[:, attn.q_size + attn.kv_size :].view(b, KVH, D)
        caches[2 * i].view(-1, KVH, D).index_copy_(0, slots, qk[:, H:])
        caches[2 * i + 1].view(-1, KVH, D).index_copy_(0, slots, v)
        o = paged_attention_plain(qk[:, :H], caches[2 * i], caches[2 * i + 1], block_ids, lens)
        x = x + F.linear(o.reshape(b, H * D), attn.o_proj.weight)
        h = F.rms_norm(
            x, (x.shape[-1],), layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        )
        gate, up = F.linear(h, mlp.gate_up_proj.weight).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
    return F.linear(F.rms_norm(x, (x.shape[-1],), model.norm.weight, model.norm.eps), model.lm_head.weight)


def probe_step(batch: int) -> None:
    from engine.packed import pack_linears

    torch.manual_seed(0)
    with torch.inference_mode(False), torch.no_grad():  # as the engine builds it: DualLinear tracks versions
        model = Transformer(CFG).eval()
        for p in model.parameters():
            p.normal_(0, 0.02)
        pack_linears(model, "auto")  # the engine's fp32 layout (column-major; oneDNN copy where it wins)
    num_blocks = 1024
    model.allocate_kv_cache(num_blocks, BS, torch.float32, torch.device("cpu"))
    caches = [
        t.normal_() for layer in model.layers for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)
    ]
    compiled = torch.compile(decode_step, dynamic=True)
    start = time.perf_counter()
    for ctx in (130, 150, 200):  # the first call compiles; later context lengths must not recompile
        lens = [ctx + j for j in range(batch)]
        block_ids, slots, meta = decode_inputs(lens, num_blocks)
        ids = torch.randint(0, CFG.vocab_size, (batch,))
        args = (ids, meta.positions, slots, block_ids, meta.context_lens, caches)
        out = compiled(model, *args)
        with attention_metadata(meta):
            ref = model.logits(model(ids))
        same = bool((out.argmax(-1) == ref.argmax(-1)).all())
        print(
            f"context {ctx}: {time.perf_counter() - start:.1f} s so far, max |diff| {(out - ref).abs().max():.1e}, "
            f"same argmax {same}"
        )

    def eager() -> None:
        with attention_metadata(meta):
            model.logits(model(ids))

    ms = cpu_ms({"eager": eager, "inductor": lambda: compiled(model, *args)}, reps=10 if batch == 1 else 3)
    print(f"decode step, {batch} sequence(s), context ~200: {_fmt(ms)}")


def _fmt(ms: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()) + f" (load {os.getloadavg()[0]:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("probe", choices=["attention", "int8", "step"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1, help="sequences (step) or rows (int8)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        if args.probe == "attention":
            probe_attention()
        elif args.probe == "int8":
            probe_int8(args.batch)
        else:
            probe_step(args.batch)


if __name__ == "__main__":
    main()
