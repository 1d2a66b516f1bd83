"""The int4 scale search: as good as llama.cpp's wider one, independent of thread count, never worse
than min/max (that last check lives with the other int4 tests in tests/kernels/test_quant.py)."""

from __future__ import annotations

import pytest
import torch

from engine.quant import INT4_SEARCH_STEPS, _fit_int4_groups, quantize_int4
from weir.kernels.int4_matmul import HAS_INT4PACK_CPU, dequantize_int4, from_cpu_layout, pack_int4


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[torch.rand(n, k, generator=g) < 0.01] *= 8  # heavy tails: clipping them is what the search is for
    importance = torch.rand(k, generator=g) ** 4 * 10  # a few channels carry most activation energy
    return w, importance


def _weighted_error(w: torch.Tensor, imp: torch.Tensor, group: int, **kwargs: object) -> float:
    qweight, sz = quantize_int4(w, group, importance=imp, **kwargs)  # type: ignore[arg-type]
    return float(((dequantize_int4(qweight, sz, group, w.shape[1]) - w).square() * imp).sum())


def _fit_with_steps(w: torch.Tensor, imp: torch.Tensor, group: int, steps: tuple[float, ...]) -> float:
    """Weighted error of ``_fit_int4_groups`` with other candidate steps, everything else alike."""
    n = w.shape[0]
    rows, imps = w.reshape(-1, group), imp.view(1, -1, group).expand(n, -1, -1).reshape(-1, group)
    scale, lo = _fit_int4_groups(rows, imps, steps)
    q = torch.round((rows - lo) / scale).clamp(0, 15)
    return float(((q * scale + lo - rows).square() * imps).sum())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_fewer_candidates_lose_little_to_llama_cpps_21(group: int) -> None:
    w, imp = _weights(96, 256, seed=group)
    ours = _fit_with_steps(w, imp, group, INT4_SEARCH_STEPS)
    llama = _fit_with_steps(w, imp, group, tuple(14 + 0.1 * i for i in range(21)))
    one = _fit_with_steps(w, imp, group, (15.0,))  # min/max rounding + one least-squares fit
    assert llama <= ours <= 1.01 * llama
    assert ours < 0.97 * one  # the candidates are doing something


def test_search_is_the_same_on_any_number_of_threads() -> None:
    w, imp = _weights(700, 320, seed=1)  # 700 rows: several chunks, the last one short
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = quantize_int4(w, 64, importance=imp)
        torch.set_num_threads(3)
        shared = quantize_int4(w, 64, importance=imp)
        assert torch.get_num_threads() == 3  # put back after the chunks ran single-threaded
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared, strict=True))


def test_search_beats_min_max_by_far_when_a_few_channels_matter() -> None:
    w, imp = _weights(64, 512, seed=7)
    plain, searched = _weighted_error(w, imp, 64, search=False), _weighted_error(w, imp, 64)
    assert searched < 0.8 * plain


def test_importance_leaves_out_the_head_unless_it_is_int4_too() -> None:
    from engine.config import tiny_config
    from engine.quant import activation_importance
    from engine.weights import build_model

    model = build_model(tiny_config(), None, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    ids = torch.arange(40) % 256
    full, body = activation_importance(model, ids), activation_importance(model, ids, head=False)
    assert "lm_head" in full and "lm_head" not in body
    assert body.keys() == full.keys() - {"lm_head"}
    assert all(torch.equal(body[k], full[k]) for k in body)


def _on_grid_weights(n: int, k: int, group: int, seed: int) -> torch.Tensor:
    """Weights that were int4 at ``group`` already (as a dequantised GGUF Q4_1 tensor): every group
    holds 16 evenly spaced levels from its min to its max, both used."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // group, group), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.rand(n, k // group, 1, generator=g) * 0.01 + 1e-3
    lo = torch.randn(n, k // group, 1, generator=g) * 0.02 - 7 * scale
    return (q * scale + lo).view(n, k)


def test_groups_on_their_grid_come_back_exactly_and_the_rest_are_searched() -> None:
    w, imp = _weights(200, 256, seed=3)
    grid = _on_grid_weights(200, 256, 32, seed=4)
    mixed = torch.where(torch.arange(200)[:, None] % 3 == 0, grid, w)  # a third of the rows on the grid
    qweight, sz = quantize_int4(mixed, 32, importance=imp)
    back = dequantize_int4(qweight, sz, 32)
    rows = torch.arange(200) % 3 == 0
    assert torch.allclose(back[rows], grid[rows], atol=1e-6)
    # off-grid rows: exactly what the search gives on its own
    qweight_w, sz_w = quantize_int4(w[~rows], 32, importance=imp)
    assert torch.equal(back[~rows], dequantize_int4(qweight_w, sz_w, 32))


def test_a_model_already_on_the_grid_skips_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import quant
    from engine.config import tiny_config
    from engine.weights import build_model

    model = build_model(tiny_config(), None, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                n, k = module.weight.shape
                module.weight.copy_(_on_grid_weights(n, k, 32, seed=n + k))
    calls = []
    real = quant._random_token_importance
    monkeypatch.setattr(quant, "_random_token_importance", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    quant.quantize_model(model, "int4-g32", head=None)
    assert calls == []  # every int4 layer is on its grid: nothing to weigh
    model2 = build_model(tiny_config(), None, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    quant.quantize_model(model2, "int4-g32", head=None)
    assert calls == [1]  # random weights are off the grid: calibrated


def test_quantizing_leaves_torchs_thread_count_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's thread count is process-wide: a thread that first runs torch while it is lowered keeps
    # the lowered count for good, so the search must not lower it even briefly
    w, imp = _weights(700, 320, seed=2)

    def refuse(_: int) -> None:
        raise AssertionError("quantization changed torch's thread count")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    quantize_int4(w, 64, importance=imp)
    from engine.quant import quantize_int8

    quantize_int8(w)


@pytest.mark.skipif(not HAS_INT4PACK_CPU, reason="this PyTorch has no CPU int4 kernel")
def test_cached_unpacking_of_the_cpu_layout_matches_the_probing_one() -> None:
    from engine.quant import _from_cpu_layout, _int4pack_for_cpu

    for n, k in ((64, 96), (32, 256)):
        q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n))
        packed = _int4pack_for_cpu(q.int())
        for _ in range(2):  # the second call uses the cached order
            assert torch.equal(_from_cpu_layout(packed), from_cpu_layout(packed))
        assert torch.equal(_from_cpu_layout(packed), pack_int4(q))
