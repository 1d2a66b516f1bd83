"""A cheaper encoder for the difficulty head: a student distilled from head v4's (issue #5, sixteenth round).

Head v4 reads MiniLM's first three layers mean-pooled over the prompt's first 96 tokens (510 M int8
multiply-adds a prompt), which fits the 5 ms budget only on cores with AVX-512 VNNI. The student keeps
fewer layers, attention heads and feed-forward neurons of MiniLM (`--layers`, `--heads`, `--ffn`;
heads and neurons ranked by mean |output| x the norm of their output weights over the training text),
then is fine-tuned to reproduce the teacher's pooled embedding (cosine loss, float32, label-free).
Honest protocol (`--distil-on folds`, the default): one student per outer hash fold, distilled on the
text of that fold's training prompts only, and the fold's v3-recipe head trained and scored on that
student's int8 embeddings; `--distil-on docs` distils one student on text that is not MMLU (this
repository's docs and tinyshakespeare). Reports APGR cross-fitted, paired against v4 (the teacher's
embeddings) and the static head (v3), the student's held-out cosine to the teacher, the subject
accuracy, multiply-adds per 96-token prompt, and the pass's latency (`--latency-only` times just that,
e.g. under `FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2` to run fbgemm's and ATen's AVX2
kernels on an AVX-512 core).

    nice -n 10 .venv/bin/python benchmarks/routing_student.py --data ../shared/data/routing-mmlu --cache /tmp/enc
    FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/routing_student.py --latency-only
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_stacking import cross_fitted, encode_by_depth, equal_blend, reporter
from routing.difficulty import encode
from routing.embed import StaticEmbedder, minilm_dir
from routing.minilm import BertConfig, Linear, MiniLMEncoder
from routing.train import TrainConfig, load_mmlu, prompt_fold

TEACHER_LAYERS, TOKENS = 3, 96
HEAD_DIM = 32  # MiniLM: 12 heads of 32


def multiply_adds(layers: int, heads: int, ffn: int, tokens: int = TOKENS, d: int = 384) -> tuple[int, int]:
    """(linear layers, attention's two batched matmuls) multiply-adds of one pass over `tokens`."""
    inner = heads * HEAD_DIM
    linear = tokens * (d * 3 * inner + inner * d + 2 * d * ffn)
    return layers * linear, layers * 2 * tokens * tokens * inner


class Int8Linear(nn.Module):
    """An `nn.Linear` frozen into `routing.minilm.Linear`'s int8 form (what head v4 runs)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.impl = Linear(linear.weight.detach(), linear.bias.detach(), True, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x)


class StudentLayer(nn.Module):
    """One BERT layer with `heads` heads of 32 and `ffn` intermediate neurons; from MiniLM's layer `p`."""

    def __init__(self, w: dict[str, torch.Tensor], p: str, eps: float) -> None:
        super().__init__()
        d = w[p + "attention.output.dense.weight"].shape[0]
        self.heads = w[p + "attention.self.query.weight"].shape[0] // HEAD_DIM
        self.qkv = nn.Linear(d, 3 * self.heads * HEAD_DIM)
        self.qkv.weight.data = torch.cat(
            [w[p + f"attention.self.{n}.weight"] for n in ("query", "key", "value")]
        )
        self.qkv.bias.data = torch.cat([w[p + f"attention.self.{n}.bias"] for n in ("query", "key", "value")])
        self.o = self._linear(w, p + "attention.output.dense")
        self.ln1 = self._norm(w, p + "attention.output.LayerNorm", eps)
        self.up = self._linear(w, p + "intermediate.dense")
        self.down = self._linear(w, p + "output.dense")
        self.ln2 = self._norm(w, p + "output.LayerNorm", eps)
        # Sums of |output| per head and per neuron while `collect` is on (for pruning).
        self.collect = False
        self.head_act = torch.zeros(self.heads)
        self.ffn_act = torch.zeros(self.up.out_features)

    @staticmethod
    def _linear(w: dict[str, torch.Tensor], name: str) -> nn.Linear:
        out, inp = w[name + ".weight"].shape
        lin = nn.Linear(inp, out)
        lin.weight.data, lin.bias.data = w[name + ".weight"].clone(), w[name + ".bias"].clone()
        return lin

    @staticmethod
    def _norm(w: dict[str, torch.Tensor], name: str, eps: float) -> nn.LayerNorm:
        ln = nn.LayerNorm(w[name + ".weight"].shape[0], eps=eps)
        ln.weight.data, ln.bias.data = w[name + ".weight"].clone(), w[name + ".bias"].clone()
        return ln

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * HEAD_DIM**-0.5
        a = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1) @ v
        if self.collect:
            self.head_act += (a.abs() * mask[:, None, :, None]).sum((0, 2, 3)).detach()
        x = self.ln1(self.o(a.transpose(1, 2).reshape(b, n, -1)) + x)
        g = F.gelu(self.up(x))
        if self.collect:
            self.ffn_act += (g.abs() * mask[..., None]).sum((0, 1)).detach()
        return self.ln2(self.down(g) + x)

    def prune(self, heads: int, ffn: int) -> None:
        """Keep the `heads` heads and `ffn` neurons whose mean |output| x output-weight norm is largest."""
        o_norm = self.o.weight.detach().view(self.o.out_features, self.heads, HEAD_DIM).norm(dim=(0, 2))
        keep_h = (self.head_act * o_norm).topk(heads).indices.sort().values
        cols = (keep_h[:, None] * HEAD_DIM + torch.arange(HEAD_DIM)).flatten()
        inner = self.heads * HEAD_DIM
        rows = torch.cat([cols + j * inner for j in range(3)])
        self.qkv = _select(self.qkv, rows=rows)
        self.o = _select(self.o, cols=cols)
        self.heads = heads
        keep_f = (self.ffn_act * self.down.weight.detach().norm(dim=0)).topk(ffn).indices.sort().values
        self.up = _select(self.up, rows=keep_f)
        self.down = _select(self.down, cols=keep_f)


def _select(lin: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    weight, bias = lin.weight.detach(), lin.bias.detach()
    if rows is not None:
        weight, bias = weight[rows], bias[rows]
    if cols is not None:
        weight = weight[:, cols]
    out = nn.Linear(weight.shape[1], weight.shape[0])
    out.weight.data, out.bias.data = weight.clone(), bias.clone()
    return out


class Student(nn.Module):
    """MiniLM's embeddings (frozen) and its first `layers` layers, mean-pooled, unit length."""

    def __init__(self, layers: int, model_dir: Path | None = None) -> None:
        super().__init__()
        model_dir = model_dir or minilm_dir()
        cfg = BertConfig.from_dir(model_dir)
        w = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        self.word = nn.Embedding.from_pretrained(w["embeddings.word_embeddings.weight"])
        self.register_buffer(
            "pos",
            w["embeddings.position_embeddings.weight"] + w["embeddings.token_type_embeddings.weight"][0],
        )
        self.ln = StudentLayer._norm(w, "embeddings.LayerNorm", cfg.layer_norm_eps)
        self.ln.requires_grad_(False)
        self.layers = nn.ModuleList(
            StudentLayer(w, f"encoder.layer.{i}.", cfg.layer_norm_eps) for i in range(layers)
        )

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.word(ids) + self.pos[: ids.shape[1]])
        for layer in self.layers:
            x = layer(x, mask)
        m = mask[..., None].float()
        return F.normalize((x * m).sum(1) / m.sum(1), dim=-1)

    def minilm_weights(self) -> dict[str, torch.Tensor]:
        """The layers under MiniLM's own names (Q, K and V apart), pruned shapes and all: what
        `routing.minilm.MiniLMEncoder(layers_file=...)` reads in place of MiniLM's layers."""
        out = {}
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            for name, w, b in zip(
                ("query", "key", "value"), layer.qkv.weight.chunk(3), layer.qkv.bias.chunk(3), strict=True
            ):
                out[p + f"attention.self.{name}.weight"], out[p + f"attention.self.{name}.bias"] = w, b
            for module, name in (
                (layer.o, "attention.output.dense"),
                (layer.ln1, "attention.output.LayerNorm"),
                (layer.up, "intermediate.dense"),
                (layer.down, "output.dense"),
                (layer.ln2, "output.LayerNorm"),
            ):
                out[p + name + ".weight"], out[p + name + ".bias"] = module.weight, module.bias
        return {k: v.detach().float().contiguous() for k, v in out.items()}

    def quantize(self) -> None:
        """Swap every linear layer for its int8 form (inference only from here on)."""
        for layer in self.layers:
            for name in ("qkv", "o", "up", "down"):
                setattr(layer, name, Int8Linear(getattr(layer, name)))


def batches(tok: MiniLMEncoder, texts: list[str], size: int, shuffle: bool, seed: int = 0):
    """(ids, mask, positions) batches of similar length, in random order when `shuffle`."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    if shuffle:
        random.Random(seed).shuffle(chunks)
    for idx in chunks:
        ids, mask = tok.tokenize([texts[i] for i in idx])
        yield ids, mask, idx


def build_student(
    tok: MiniLMEncoder, texts: list[str], layers: int, heads: int, ffn: int, rank_on: int = 2000
) -> Student:
    """MiniLM's first `layers` layers pruned to `heads` heads and `ffn` neurons, ranked on `texts`."""
    student = Student(layers)
    sample = random.Random(0).sample(texts, min(rank_on, len(texts)))
    for layer in student.layers:
        layer.collect = True
    with torch.no_grad():
        for ids, mask, _ in batches(tok, sample, 32, shuffle=False):
            student(ids, mask)
    for layer in student.layers:
        layer.collect = False
        layer.prune(heads, ffn)
    return student


def distil(
    student: Student,
    tok: MiniLMEncoder,
    texts: list[str],
    target: torch.Tensor,
    epochs: int,
    lr: float,
    subjects: torch.Tensor | None = None,
    subject_weight: float = 0.0,
    outcomes: torch.Tensor | None = None,
    outcome_weight: float = 0.0,
) -> None:
    """Fine-tune `student` so its pooled embedding of each text has cosine 1 to `target`'s row.

    With `subject_weight`, a linear probe on the pooled embedding learns each text's subject
    (`subjects`, class indices) alongside, and its cross-entropy joins the loss at that weight: what the
    sixteenth round's students lost against the teacher was subject naming, not cosine. With
    `outcome_weight`, a second probe learns whether the weak and the strong model answered each text
    right (`outcomes`, (texts, 2) of 0/1), by binary cross-entropy at that weight.
    Matmuls in bf16 (autocast; AMX or AVX-512 BF16 where the CPU has them, 2x fp32 here), weights and
    optimizer state in float32."""
    params = [p for p in student.parameters() if p.requires_grad]
    probe = None
    if subject_weight > 0 and subjects is not None:
        probe = nn.Linear(target.shape[1], int(subjects.max()) + 1)
        # Unit-length embeddings: the probe's logits need a scale of their own to become confident.
        scale = nn.Parameter(torch.tensor(20.0))
        params += [*probe.parameters(), scale]
    outcome_probe = None
    if outcome_weight > 0 and outcomes is not None:
        outcome_probe = nn.Linear(target.shape[1], 2)
        outcome_scale = nn.Parameter(torch.tensor(5.0))
        params += [*outcome_probe.parameters(), outcome_scale]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    steps = epochs * -(-len(texts) // 32)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    student.train()
    for epoch in range(epochs):
        t0, total = time.perf_counter(), 0.0
        for ids, mask, idx in batches(tok, texts, 32, shuffle=True, seed=epoch):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pooled = student(ids, mask)
            loss = (1 - F.cosine_similarity(pooled.float(), target[idx])).mean()
            if probe is not None and subjects is not None:
                logits = probe(pooled.float()) * scale
                loss = loss + subject_weight * F.cross_entropy(logits, subjects[idx])
            if outcome_probe is not None and outcomes is not None:
                logits = outcome_probe(pooled.float()) * outcome_scale
                loss = loss + outcome_weight * F.binary_cross_entropy_with_logits(logits, outcomes[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        print(
            f"    epoch {epoch + 1}: mean 1 - cosine {total / len(texts):.4f}, {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    student.eval()


@torch.inference_mode()
def encode_one_by_one(student: Student, tok: MiniLMEncoder, texts: list[str]) -> np.ndarray:
    """Every text on its own (int8 activations are quantized per tensor, as the router runs it)."""
    out = np.zeros((len(texts), 384), dtype=np.float32)
    for i, text in enumerate(texts):
        ids = torch.tensor([tok.tokenizer.encode(text).ids])
        out[i] = student(ids, torch.ones_like(ids, dtype=torch.bool))[0].numpy()
    return out


def teacher_embeddings(prompts: list[str], cache: Path | None) -> np.ndarray:
    """(3, prompts, 384): the pooled embedding after each of head v4's layers (96 tokens, int8, one
    prompt a pass); the last is v4's. The file is routing_stacking's `--depth-only` cache."""
    path = cache / f"minilm-depth-{TOKENS}-int8.npy" if cache else None
    if path and path.exists():
        by_depth = np.load(path)
        if len(by_depth) >= TEACHER_LAYERS:
            return by_depth
    t0 = time.perf_counter()
    model = MiniLMEncoder(max_tokens=TOKENS, num_layers=TEACHER_LAYERS, compute="int8")
    by_depth = encode_by_depth(model, prompts, batch_size=1)
    print(f"teacher: {len(prompts)} prompts encoded in {time.perf_counter() - t0:.0f} s", flush=True)
    if path:
        np.save(path, by_depth)
    return by_depth


def non_mmlu_text(chars: int = 600) -> list[str]:
    """Label-free text that is not MMLU: this repository's docs and tinyshakespeare, in chunks."""
    root = Path(__file__).resolve().parents[1]
    sources = [p.read_text() for p in sorted((root / "docs").glob("*.md"))]
    shakespeare = root.parent / "shared/data/text/tinyshakespeare.txt"
    if not shakespeare.exists():
        shakespeare = Path("/work/shared/data/text/tinyshakespeare.txt")
    if shakespeare.exists():
        sources.append(shakespeare.read_text())
    return [s[i : i + chars] for s in sources for i in range(0, len(s) - chars // 2, chars)]


def latency(students: dict[str, Student], threads: tuple[int, ...] = (1, 2), passes: int = 300) -> None:
    """p50 / p99 of one 96-token pass, int8, for the teacher and each student, on 1 and 2 threads.

    The models take turns pass by pass, so a machine whose speed drifts (a shared VM) slows them alike
    and their ratio holds."""
    teacher = MiniLMEncoder(max_tokens=TOKENS, num_layers=TEACHER_LAYERS, compute="int8")
    ids = torch.randint(1000, 20000, (1, TOKENS))
    mask = torch.ones_like(ids, dtype=torch.bool)
    models = {"teacher (v4 encoder)": teacher.forward, **students}
    print(
        f"\nlatency, one {TOKENS}-token pass (torch capability {torch.backends.cpu.get_cpu_capability()},"
        f" FBGEMM_ENABLE_INSTRUCTIONS={os.environ.get('FBGEMM_ENABLE_INSTRUCTIONS', 'unset')},"
        f" load average {os.getloadavg()[0]:.1f})"
    )
    for n in threads:
        torch.set_num_threads(n)
        # Wall clock, and the calling thread's CPU time (all of a pass's work on one thread; on a
        # shared machine it leaves out the waits for a core).
        wall: dict[str, list[float]] = {name: [] for name in models}
        cpu: dict[str, list[float]] = {name: [] for name in models}
        with torch.inference_mode():
            for i in range(passes + 20):
                for name, fn in models.items():
                    t0, c0 = time.perf_counter(), time.thread_time()
                    fn(ids, mask)
                    if i >= 20:
                        wall[name].append(time.perf_counter() - t0)
                        cpu[name].append(time.thread_time() - c0)
        for name in models:
            p50, p99 = np.percentile(wall[name], [50, 99]) * 1000
            c50, c99 = np.percentile(cpu[name], [50, 99]) * 1000
            print(
                f"  {n} thread(s)  {name:<40} wall p50 {p50:6.2f} ms  p99 {p99:6.2f} ms"
                f"  (CPU time of the calling thread p50 {c50:6.2f} ms  p99 {c99:6.2f} ms)",
                flush=True,
            )


def cached(cache: Path | None, name: str, compute):
    """`compute()`'s dict of arrays, kept in `cache` as `name`.npz between runs."""
    path = cache / f"{name}.npz" if cache else None
    if path and path.exists():
        return dict(np.load(path))
    out = compute()
    if path:
        np.savez(path, **out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/routing-mmlu"
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=6, help="attention heads kept per layer (of 12)")
    ap.add_argument("--ffn", type=int, default=384, help="feed-forward neurons kept per layer (of 1,536)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--distil-on", choices=("folds", "docs"), default="folds")
    ap.add_argument(
        "--distil-prompts", type=int, default=4000, help="texts a student is distilled on (a random subset)"
    )
    ap.add_argument(
        "--subject-weight",
        type=float,
        default=0.0,
        help="weight of a subject-probe cross-entropy beside the cosine loss (the fold's training labels)",
    )
    ap.add_argument(
        "--outcome-weight",
        type=float,
        default=0.0,
        help="weight of a probe's binary cross-entropy on the weak and strong outcomes (training rows)",
    )
    ap.add_argument(
        "--folds",
        help="distil students for these outer folds only (e.g. 0); the others read the teacher's"
        " embeddings, so the paired difference against v4 comes from these folds' prompts alone",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument(
        "--cache", type=Path, help="teacher embeddings, cross-fitted scores and students kept here"
    )
    ap.add_argument(
        "--export",
        type=Path,
        help="distil one student on every prompt (no cross-fitting) and write its layers to this"
        " safetensors file (routing/data/student-3l4h384f-v1.safetensors is the shipped one)",
    )
    ap.add_argument("--latency-only", action="store_true", help="only time the passes (untrained weights)")
    ap.add_argument("--latency-threads", default="1,2", help="torch threads to time a pass on")
    ap.add_argument("--passes", type=int, default=300, help="passes timed per model and thread count")
    args = ap.parse_args()
    lat_threads = tuple(int(v) for v in args.latency_threads.split(","))

    torch.manual_seed(0)
    tok = MiniLMEncoder(max_tokens=TOKENS, num_layers=1)  # its tokenizer truncates as v4's does
    linear, attention = multiply_adds(args.layers, args.heads, args.ffn)
    teacher_linear, teacher_attention = multiply_adds(TEACHER_LAYERS, 12, 1536)
    name = f"student {args.layers} layers, {args.heads} heads, FFN {args.ffn}"
    tag = (
        f"student-{args.layers}l{args.heads}h{args.ffn}f-{args.distil_on}{args.distil_prompts}-e{args.epochs}"
        + (f"-subj{args.subject_weight:g}" if args.subject_weight else "")
        + (f"-out{args.outcome_weight:g}" if args.outcome_weight else "")
        + (f"-folds{args.folds.replace(',', '')}" if args.folds else "")
    )
    print(
        f"{name}: {linear / 1e6:.0f} M linear + {attention / 1e6:.1f} M attention multiply-adds a {TOKENS}-token"
        f" prompt ({linear / teacher_linear:.2f} of the teacher's {teacher_linear / 1e6:.0f} M"
        f" + {teacher_attention / 1e6:.1f} M)",
        flush=True,
    )
    if args.latency_only:
        student = build_student(tok, non_mmlu_text()[:64], args.layers, args.heads, args.ffn, rank_on=64)
        student.quantize()
        latency({name: student}, lat_threads, args.passes)
        return

    torch.set_num_threads(args.threads)
    data = load_mmlu(args.data)
    enc = encode(StaticEmbedder.from_minilm(), data.prompts)
    fold = np.array([prompt_fold(p, 5) for p in data.prompts])
    report = reporter(data, args.bootstrap)
    cfg = TrainConfig(calibration_folds=0)
    groups = sorted(set(data.groups or []))
    truth = np.array([groups.index(g) for g in data.groups or []])

    def head_on(key: str, emb: np.ndarray | None = None, by_fold: dict[int, np.ndarray] | None = None):
        """The v3 recipe's cross-fitted ranking on these embeddings, and its subject accuracy."""

        def run() -> dict[str, np.ndarray]:
            t0 = time.perf_counter()
            e = enc if emb is None else dataclasses.replace(enc, static=emb)
            out = cross_fitted(data, e, fold, cfg, static_by_fold=by_fold)
            print(f"  ({key}: heads cross-fitted in {time.perf_counter() - t0:.0f} s)", flush=True)
            return out

        out = cached(args.cache, f"crossfit-{key}", run)
        return equal_blend(out["components"], fold), (out["posterior"].argmax(1) == truth).mean()

    by_depth = teacher_embeddings(data.prompts, args.cache)
    teacher = by_depth[TEACHER_LAYERS - 1]
    labels = torch.tensor(truth)
    answered = torch.tensor(np.stack([data.weak, data.strong], 1), dtype=torch.float32)

    def trained(
        texts: list[str],
        target: torch.Tensor,
        subjects: torch.Tensor | None = None,
        outcomes: torch.Tensor | None = None,
    ) -> Student:
        """A student pruned and distilled on `texts` as the flags say (float, not yet int8)."""
        student = build_student(tok, texts, args.layers, args.heads, args.ffn)
        distil(
            student,
            tok,
            texts,
            target,
            args.epochs,
            args.lr,
            subjects,
            args.subject_weight,
            outcomes,
            args.outcome_weight,
        )
        return student

    if args.export:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        student = trained(data.prompts, torch.tensor(teacher), labels, answered)
        how = {
            "layers": args.layers,
            "heads": args.heads,
            "ffn": args.ffn,
            "epochs": args.epochs,
            "lr": args.lr,
            "subject_weight": args.subject_weight,
            "outcome_weight": args.outcome_weight,
            "distilled_on": f"{len(data)} MMLU prompts (all of them)",
            "teacher": f"MiniLM's first {TEACHER_LAYERS} layers over {TOKENS} tokens, int8",
        }
        save_file(student.minilm_weights(), str(args.export), metadata={k: str(v) for k, v in how.items()})
        print(f"wrote {args.export} ({tag}) in {time.perf_counter() - t0:.0f} s", flush=True)
        return
    static, right = head_on("static")
    report(f"v3 recipe, static table (subject right {right:.3f})", static, None)
    v4, right = head_on("v4", teacher)
    report(f"v4: teacher, 3 layers, 96 tokens, int8 (subject right {right:.3f})", v4, static, "static")
    one, right = head_on("first-layer-96", by_depth[0])
    report(f"MiniLM's first layer, 96 tokens, int8 (subject right {right:.3f})", one, v4, "v4")
    report("MiniLM's first layer, 96 tokens, int8", one, static, "static")

    rng = np.random.default_rng(0)
    student = None

    def distilled(
        texts: list[str],
        target: torch.Tensor,
        subjects: torch.Tensor | None = None,
        outcomes: torch.Tensor | None = None,
    ) -> np.ndarray:
        nonlocal student
        t0 = time.perf_counter()
        keep = rng.permutation(len(texts))[: args.distil_prompts]
        texts, target = [texts[i] for i in keep], target[keep]
        subjects = subjects[keep] if subjects is not None else None
        outcomes = outcomes[keep] if outcomes is not None else None
        print(f"  distilling on {len(texts)} texts", flush=True)
        student = trained(texts, target, subjects, outcomes)
        student.quantize()
        emb = encode_one_by_one(student, tok, data.prompts)
        print(f"  student done in {time.perf_counter() - t0:.0f} s", flush=True)
        return emb

    def students() -> dict[str, np.ndarray]:
        target = torch.tensor(teacher)
        if args.distil_on == "docs":
            texts = non_mmlu_text()
            t_enc = MiniLMEncoder(max_tokens=TOKENS, num_layers=TEACHER_LAYERS, compute="int8")
            doc_target = torch.tensor(encode_by_depth(t_enc, texts, batch_size=1)[-1])
            emb = distilled(texts, doc_target)
            return {str(k): emb for k in np.unique(fold)}
        out = {}
        only = {int(v) for v in args.folds.split(",")} if args.folds else None
        for k in np.unique(fold):
            if only is not None and int(k) not in only:
                out[str(k)] = teacher
                continue
            train = np.nonzero(fold != k)[0]
            print(f"fold {k}: a student from its training prompts' text", flush=True)
            out[str(k)] = distilled(
                [data.prompts[i] for i in train], target[train], labels[train], answered[train]
            )
        return out

    by_fold = {int(k): v for k, v in cached(args.cache, tag, students).items()}
    cos = {"held-out": [], "training": []}
    for k, emb in by_fold.items():
        if np.array_equal(emb, teacher):
            continue  # a fold left to the teacher (`--folds`)
        for part, rows in (("held-out", fold == k), ("training", fold != k)):
            cos[part].append((emb[rows] * teacher[rows]).sum(1))
    score, right = head_on(tag, by_fold=by_fold)
    report(f"{name} (subject right {right:.3f})", score, v4, "v4")
    report(name, score, static, "static")
    held = np.concatenate(cos["held-out"])
    print(
        f"  student's cosine to the teacher: fold-held-out prompts mean {held.mean():.3f} (p1"
        f" {np.percentile(held, 1):.3f}), its training folds' prompts {np.concatenate(cos['training']).mean():.3f};"
        f" MiniLM's first layer: {(by_depth[0] * teacher).sum(1).mean():.3f}",
        flush=True,
    )
    if student is not None:
        latency({name: student}, lat_threads, args.passes)


if __name__ == "__main__":
    main()
