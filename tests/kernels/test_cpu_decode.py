"""The fused CPU decode step (kernels/cpu_decode.c) against its reference, the engine's eager forward.

Each case prefills a prompt through the eager model into a KV cache whose block table is out of order
and crosses block boundaries, then runs the next token once through the eager decode path and once
through the fused step from the same cache, and compares the logits and the K/V rows written.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import tiny_config
from engine.fused_step import FusedDecoder, build_fused_decoder
from engine.llm_engine import LLMEngine
from engine.model import AttentionMetadata, PrefillChunk, Transformer, attention_metadata
from engine.quant import Int4Linear, quantize_model
from weir.kernels import cpu_decode

pytestmark = pytest.mark.skipif(cpu_decode.library() is None, reason="no C compiler to build the step")

BLOCK = 16
TABLE = torch.tensor([5, 2, 9, 0], dtype=torch.int32)  # out of order: the step must follow the table


def _slots(positions: torch.Tensor) -> torch.Tensor:
    return TABLE.long()[positions // BLOCK] * BLOCK + positions % BLOCK


def _prefill(model: Transformer, ids: torch.Tensor) -> None:
    n = ids.numel()
    positions = torch.arange(n)
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=_slots(positions),
        num_decodes=0,
        block_tables=None,
        context_lens=None,
        max_context_len=0,
        prefills=[PrefillChunk(0, n, n, TABLE)],
        block_size=BLOCK,
    )
    with torch.inference_mode(), attention_metadata(meta):
        model(ids)


def _eager_decode(model: Transformer, token: int, position: int) -> torch.Tensor:
    meta = AttentionMetadata(
        positions=torch.tensor([position]),
        slot_mapping=_slots(torch.tensor([position])),
        num_decodes=1,
        block_tables=TABLE[None],
        context_lens=torch.tensor([position + 1], dtype=torch.int32),
        max_context_len=position + 1,
        prefills=[],
        block_size=BLOCK,
    )
    with torch.inference_mode(), attention_metadata(meta):
        return model.logits(model(torch.tensor([token])))


def _caches(model: Transformer) -> list[torch.Tensor]:
    return [t.clone() for layer in model.layers for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]


def _restore(model: Transformer, saved: list[torch.Tensor]) -> None:
    tensors = [t for layer in model.layers for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
    for t, s in zip(tensors, saved, strict=True):
        t.copy_(s)


def _model_and_step(
    dtype: str, quantization: str, changes: dict[str, Any], blocks: int
) -> tuple[Transformer, FusedDecoder]:
    """An eager engine's model (the reference) and a fused step built over the same weights."""
    engine = LLMEngine.from_config(
        tiny_config(**changes),
        dtype=dtype,
        device="cpu",
        num_kv_blocks=blocks,
        quantization=quantization,
        fused_decode="off",
    )
    decoder = build_fused_decoder(engine.model, "on", 256)
    assert isinstance(decoder, FusedDecoder)
    return engine.model, decoder


# (dtype, quantization, config changes, logits tolerance relative to the largest logit). float32: the
# summation order only. bfloat16: the eager forward rounds every activation to bf16, the fused step
# keeps them in fp32. int8: the eager path rounds activations to ~13 bits per row for fbgemm
# (kernels/int8_matmul.py), int4 to bf16 for PyTorch's CPU int4 kernel; the fused step multiplies the
# quantized weights by fp32 activations.
CASES = [
    ("float32", "none", {}, 1e-5),
    ("float32", "none", {"attention_bias": True}, 1e-5),
    ("float32", "none", {"tie_word_embeddings": True}, 1e-5),
    ("float32", "none", {"num_kv_heads": 4}, 1e-5),  # no grouping
    ("float32", "none", {"num_kv_heads": 1, "hidden_size": 72, "head_dim": 18}, 1e-5),  # odd tails
    ("bfloat16", "none", {}, 2e-2),
    ("float32", "int8", {}, 2e-3),
    ("bfloat16", "int8", {"tie_word_embeddings": True}, 2e-2),
    ("float32", "int4", {}, 2e-3),  # groups of 32, int8 head; eager rounds activations to bf16
    ("bfloat16", "int4-g64", {"attention_bias": True}, 2e-2),
    ("float32", "int4-g128", {"num_kv_heads": 1, "hidden_size": 72, "head_dim": 18}, 2e-3),  # padded K
]


@pytest.mark.parametrize(("dtype", "quantization", "changes", "tol"), CASES)
def test_fused_step_matches_the_eager_forward(
    dtype: str, quantization: str, changes: dict[str, Any], tol: float
) -> None:
    model, decoder = _model_and_step(dtype, quantization, changes, blocks=16)
    generator = torch.Generator().manual_seed(0)
    for length in (1, 16, 37):  # one token; exactly one full block; three blocks, the last partial
        ids = torch.randint(1, model.config.vocab_size, (length + 1,), generator=generator)
        _prefill(model, ids[:-1])
        before = _caches(model)
        expected = _eager_decode(model, int(ids[-1]), length)
        expected_caches = _caches(model)
        _restore(model, before)
        with torch.inference_mode():
            got = decoder([int(ids[-1])], [length], TABLE[None])
        assert got.shape == (1, model.config.vocab_size) and got.dtype == torch.float32
        scale = expected.abs().max().item()
        err = (got - expected).abs().max().item()
        assert err <= tol * scale, f"length {length}: logits differ by {err:.3g} (scale {scale:.3g})"
        for got_cache, want, old in zip(_caches(model), expected_caches, before, strict=True):
            # the new K/V row, from the same projections, and nothing else was written
            assert (got_cache.float() - want.float()).abs().max().item() <= 4 * tol * max(1.0, scale)
            untouched = torch.ones(want.shape[:2], dtype=torch.bool)
            untouched.view(-1)[_slots(torch.tensor([length]))] = False
            assert torch.equal(got_cache[untouched], old[untouched])


def test_an_int4_head_and_a_tied_embedding() -> None:
    """quantize_model(head=None) makes the head int4 too; tied, it is the embedding's quantized copy."""
    engine = LLMEngine.from_config(
        tiny_config(tie_word_embeddings=True), device="cpu", num_kv_blocks=16, fused_decode="off"
    )
    quantize_model(engine.model, "int4-g32", head=None)
    assert isinstance(engine.model.lm_head, Int4Linear)
    decoder = build_fused_decoder(engine.model, "on", 256)
    assert decoder is not None and decoder.globals.head.type == cpu_decode.I4
    ids = torch.arange(1, 22)
    _prefill(engine.model, ids[:-1])
    before = _caches(engine.model)
    expected = _eager_decode(engine.model, int(ids[-1]), 20)
    _restore(engine.model, before)
    with torch.inference_mode():
        got = decoder([int(ids[-1])], [20], TABLE[None])
    assert (got - expected).abs().max().item() <= 2e-3 * expected.abs().max().item()


def test_position_beyond_the_scratch_is_refused() -> None:
    engine = LLMEngine.from_config(tiny_config(), device="cpu", num_kv_blocks=16, fused_decode="off")
    decoder = build_fused_decoder(engine.model, "on", 32)
    assert decoder is not None
    with pytest.raises(ValueError, match="beyond"):
        decoder([1], [32], TABLE[None])


def test_an_unwritable_cache_means_no_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("WEIR_CACHE_DIR", str(blocker))
    cpu_decode.library.cache_clear()
    try:
        assert cpu_decode.library() is None  # logged, not raised: the engine serves eagerly
    finally:
        cpu_decode.library.cache_clear()


@pytest.mark.parametrize(
    ("dtype", "quantization", "changes", "tol"),
    # fp32, odd tails, bf16, int8, int8 and int4 in a bf16 model (on AMX tiles where there are some), int4
    [CASES[0], CASES[4], CASES[5], CASES[6], CASES[7], CASES[9], CASES[8]],
)
# 2: attention in parts of sequences, fp32 inputs to bf16 weights; 5: a task per sequence, bf16 inputs on
# vdpbf16ps or AMX where the CPU has them; 13 and 27: more sequences than one micro-kernel tile holds (12,
# 6 or 4 by instruction set), one and two AMX input tiles; 40: two blocks of AMX rows (32 + 8)
@pytest.mark.parametrize("batch", [2, 5, 13, 27, 40])
def test_a_batch_matches_the_eager_batched_decode(
    dtype: str, quantization: str, changes: dict[str, Any], tol: float, batch: int
) -> None:
    blocks = 4 * max(batch, 32)
    model, decoder = _model_and_step(dtype, quantization, changes, blocks=blocks)
    generator = torch.Generator().manual_seed(batch)
    lengths = [int(n) for n in torch.randint(1, 60, (batch,), generator=generator)]
    # each sequence its own scattered blocks; rows padded as the runner pads them
    tables = torch.randperm(blocks, generator=generator)[: batch * 4].view(batch, 4).to(torch.int32)
    ids = [torch.randint(1, model.config.vocab_size, (n + 1,), generator=generator) for n in lengths]
    for b, n in enumerate(lengths):
        positions = torch.arange(n)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=tables[b].long()[positions // BLOCK] * BLOCK + positions % BLOCK,
            num_decodes=0,
            block_tables=None,
            context_lens=None,
            max_context_len=0,
            prefills=[PrefillChunk(0, n, n, tables[b])],
            block_size=BLOCK,
        )
        with torch.inference_mode(), attention_metadata(meta):
            model(ids[b][:-1])
    before = _caches(model)
    positions = torch.tensor(lengths)
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=tables.long()[torch.arange(batch), positions // BLOCK] * BLOCK + positions % BLOCK,
        num_decodes=batch,
        block_tables=tables,
        context_lens=(positions + 1).to(torch.int32),
        max_context_len=int(positions.max()) + 1,
        prefills=[],
        block_size=BLOCK,
    )
    last = torch.stack([i[-1] for i in ids])
    with torch.inference_mode(), attention_metadata(meta):
        expected = model.logits(model(last))
    expected_caches = _caches(model)
    _restore(model, before)
    with torch.inference_mode():
        got = decoder(last.tolist(), lengths, tables)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= tol * scale
    for got_cache, want in zip(_caches(model), expected_caches, strict=True):
        assert (got_cache.float() - want.float()).abs().max().item() <= 4 * tol * max(1.0, scale)


def _amx() -> bool:
    lib = cpu_decode.library()
    return lib is not None and lib.weir_amx(-1) == 1


def test_batch_size_is_bounded() -> None:
    engine = LLMEngine.from_config(tiny_config(), device="cpu", num_kv_blocks=16, fused_decode="off")
    decoder = build_fused_decoder(engine.model, "on", 64)
    assert decoder is not None
    too_many = cpu_decode.MAX_BATCH + 1
    with pytest.raises(ValueError, match="sequences"):
        decoder([1] * too_many, [0] * too_many, TABLE[None].expand(too_many, -1))


@pytest.mark.skipif(not _amx(), reason="this CPU has no AMX (or the kernel does not lend it)")
@pytest.mark.parametrize("batch", [5, 27])
def test_bf16_batches_without_amx(batch: int) -> None:
    """On an AMX machine the tests above run bf16 batches (and int8 / int4 layers of bf16 models) on the tiles;
    this runs them on vdpbf16ps (or fp32 FMAs), the path CPUs without AMX take."""
    lib = cpu_decode.library()
    assert lib is not None and lib.weir_amx(0) == 0
    try:
        test_a_batch_matches_the_eager_batched_decode(*CASES[5], batch=batch)
        test_a_batch_matches_the_eager_batched_decode(*CASES[7], batch=batch)
        test_a_batch_matches_the_eager_batched_decode(*CASES[9], batch=batch)
    finally:
        assert lib.weir_amx(1) == 1


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set variants")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # the AVX2 + FMA path; plain C
def test_the_other_instruction_set_paths(march: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX-512 build is what the tests above run here; this machine also runs the AVX2 and the
    plain-C builds, which other CPUs get."""
    monkeypatch.setenv("WEIR_CPU_DECODE_MARCH", march)
    cpu_decode.library.cache_clear()
    try:
        assert cpu_decode.library() is not None
        for case in (CASES[0], CASES[4], CASES[5], CASES[6], CASES[8]):
            test_fused_step_matches_the_eager_forward(*case)
            test_a_batch_matches_the_eager_batched_decode(*case, batch=13)
    finally:
        cpu_decode.library.cache_clear()
