"""The embedding stack: our plain-PyTorch MiniLM matches sentence-transformers (all six layers) and
transformers (the first three, which the shipped head reads), its int8 and bf16 modes stay close to
float32, and the static table is exactly the encoder's output for each vocabulary entry."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from routing.difficulty import DifficultyClassifier, encode
from routing.embed import (
    DEFAULT_RECIPE,
    ENCODER_RECIPES,
    STATIC_RECIPE,
    StaticEmbedder,
    load_embedder,
    minilm_dir,
)
from routing.minilm import Linear, MiniLMEmbedder, MiniLMEncoder
from tests.routing.mmlu import fixture_prompts

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

    assert EMBEDDERS[0] == DEFAULT_RECIPE and EMBEDDERS[-1] == STATIC_RECIPE  # kept in step by hand
    assert set(EMBEDDERS) == {STATIC_RECIPE, *ENCODER_RECIPES}
    assert load_embedder(STATIC_RECIPE).recipe == STATIC_RECIPE
    assert load_embedder(DEFAULT_RECIPE).recipe == DEFAULT_RECIPE
    with pytest.raises(ValueError, match="unknown embedder recipe"):
        load_embedder("minilm-l6-first9-v0")


def test_long_prompts_are_tokenized_by_their_prefix_with_the_same_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
    real = embedder._encode

    def counting(text: str) -> list[int]:
        calls.append(len(text))
        return real(text)

    monkeypatch.setattr(embedder, "_encode", counting)
    for text in (prose, texts[8]):  # prose, and minified JSON with no space at all
        calls.clear()
        embedder.token_ids(text)
        assert calls and max(calls) <= embedder.prefix_chars


def test_ascii_prompts_skip_the_normalizer_with_the_same_ids(fixture_dir: Path) -> None:
    """ASCII text is tokenized with a plain lower-casing normalizer instead of BERT's (a quarter of
    the tokenizer's time): the ids must be the tokenizer's own, control characters, case, tabs, line
    breaks and special tokens included, for prompts short and long, and for the static embedder."""
    rng = np.random.default_rng(0)
    ascii_chars = [chr(c) for c in range(128)]
    # Mostly letters, spaces and punctuation, with every control character in the draw.
    weights = np.array([8.0 if c.isalnum() else 4.0 if c in " .,?!-'\n\t" else 1.0 for c in ascii_chars])
    random_texts = [
        "".join(rng.choice(ascii_chars, size=int(rng.integers(1, 400)), p=weights / weights.sum()))
        for _ in range(300)
    ]
    texts = [
        *ascii_chars,
        *(f"Word{c}NEXT word" for c in ascii_chars),
        "",
        "   ",
        "\x1c",
        "Tab\tseparated\r\nCRLF lines\vand\fform feeds",
        "UPPER lower MiXeD 3.14 e=mc^2 [MASK] [mask] [CLS]x[SEP] [UNK] ##ing",
        *TEXTS,
        *fixture_prompts(fixture_dir, "conceptual_physics"),
        *random_texts,
        "Long PROMPT, repeated; " * 400,  # beyond the prefix: the prefix path, through the shortcut
    ]
    for embedder in (load_embedder(DEFAULT_RECIPE), StaticEmbedder.from_minilm()):
        assert embedder._ascii_tokenizer is not None  # MiniLM's normalizer is BERT's: the shortcut is on
        for text in texts:
            whole = embedder.tokenizer.encode(text).ids
            assert embedder.token_ids(text) == (whole[1:-1] if len(whole) > 2 else whole), repr(text[:60])


def _reference_embedding(encoder: MiniLMEncoder, ids: torch.Tensor) -> torch.Tensor:
    """BERT's layers as the head was fitted on them, written plainly: (batch, tokens, hidden)
    activations, separate Q, K and V, an all-true attention mask, masked mean pooling after the last
    layer. Same weights and int8 kernels as `encoder`; only the bookkeeping around them differs."""
    w, cfg = encoder.w, encoder.config
    d, eps = cfg.hidden_size, cfg.layer_norm_eps
    head_size = d // cfg.num_heads
    b, n = ids.shape
    mask = torch.ones(b, n, dtype=torch.bool)

    def linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer(x.reshape(b * n, -1)).view(b, n, -1)

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(b, n, -1, head_size).transpose(1, 2)

    with torch.inference_mode():
        x = F.embedding(ids, w["embeddings.word_embeddings.weight"]) + encoder.pos_plus_type[:n]
        x = F.layer_norm(x, (d,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        for h, qkv_proj, o_proj, ln1_w, ln1_b, up, down, ln2_w, ln2_b in encoder.layers:
            q, k, v = (heads(t) for t in linear(qkv_proj, x).split(h * head_size, dim=-1))
            scores = (q @ k.transpose(-1, -2)).masked_fill(~mask[:, None, None, :], float("-inf"))
            a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, h * head_size)
            x = F.layer_norm(linear(o_proj, a) + x, (d,), ln1_w, ln1_b, eps)
            x = F.layer_norm(linear(down, F.gelu(linear(up, x))) + x, (d,), ln2_w, ln2_b, eps)
        m = mask.unsqueeze(-1).float()
        return F.normalize((x * m).sum(1) / m.sum(1), dim=1)


def test_request_path_scores_what_the_head_was_fitted_on(
    classifier: DifficultyClassifier, fixture_dir: Path
) -> None:
    """The request path's encoder pass is trimmed for speed (one row per token, no mask, pooled once),
    never its arithmetic: int8 activations are quantized per tensor, so a last-bit difference in
    float (another attention kernel, another summation order) moves some scores by up to 1e-3 (seen
    with scaled_dot_product_attention), and the head was fitted on these numbers."""
    embedder = classifier.embedder
    assert isinstance(embedder, MiniLMEmbedder)
    subjects = ("conceptual_physics", "world_religions")
    prompts = [*TEXTS, *(p for s in subjects for p in fixture_prompts(fixture_dir, s)[:60])]
    ids = [embedder.token_ids(p) for p in prompts]
    reference = np.stack(
        [
            _reference_embedding(embedder.encoder, torch.tensor([embedder._sequence(i)]))[0].numpy()
            for i in ids
        ]
    )
    enc = encode(embedder, prompts)
    expected = classifier.head.p_strong(dataclasses.replace(enc, static=reference))
    scores = np.array([classifier.score(p) for p in prompts])
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.stack([embedder.pool(i) for i in ids]), reference, rtol=0, atol=1e-6)
