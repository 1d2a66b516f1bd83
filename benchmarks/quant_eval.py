"""Quality of quantization on SmolLM2-135M: perplexity, greedy agreement, weight memory.

For each scheme (fp32, int8, int4 at group 32/64/128) the model is loaded through the engine, quantized
with ``engine.quant.quantize_model`` and then:
- scores the fixed English text in ``benchmarks/data/`` (Shakespeare + MMLU question text, ~27k tokens)
  in non-overlapping windows: perplexity = exp(mean negative log-likelihood of every token after the
  first of its window);
- generates greedily for the chat prompts below and compares with fp32 token by token;
- reports weight memory and single-stream decode tok/s (same run, same machine: compare ratios only).

    .venv/bin/python benchmarks/quant_eval.py [--model smollm2-135m] [--window 1024] [--schemes ...]
    .venv/bin/python benchmarks/quant_eval.py --report fp32_int8.json int4.json   # one table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from engine.llm_engine import LLMEngine
from engine.model import AttentionMetadata, PrefillChunk, attention_metadata
from engine.quant import QuantScheme, quantize_model, weight_bytes
from engine.sampling import SamplingParams

DATA = Path(__file__).parent / "data"
TEXTS = {"shakespeare": DATA / "shakespeare.txt", "mmlu": DATA / "mmlu_questions.txt"}
SCHEMES = ["none", "int8", "int4-g32", "int4-g64", "int4-g128", "fp8"]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "What is 17 times 3?",
    "Give me a tip for staying focused while studying.",
    "Translate 'good morning' into Spanish.",
]


@torch.inference_mode()
def window_nll(model: torch.nn.Module, ids: list[int], block_size: int = 16) -> tuple[float, int]:
    """Sum of -log p(token | preceding tokens of the window) in one prefill, and how many were scored."""
    n = len(ids)
    blocks = -(-n // block_size)
    if (
        getattr(model.layers[0].self_attn, "k_cache", None) is None
        or model.layers[0].self_attn.k_cache.shape[0] < blocks
    ):
        param = model.embed_tokens.weight
        model.allocate_kv_cache(blocks, block_size, param.dtype, param.device)
    meta = AttentionMetadata(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        num_decodes=0,
        block_tables=None,
        context_lens=None,
        max_context_len=n,
        prefills=[
            PrefillChunk(
                start=0, length=n, context_len=n, block_table=torch.arange(blocks, dtype=torch.int32)
            )
        ],
        block_size=block_size,
    )
    tokens = torch.tensor(ids)
    with attention_metadata(meta):
        hidden = model(tokens)
    logprobs = model.logits(hidden[:-1]).log_softmax(-1)
    return -logprobs.gather(1, tokens[1:, None]).sum().item(), n - 1


def perplexities(model: torch.nn.Module, windows: dict[str, list[list[int]]]) -> dict[str, float]:
    out, total_nll, total_n = {}, 0.0, 0
    for name, chunks in windows.items():
        nll = n = 0
        for ids in chunks:
            a, b = window_nll(model, ids)
            nll, n = nll + a, n + b
        out[name] = math.exp(nll / n)
        total_nll, total_n = total_nll + nll, total_n + n
    out["all"] = math.exp(total_nll / total_n)
    out["tokens"] = total_n
    return out


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def agreement(outs: list[list[int]], refs: list[list[int]]) -> tuple[float, float]:
    """(share of sequences identical to fp32, mean share of tokens before the first divergence)."""
    exact, prefix = 0, 0.0
    for out, ref in zip(outs, refs, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(out, ref, strict=True)) if a != b), len(ref))
        exact += same == len(ref)
        prefix += same / len(ref)
    return exact / len(refs), prefix / len(refs)


def decode_tok_s(engine: LLMEngine, prompt: list[int], tokens: int) -> float:
    greedy(engine, [prompt], 4)  # warm up
    start = time.perf_counter()
    greedy(engine, [prompt], tokens)
    return tokens / (time.perf_counter() - start)


def report(paths: list[Path]) -> str:
    """A markdown table of ``--json`` files' rows, the first row (fp32) the baseline: schemes measured
    in separate processes (e.g. one for fp32 + int8, one for int4) get their greedy agreement with the
    baseline's tokens recomputed here."""
    rows = [row for path in paths for row in json.loads(path.read_text())]
    base = rows[0]
    lines = [
        "| scheme | ppl all | vs fp32 | Shakespeare | MMLU | greedy exact | greedy prefix | weights MB "
        "| linear layers MB | quantize s | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        exact, prefix = agreement(row["greedy_tokens"], base["greedy_tokens"])
        vs = "-" if row is base else f"{row['ppl_all'] / base['ppl_all'] - 1:+.2%}"
        lines.append(
            f"| {row['scheme']} | {row['ppl_all']:.3f} | {vs} | {row['ppl_shakespeare']:.3f} "
            f"| {row['ppl_mmlu']:.3f} | {exact:.0%} | {prefix:.0%} | {row['weight_mb']:.1f} "
            f"| {row['linear_mb']:.1f} | {row['quantize_s']:.0f} | {row['load_average'][0]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--schemes", nargs="+", default=SCHEMES)
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument(
        "--max-text-tokens", type=int, default=0, help="cap per text (0: all); for smoke runs"
    )
    parser.add_argument("--head", default="int8", help="output-layer scheme under int4 ('same': int4 too)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--reference",
        type=Path,
        help="a previous --json whose first row (fp32) is the baseline: its greedy tokens and ppl are reused",
    )
    parser.add_argument(
        "--report", type=Path, nargs="+", help="print a markdown table of these --json files and exit"
    )
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return

    results: list[dict[str, object]] = []
    reference: list[list[int]] | None = None
    if args.reference:
        # the baseline row from an earlier run (same text, window and prompts), so that schemes can be
        # measured in separate processes without scoring fp32 again
        base_row = json.loads(args.reference.read_text())[0]
        results.append(base_row)
        reference = base_row["greedy_tokens"]
    for spec in args.schemes:
        scheme = QuantScheme.parse(spec)
        engine = LLMEngine(args.model, num_kv_blocks=4 * args.window // 16 + 64, max_num_batched_tokens=512)
        tok = engine.tokenizer
        windows = {}
        for name, path in TEXTS.items():
            ids = tok.encode(path.read_text())
            ids = ids[: args.max_text_tokens] if args.max_text_tokens else ids
            windows[name] = [ids[i : i + args.window] for i in range(0, len(ids) - 1, args.window)]
        prompts = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in CHAT_PROMPTS
        ]
        linears = [n for n, m in engine.model.named_modules() if isinstance(m, torch.nn.Linear)]
        start = time.perf_counter()
        quantize_model(engine.model, scheme, head=None if args.head == "same" else args.head)
        quantize_s = time.perf_counter() - start
        start = time.perf_counter()
        ppl = perplexities(engine.model, windows)
        score_s = time.perf_counter() - start
        outs = greedy(engine, prompts, args.gen_tokens)
        reference = outs if reference is None else reference
        exact, prefix = agreement(outs, reference)
        row = {
            "scheme": str(scheme) + (f"+head-{args.head}" if scheme.method == "int4" else ""),
            "ppl_shakespeare": ppl["shakespeare"],
            "ppl_mmlu": ppl["mmlu"],
            "ppl_all": ppl["all"],
            "tokens_scored": ppl["tokens"],
            "greedy_exact": exact,
            "greedy_prefix": prefix,
            "weight_mb": weight_bytes(engine.model) / 1e6,
            "linear_mb": sum(weight_bytes(engine.model.get_submodule(n)) for n in linears) / 1e6,
            "decode_tok_s": decode_tok_s(engine, prompts[0], args.gen_tokens),
            "quantize_s": quantize_s,
            "score_s": score_s,
            "greedy_tokens": outs,
            "load_average": list(os.getloadavg()),
        }
        results.append(row)
        base = results[0]
        print(
            f"{row['scheme']:>19}  ppl {row['ppl_all']:.3f} ({row['ppl_all'] / base['ppl_all'] - 1:+.2%} vs {base['scheme']})"
            f"  shakespeare {row['ppl_shakespeare']:.3f}  mmlu {row['ppl_mmlu']:.3f}"
            f"  greedy exact {exact:.0%} prefix {prefix:.0%}"
            f"  weights {row['weight_mb']:.1f} MB (linear {row['linear_mb']:.1f})  decode {row['decode_tok_s']:.1f} tok/s"
            f" ({row['decode_tok_s'] / base['decode_tok_s']:.2f}x)  [{row['tokens_scored']} tokens, {score_s:.0f}s]",
            flush=True,
        )
        del engine
        if args.json:  # after every row: a long run that dies keeps what it measured
            args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
