"""The embedding stack: our plain-PyTorch MiniLM matches sentence-transformers (all six layers) and
transformers (the first three, which the shipped head reads), its int8 and bf16 modes stay close to
float32, and the static table is exactly the encoder's output for each vocabulary entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing.embed import (
    DEFAULT_RECIPE,
    ENCODER_RECIPES,
    STATIC_RECIPE,
    StaticEmbedder,
    load_embedder,
    minilm_dir,
)
from routing.minilm import MiniLMEmbedder, MiniLMEncoder

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


@pytest.mark.slow
def test_first_layers_match_transformers() -> None:
    """The head's encoder (3 layers, 96 tokens) is BERT's hidden state after layer 3, mean-pooled."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    model = AutoModel.from_pretrained(str(minilm_dir())).eval()
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=96, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch, output_hidden_states=True).hidden_states[3]
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)
    ours = MiniLMEncoder(max_tokens=96, num_layers=3).encode(TEXTS, batch_size=2)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)


def test_int8_and_bf16_encoders_stay_close_to_float32() -> None:
    exact = MiniLMEncoder(max_tokens=96, num_layers=3).encode(TEXTS)
    for compute, floor in (("bfloat16", 0.999), ("int8", 0.97)):
        approx = MiniLMEncoder(max_tokens=96, num_layers=3, compute=compute).encode(TEXTS, batch_size=1)
        cosine = (approx * exact).sum(1)
        assert cosine.min() > floor, (compute, cosine)
    with pytest.raises(ValueError, match="compute"):
        MiniLMEncoder(compute="int4")
    with pytest.raises(ValueError, match="num_layers"):
        MiniLMEncoder(num_layers=7)


def test_embedder_pools_what_the_encoder_encodes() -> None:
    """The router tokenises once (up to 512 pieces, for the token bag and the sparse part) and the
    embedder cuts that to its own window, which must equal the encoder tokenising the text itself."""
    embedder = MiniLMEmbedder(DEFAULT_RECIPE, num_layers=3, max_tokens=96, compute="float32")
    encoder = MiniLMEncoder(max_tokens=96, num_layers=3)
    for text in TEXTS:
        np.testing.assert_allclose(embedder.embed(text), encoder.encode_one(text).numpy(), atol=1e-6)
    many = embedder.embed_many(TEXTS)
    assert many.shape == (len(TEXTS), 384) and many.dtype == np.float32
    np.testing.assert_allclose(many[2], embedder.embed(TEXTS[2]), atol=1e-6)


def test_int8_embeddings_do_not_depend_on_the_batch() -> None:
    # Activations are quantized per tensor, so the embedder runs one prompt per pass: training
    # (embed_many) and the request path (embed) see identical vectors.
    embedder = MiniLMEmbedder(DEFAULT_RECIPE, num_layers=3, max_tokens=96, compute="int8")
    many = embedder.embed_many(TEXTS)
    for row, text in enumerate(TEXTS):
        np.testing.assert_array_equal(many[row], embedder.embed(text))


def test_recipes_name_their_embedders() -> None:
    from routing.cli import EMBEDDERS

    assert EMBEDDERS == (DEFAULT_RECIPE, STATIC_RECIPE)  # the CLI's choices, kept in step by hand
    assert set(EMBEDDERS) == {STATIC_RECIPE, *ENCODER_RECIPES}
    assert load_embedder(STATIC_RECIPE).recipe == STATIC_RECIPE
    assert load_embedder(DEFAULT_RECIPE).recipe == DEFAULT_RECIPE
    with pytest.raises(ValueError, match="unknown embedder recipe"):
        load_embedder("minilm-l6-first9-v0")


def test_long_prompts_are_tokenized_by_their_prefix_with_the_same_ids() -> None:
    embedder = load_embedder(DEFAULT_RECIPE)
    prose = ((minilm_dir() / "README.md").read_text() + " The quick brown fox jumps over the lazy dog.") * 4
    texts = [
        prose,  # fills the window well within the prefix
        "word " * 4000,  # 1 character a token after the first: the prefix is enough
        "x" * 20_000,  # no space to cut at: tokenized whole
        "\x1c".join(["word"] * 3000),  # control separators the normalizer deletes: not cut there
        "雨" * 5000,  # CJK characters are split one by one
        "a" * 250 + " " + "é " * 3000,
        "long" + "\n" * 3 + "tab\tseparated " * 500,
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 1000,
        '[{"id":1,"name":"item1","tags":["a","b"]},' * 300,  # minified JSON: no spaces, cut at punctuation
        "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo+/=" * 300,  # base64: its + / = are punctuation
        "foo_bar-baz.qux@example:8080/path?x=1&y=2#frag" * 200,
    ]
    for text in texts:
        assert len(text) > embedder.prefix_chars
        whole = embedder.tokenizer.encode(text).ids
        assert embedder.token_ids(text) == whole[1:-1], text[:40]
    # The prefix path is taken for the prose (cost bounded by the prefix, not the prompt).
    calls: list[int] = []
    real = embedder.tokenizer

    class Counting:
        def encode(self, text: str) -> object:
            calls.append(len(text))
            return real.encode(text)

    embedder.tokenizer = Counting()  # type: ignore[assignment]
    try:
        for text in (prose, texts[8]):  # prose, and minified JSON with no space at all
            calls.clear()
            embedder.token_ids(text)
            assert calls and max(calls) <= embedder.prefix_chars
    finally:
        embedder.tokenizer = real
