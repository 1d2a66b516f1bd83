"""Quantized linear layers against float ones, the module swap on the engine's model, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import tiny_config
from engine.llm_engine import LLMEngine
from engine.quant import (
    Int4Linear,
    Int8Linear,
    QuantScheme,
    activation_importance,
    build_quantized_model,
    config_metadata,
    load_quantized,
    quantize_int4,
    quantize_model,
    read_scheme,
    save_quantized,
    weight_bytes,
)
from engine.sampling import SamplingParams
from engine.weights import build_model
from weir.kernels.int4_matmul import cpu_int4_supported, dequantize_int4
from weir.kernels.int8_matmul import fbgemm_supported

BF16_ROUNDING = 4 * 2**-9


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        linear.weight[3, 7] = 0.9  # an outlier, to make per-row / per-group scales matter
    return linear


def test_scheme_names() -> None:
    assert QuantScheme.parse("int8") == QuantScheme("int8")
    assert QuantScheme.parse("int4") == QuantScheme("int4", 32)
    assert str(QuantScheme.parse("INT4-g128")) == "int4-g128"
    for bad in ("int3", "int4-g48", "int8-g32", ""):
        with pytest.raises(ValueError):
            QuantScheme.parse(bad)


def test_int8_linear_error_within_half_a_step_per_weight() -> None:
    linear = _linear(192, 576, bias=True)
    q = Int8Linear.from_linear(linear)
    x = torch.randn(5, 576)
    err = (q(x) - linear(x)).abs()
    # each weight is off by at most half its row's step (scale / 2), so |y_q - y| <= |x| @ (scale / 2);
    # on CPU the product runs on bf16-rounded activations: allow 4 bf16 roundings of |x| @ |w|
    bound = x.abs() @ (q.scales / 2)[None, :].expand(576, -1) + BF16_ROUNDING * (
        x.abs() @ linear.weight.abs().T
    )
    assert (err <= bound).all()
    assert err.max() > 0  # it is quantized, not a copy
    assert q.weight.dtype == torch.int8 and q.weight.abs().max() <= 127


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_linear_error_within_half_a_step_per_weight(group: int) -> None:
    linear = _linear(192, 576, seed=group)
    q = Int4Linear.from_linear(linear, group, search=False)  # min/max: nothing is clipped
    x = torch.randn(3, 576)
    err = (q(x) - linear(x)).abs()
    scales = quantize_int4(linear.weight.detach(), group, search=False)[1][..., 0]  # [G, N]
    step = scales.t().repeat_interleave(group, dim=1)[:, :576]  # [N, K]: each weight's group step
    bound = x.abs() @ (step / 2).t() + BF16_ROUNDING * (x.abs() @ linear.weight.abs().T)
    assert (err <= bound).all()
    assert err.max() > 0


def test_int4_groups_trade_accuracy_for_size() -> None:
    linear = _linear(256, 512, seed=3)
    x = torch.randn(16, 512)
    errors = {
        g: (Int4Linear.from_linear(linear, g)(x) - linear(x)).pow(2).mean().item() for g in (32, 64, 128)
    }
    assert errors[32] < errors[64] < errors[128]


@pytest.mark.skipif(
    not cpu_int4_supported(192, torch.float32), reason="no CPU int4pack kernel in this PyTorch"
)
def test_int4_cpu_layout_is_invisible_in_the_state_dict() -> None:
    linear = _linear(192, 200, seed=1)  # K=200 is padded up to the group size
    q = Int4Linear.from_linear(linear, 64)
    expected_qweight, sz = quantize_int4(linear.weight.detach(), 64)
    q.use_cpu_layout()
    assert q.cpu_layout and not torch.equal(q.qweight, expected_qweight)
    # tinygemm computes in bf16: compare with the same maths on bf16-rounded inputs, scales and zeros
    x = torch.randn(2, 200)
    bf16 = torch.nn.functional.linear(
        x.bfloat16().float(), dequantize_int4(expected_qweight, sz.bfloat16().float(), 64, 200)
    )
    assert (q(x) - bf16).abs().max() <= 2**-7 * bf16.abs().max()
    assert torch.equal(q.state_dict()["qweight"], expected_qweight)
    fresh = Int4Linear(200, 192, group_size=64)
    fresh.use_cpu_layout()
    fresh.load_state_dict(q.state_dict())
    assert fresh.cpu_layout and torch.equal(fresh.qweight, q.qweight)


@pytest.mark.skipif(not fbgemm_supported(), reason="fbgemm needs an x86 CPU with AVX2")
def test_int8_cpu_layout_is_invisible_in_the_state_dict() -> None:
    linear = _linear(192, 576, bias=True, seed=2)
    portable = Int8Linear.from_linear(linear)
    q = Int8Linear.from_linear(linear, cpu_layout=True)
    assert q.cpu_layout and not portable.cpu_layout and q.weight.numel() == 0  # one copy, fbgemm's
    x = torch.randn(4, 576)
    x[:, 9] *= 20  # an outlier channel: the product keeps ~13 bits of each activation row
    exact = torch.nn.functional.linear(x, portable.weight.float() * portable.scales[:, None], linear.bias)
    assert (q(x) - exact).norm() <= 2e-3 * exact.norm()
    assert q.state_dict().keys() == portable.state_dict().keys()
    assert all(torch.equal(q.state_dict()[k], v) for k, v in portable.state_dict().items())
    fresh = Int8Linear(576, 192, bias=True)
    fresh.use_cpu_layout()  # an empty module asks for the CPU layout; loading a state dict honours it
    fresh.load_state_dict(portable.state_dict())
    assert fresh.cpu_layout and torch.equal(fresh(x), q(x))
    assert weight_bytes(q) == weight_bytes(portable)  # the packed copy is counted in place of the weight
    q.use_cpu_layout(False)
    assert not q.cpu_layout and torch.equal(q.weight, portable.weight)


def test_bias_and_leading_dims_survive() -> None:
    linear = _linear(64, 96, bias=True)
    x = torch.randn(2, 3, 96)
    q8, q4 = Int8Linear.from_linear(linear), Int4Linear.from_linear(linear, 32)
    w8 = q8.weight.float() * q8.scales[:, None]
    w4 = dequantize_int4(q4.qweight, q4.scales_and_zeros, 32, 96)
    for q, w in ((q8, w8), (q4, w4)):
        assert q(x).shape == (2, 3, 64)
        expected = torch.nn.functional.linear(x, w, linear.bias)
        assert (q(x) - expected).abs().max() <= BF16_ROUNDING * expected.abs().max()


def _tiny_model() -> nn.Module:
    return build_model(tiny_config(), None, dtype=torch.float32, device=torch.device("cpu"), seed=0)


def _prompt_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """What a user asking for ``prompt_logprobs`` sees: log p(token | prefix) for each prompt token."""
    engine.add_request("score", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    got = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = out.prompt_logprobs or got
    assert got is not None
    return torch.tensor([lp.logprob for lp in got[1:]])


PROMPT = [(7 * i + 3) % 256 for i in range(40)]


@pytest.mark.parametrize("scheme,max_err", [("int8", 0.05), ("int4-g32", 0.5)])
def test_quantized_model_scores_text_like_the_float_one(scheme: str, max_err: float) -> None:
    engine = LLMEngine.from_config(tiny_config(), num_kv_blocks=64)
    reference = _prompt_logprobs(engine, PROMPT)
    quantize_model(engine.model, scheme)
    assert all(not isinstance(m, nn.Linear) for m in engine.model.modules())
    assert engine.model.quant_scheme == QuantScheme.parse(scheme)
    quantized = _prompt_logprobs(engine, PROMPT)
    err = (quantized - reference).abs().max().item()
    assert 0 < err < max_err, err


def test_int4_keeps_the_output_head_at_int8_unless_asked() -> None:
    model = quantize_model(_tiny_model(), "int4-g64")
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.layers[0].self_attn.o_proj, Int4Linear)
    assert model.quantized_modules["lm_head"] == "int8"
    assert model.quantized_modules["layers.0.mlp.down_proj"] == "int4-g64"
    assert isinstance(quantize_model(_tiny_model(), "int4", head=None).lm_head, Int4Linear)
    assert isinstance(quantize_model(_tiny_model(), "int4", head="none").lm_head, nn.Linear)


def test_skip_keeps_named_layers_in_float() -> None:
    model = quantize_model(_tiny_model(), "int8", skip=[r"^lm_head$"])
    assert isinstance(model.lm_head, nn.Linear)
    assert isinstance(model.layers[0].mlp.down_proj, Int8Linear)
    assert "lm_head" not in model.quantized_modules
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int4")


def test_weight_memory_shrinks() -> None:
    sizes = {}
    for scheme in ("none", "int8", "int4-g64"):
        sizes[scheme] = weight_bytes(quantize_model(_tiny_model(), scheme))
    assert sizes["int4-g64"] < sizes["int8"] < sizes["none"]


@pytest.mark.parametrize("scheme", ["int8", "int4-g64"])
def test_checkpoint_round_trip_without_the_original(scheme: str, tmp_path: Path) -> None:
    tied = tiny_config(tie_word_embeddings=True)  # as SmolLM2: the head is the embedding
    engine = LLMEngine.from_config(tied, seed=0, num_kv_blocks=64)
    model = quantize_model(engine.model, scheme, skip=[r"^lm_head$"])  # the head stays float: an alias
    expected = _prompt_logprobs(engine, PROMPT)
    save_quantized(model, tmp_path, metadata=config_metadata(model))
    info = read_scheme(tmp_path)
    assert info["scheme"] == scheme and "layers.0.self_attn.qkv_proj" in info["modules"]
    assert info["aliases"] == {"lm_head.weight": "embed_tokens.weight"}
    assert info["metadata"]["model_config"]["hidden_size"] == tiny_config().hidden_size

    # a float engine with other random weights takes the checkpoint and then scores exactly the same
    other = LLMEngine.from_config(tied, seed=1, num_kv_blocks=64)
    assert not torch.equal(_prompt_logprobs(other, PROMPT), expected)
    load_quantized(other.model, tmp_path)
    assert torch.equal(_prompt_logprobs(other, PROMPT), expected)
    assert other.model.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()

    # or build the model from the checkpoint alone: the float weights never exist
    built = build_quantized_model(tmp_path)
    assert isinstance(built.layers[1].mlp.gate_up_proj, Int8Linear if scheme == "int8" else Int4Linear)
    built_state, state = built.state_dict(), model.state_dict()
    assert built_state.keys() == state.keys()
    assert all(torch.equal(built_state[k], state[k]) for k in state)


def test_checkpoint_rejects_a_different_architecture(tmp_path: Path) -> None:
    save_quantized(quantize_model(_tiny_model(), "int8"), tmp_path)
    other = build_model(tiny_config(num_layers=1), None, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="lacks"):
        load_quantized(other, tmp_path)


def test_unquantized_model_cannot_be_saved(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not quantized"):
        save_quantized(_tiny_model(), tmp_path)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_engine_generates_with_a_quantized_model(scheme: str) -> None:
    engine = LLMEngine.from_config(tiny_config(), max_num_seqs=8, num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 20]
    quantize_model(engine.model, scheme)
    batched = engine.generate(prompts, greedy)
    alone = [engine.generate([p], greedy)[0] for p in prompts]
    assert batched == alone  # quantized layers keep the engine's batch invariance
    assert all(len(out) == 8 for out in batched)


def test_dequantised_int4_matches_float_weights_closely() -> None:
    linear = _linear(64, 128, seed=5)
    qweight, sz = quantize_int4(linear.weight.detach(), 32, search=False)
    w = dequantize_int4(qweight, sz, 32)
    assert (w - linear.weight).abs().max() <= sz[..., 0].max() / 2 + 1e-6


def test_mixed_int4_body_int8_head_round_trips(tmp_path: Path) -> None:
    model = quantize_model(_tiny_model(), "int4-g32")
    save_quantized(model, tmp_path, metadata=config_metadata(model))
    assert read_scheme(tmp_path)["modules"]["lm_head"] == "int8"
    built = build_quantized_model(tmp_path)
    assert isinstance(built.lm_head, Int8Linear) and isinstance(built.layers[0].mlp.down_proj, Int4Linear)
    state, built_state = model.state_dict(), built.state_dict()
    assert all(torch.equal(built_state[k], state[k]) for k in state)


def _group_errors(w: torch.Tensor, group: int, **kwargs: object) -> torch.Tensor:
    """Squared reconstruction error per (row, group) of the int4 round trip."""
    qweight, sz = quantize_int4(w, group, **kwargs)  # type: ignore[arg-type]
    err = (dequantize_int4(qweight, sz, group, w.shape[1]) - w).square()
    return torch.nn.functional.pad(err, (0, -w.shape[1] % group)).view(w.shape[0], -1, group).sum(-1)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_search_beats_min_max_in_every_group(group: int) -> None:
    w = _linear(96, 200, seed=group).weight.detach()  # 200: the last group is part padding
    plain, searched = _group_errors(w, group, search=False), _group_errors(w, group)
    assert (searched <= plain * (1 + 1e-5) + 1e-12).all()
    assert searched.sum() < 0.9 * plain.sum()  # even for normal weights, clipping the tails pays


def test_int4_search_ignores_the_padding() -> None:
    # one group of 64 with 32 real inputs, all in [1, 2]: min/max stretches over the zero padding too
    w = 1 + torch.rand(8, 32)
    plain, searched = _group_errors(w, 64, search=False), _group_errors(w, 64)
    assert searched.sum() < 0.2 * plain.sum()


def test_int4_search_weighs_channels_by_importance() -> None:
    w = _linear(64, 128, seed=9).weight.detach()
    importance = torch.ones(128)
    importance[:16] = 100.0  # a few input channels carry most of the activation energy
    errs = {}
    for name, imp in (("flat", None), ("weighted", importance)):
        qweight, sz = quantize_int4(w, 64, importance=imp)
        errs[name] = (dequantize_int4(qweight, sz, 64) - w).square()
    assert errs["weighted"][:, :16].sum() < 0.8 * errs["flat"][:, :16].sum()
    weighted_cost = lambda e: (e * importance).sum()  # noqa: E731
    assert weighted_cost(errs["weighted"]) < weighted_cost(errs["flat"])


def test_activation_importance_is_the_mean_squared_input() -> None:
    model = _tiny_model()
    ids = torch.tensor(PROMPT)
    cache_before = model.layers[0].self_attn.k_cache
    imp = activation_importance(model, ids)
    assert model.layers[0].self_attn.k_cache is cache_before  # borrowed cache given back
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(imp) == linears
    with torch.no_grad():
        first = model.layers[0].input_layernorm(model.embed_tokens(ids))  # what qkv_proj of layer 0 sees
    torch.testing.assert_close(imp["layers.0.self_attn.qkv_proj"], first.square().mean(0))
    assert imp["lm_head"].shape == (model.config.hidden_size,)

    # and quantize_model takes it: each importance (none, auto = random tokens, this prompt) gives other
    # int4 weights, and auto is deterministic
    def sz(importance: object) -> torch.Tensor:
        model = quantize_model(_tiny_model(), "int4-g32", importance=importance)  # type: ignore[arg-type]
        return model.layers[0].self_attn.qkv_proj.scales_and_zeros

    flat, auto, aware = sz(None), sz("auto"), sz(imp)
    assert not torch.equal(flat, auto) and not torch.equal(auto, aware) and not torch.equal(flat, aware)
    assert torch.equal(auto, sz("auto"))
    with pytest.raises(ValueError, match="importance"):
        sz("awq")
