"""The embedding stack: our plain-PyTorch MiniLM matches sentence-transformers, and the static table
the router uses is exactly that encoder's output for each vocabulary entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing.embed import StaticEmbedder, minilm_dir
from routing.minilm import MiniLMEncoder

TEXTS = [
    "hi",
    "What is the capital of France?",
    "Statement 1| Every group of order 4 is cyclic. Statement 2| Z_6 is cyclic.\nA. True, True\nB. False, False\nAnswer:",
    "naïve café — 東京 🙂",
    "long " * 400,  # beyond the 256-token window: both sides truncate the same way
]


@pytest.fixture(scope="module")
def encoder() -> MiniLMEncoder:
    return MiniLMEncoder()


@pytest.mark.slow
def test_matches_sentence_transformers(encoder: MiniLMEncoder) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir()), device="cpu")
    expected = reference.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    ours = encoder.encode(TEXTS, batch_size=2).numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_batched_and_single_encodings_agree(encoder: MiniLMEncoder) -> None:
    batched = encoder.encode(TEXTS)
    single = torch.stack([encoder.encode_one(t) for t in TEXTS])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(batched.norm(dim=1), torch.ones(len(TEXTS)))


def test_static_table_is_the_encoder_on_each_token(encoder: MiniLMEncoder) -> None:
    static = StaticEmbedder.from_minilm()
    for word in ("physics", "the", "##ing"):
        token_id = static.tokenizer.token_to_id(word)
        ids = torch.tensor([[101, token_id, 102]])
        full = encoder.forward(ids, torch.ones_like(ids, dtype=torch.bool))[0].numpy()
        np.testing.assert_allclose(static.table[token_id], full, atol=1e-5)


def test_static_embeddings_are_unit_vectors_and_batch_consistent() -> None:
    static = StaticEmbedder.from_minilm()
    many = static.embed_many([*TEXTS, ""])
    np.testing.assert_allclose(np.linalg.norm(many, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(many[1], static.embed(TEXTS[1]), rtol=1e-6)
    # Related questions sit closer than unrelated ones.
    a, b, c = static.embed_many(
        ["How do vaccines train the immune system?", "What do antibodies do?", "Price of a used car"]
    )
    assert a @ b > a @ c
