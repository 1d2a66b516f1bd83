"""Weight-only quantization as a module swap (gpt-fast style): the model code never learns about it.

``quantize_model(model, "int8" | "int4" | "int4-g32" | "int4-g64" | "int4-g128")`` replaces every
``nn.Linear`` with ``Int8Linear`` (per-output-channel symmetric) or ``Int4Linear`` (group-wise with scales
and zero points, two values per byte). ``save_quantized``/``load_quantized`` write and read a
``model.safetensors`` plus ``quantization.json`` that needs no original checkpoint. The matmuls live in
``kernels/`` (Triton on CUDA, PyTorch's packed CPU kernels where this build has them, else a reference).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels._triton import use_triton
from kernels.int4_matmul import (
    cpu_int4_supported,
    from_cpu_layout,
    int4_matmul,
    int4_matmul_cpu,
    pack_int4,
    to_cpu_layout,
)
from kernels.int8_matmul import int8_matmul

DEFAULT_INT4_GROUP_SIZE = 32
GROUP_SIZES = (32, 64, 128)
CHECKPOINT_FILE = "model.safetensors"
SCHEME_FILE = "quantization.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "none" | "int8" | "int4"
    group_size: int | None = None  # int4 only

    @classmethod
    def parse(cls, spec: str | QuantScheme) -> QuantScheme:
        """``none``, ``int8``, ``int4`` (group 32), ``int4-g32``, ``int4-g64``, ``int4-g128``."""
        if isinstance(spec, QuantScheme):
            return spec
        m = re.fullmatch(r"(none|int8|int4)(?:-g(\d+))?", spec.strip().lower())
        if not m or (m[2] and m[1] != "int4"):
            raise ValueError(f"unknown quantization {spec!r}: use none, int8, int4 or int4-g{{32,64,128}}")
        if m[1] != "int4":
            return cls(m[1])
        group = int(m[2] or DEFAULT_INT4_GROUP_SIZE)
        if group not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group}")
        return cls("int4", group)

    def __str__(self) -> str:
        return f"int4-g{self.group_size}" if self.method == "int4" else self.method


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output row: ``w ~= q * scale``, q in [-127, 127]."""
    # contiguous: elementwise ops keep their input's strides, and the packed int8 kernel rejects a
    # strided weight (a linear whose weight is a view of a prepacked copy, engine/packed.py)
    w = weight.float().contiguous()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(weight.dtype)


# Candidate steps of the int4 search, as multiples of 1 / (max - min): 15 is min/max scaling, below it
# the levels spread past the extremes, above it they clip them (and the least-squares fit moves them).
# llama.cpp's make_qkx2_quants tries 21 steps 0.1 apart; 11 steps 0.2 apart cost half as much and leave
# 0.8% more activation-weighted squared error on SmolLM2-135M at g64 (7 steps: 2%, 5 steps: 4%).
INT4_SEARCH_STEPS = tuple(14 + 0.2 * i for i in range(11))


def _fit_int4_groups(
    w: torch.Tensor, imp: torch.Tensor, steps: tuple[float, ...] = INT4_SEARCH_STEPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset per row of ``w`` [R, G] minimising sum(imp * (q * scale + lo - w)^2), q in [0, 15].

    llama.cpp's ``make_qkx2_quants``: min/max scaling is only the first candidate; each candidate step
    rounds the group once, then a weighted least-squares fit gives the best scale and offset for that
    rounding (which clips outliers when that pays), and the best fit of all (and of one re-rounding with
    it) wins. ``imp`` weighs each value's error. A fit's error needs no pass over the group: the
    residual of a least-squares fit is orthogonal to the fit, so err = sum(imp w^2) - scale sum(imp q w)
    - offset sum(imp w). That closed form cancels digits, so the winner is checked against min/max
    with a direct error once at the end, and the search never returns a worse fit than min/max.
    """
    big = torch.finfo(w.dtype).max
    lo = torch.where(imp > 0, w, big).amin(-1, keepdim=True)
    hi = torch.where(imp > 0, w, -big).amax(-1, keepdim=True)
    lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)  # all-padding rows: lo = big, hi = -big
    span = (hi - lo).clamp(min=1e-12)
    iw = imp * w
    sum_w, sum_x = imp.sum(-1, keepdim=True), iw.sum(-1, keepdim=True)
    sum_x2 = (iw * w).sum(-1, keepdim=True)
    d, inv = w - lo, 1 / span
    best_s, best_lo = span / 15, lo
    best_err = torch.full_like(span, torch.inf)

    def consider(q: torch.Tensor) -> None:
        nonlocal best_s, best_lo, best_err
        sum_xq = (q * iw).sum(-1, keepdim=True)
        iq = q * imp
        sum_q = iq.sum(-1, keepdim=True)
        sum_q2 = iq.mul_(q).sum(-1, keepdim=True)
        det = sum_w * sum_q2 - sum_q * sum_q
        ok = det > 1e-12 * sum_w * sum_q2
        det = torch.where(ok, det, 1.0)
        scale = (sum_w * sum_xq - sum_q * sum_x) / det
        offset = (sum_q2 * sum_x - sum_q * sum_xq) / det
        ok &= scale > 0
        err = sum_x2 - scale * sum_xq - offset * sum_x
        better = ok & (err < best_err)
        best_s = torch.where(better, scale, best_s)
        best_lo = torch.where(better, offset, best_lo)
        best_err = torch.where(better, err, best_err)

    for step in steps:
        q = (d * (step * inv)).round_()
        # steps <= 15 cannot leave [0, 15] on real values (padding has imp 0 and never counts)
        consider(q.clamp_(0, 15) if step > 15 else q)
    consider(torch.round((w - best_lo) / best_s).clamp_(0, 15))  # re-round against the best fit

    def direct_err(scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        q = torch.round((w - offset) / scale).clamp_(0, 15)
        return (imp * (q * scale + offset - w).square_()).sum(-1, keepdim=True)

    min_max = span / 15
    keep = direct_err(best_s, best_lo) <= direct_err(min_max, lo)
    return torch.where(keep, best_s, min_max), torch.where(keep, best_lo, lo)


def _parallel_chunks(fn: Callable[[int], None], starts: Iterable[int]) -> None:
    """``fn(start)`` for every start on as many Python threads as torch has intra-op threads, each
    running torch single-threaded (its kernels release the GIL); torch's thread count is put back."""
    threads = torch.get_num_threads()
    starts = list(starts)
    if threads <= 1 or len(starts) <= 1:
        for start in starts:
            fn(start)
        return
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(min(threads, len(starts))) as pool:
            for _ in pool.map(fn, starts):  # re-raises the first error
                pass
    finally:
        torch.set_num_threads(threads)


def quantize_int4(
    weight: torch.Tensor, group_size: int, *, search: bool = True, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per group of ``group_size`` inputs onto 16 levels.

    ``search=False``: each group's [min, max] maps onto the 16 levels. ``search=True`` (default): a
    per-group scale/offset search that minimises the reconstruction error (``_fit_int4_groups``), weighted
    per input channel by ``importance`` [K] when given (e.g. mean squared activations, AWQ-style).
    Returns ``qweight`` uint8 ``[N, Kp // 2]`` and ``scales_and_zeros`` ``[Kp // group, N, 2]`` with
    ``w ~= (q - 8) * scale + zero`` (the tinygemm convention); K is zero-padded up to the group size and
    the padding (never multiplied by real inputs) does not count in the search.
    """
    n, k = weight.shape
    kp = -(-k // group_size) * group_size
    groups = kp // group_size
    w = torch.nn.functional.pad(weight.float(), (0, kp - k)).view(n, groups, group_size)
    if search:
        imp = torch.ones(k) if importance is None else importance.float().cpu().clamp(min=0)
        imp = torch.nn.functional.pad(imp.to(w.device), (0, kp - k)).view(1, groups, group_size)
        scales = torch.empty(n, groups, 1, device=w.device)
        lo = torch.empty_like(scales)

        def fit(r: int) -> None:
            chunk = w[r : r + rows]
            s, m = _fit_int4_groups(
                chunk.reshape(-1, group_size), imp.expand_as(chunk).reshape(-1, group_size)
            )
            scales[r : r + rows], lo[r : r + rows] = s.view(-1, groups, 1), m.view(-1, groups, 1)

        if w.device.type == "cpu":
            # chunks that stay in cache (the search makes ~100 passes over each), one single-threaded
            # chunk per core at a time: each op on a 64k-value chunk is too small to split across
            # threads, and on a busy machine every parallel op waits for its slowest (descheduled)
            # thread, which made the search ~4x slower with 2 threads than with 1
            rows = max(1, (1 << 16) // kp)
            _parallel_chunks(fit, range(0, n, rows))
        else:
            rows = max(1, (1 << 24) // kp)  # a GPU wants few, large launches
            for r in range(0, n, rows):
                fit(r)
        scales, lo = scales.squeeze(-1), lo.squeeze(-1)
    else:
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    zeros = lo + 8 * scales
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous().to(weight.dtype)
    return pack_int4(q.view(n, kp)), scales_and_zeros


class Int8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        module.weight, module.scales = quantize_int8(w)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Int4Linear(nn.Module):
    """``qweight`` is kept in exactly one layout: ours, or tinygemm's on CPU when this PyTorch has the
    kernel (``cpu_layout``). The state dict is always ours, so checkpoints do not depend on the build."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        group_size: int = DEFAULT_INT4_GROUP_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        kp = -(-in_features // group_size) * group_size
        self.register_buffer("qweight", torch.empty(out_features, kp // 2, dtype=torch.uint8, device=device))
        self.register_buffer(
            "scales_and_zeros", torch.empty(kp // group_size, out_features, 2, dtype=dtype, device=device)
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.cpu_layout = False

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group_size: int,
        *,
        search: bool = True,
        importance: torch.Tensor | None = None,
    ) -> Int4Linear:
        w = linear.weight.detach()
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, group_size, w.dtype, w.device
        )
        module.qweight, module.scales_and_zeros = quantize_int4(
            w, group_size, search=search, importance=importance
        )
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return module

    def use_cpu_layout(self, enable: bool = True) -> None:
        if (
            enable
            and not self.cpu_layout
            and self.qweight.is_cpu
            and cpu_int4_supported(self.out_features, self.scales_and_zeros.dtype)
        ):
            self.qweight, self.cpu_layout = to_cpu_layout(self.qweight), True
        elif not enable and self.cpu_layout:
            self.qweight, self.cpu_layout = from_cpu_layout(self.qweight), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_layout and x.is_cpu and not use_triton(x):
            y = int4_matmul_cpu(x, self.qweight, self.scales_and_zeros, self.group_size)
        else:
            self.use_cpu_layout(False)  # moved off the CPU (or onto Triton): back to the portable layout
            y = int4_matmul(x, self.qweight, self.scales_and_zeros, self.group_size)
        return y if self.bias is None else y + self.bias

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.cpu_layout:
            destination[prefix + "qweight"] = from_cpu_layout(self.qweight)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        was_cpu_layout = self.cpu_layout
        self.cpu_layout = False  # the incoming qweight is in our layout
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.use_cpu_layout(was_cpu_layout)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )


def _swap_linears(
    model: nn.Module, make: Callable[[str, nn.Linear], nn.Module], include: Callable[[str], bool]
) -> list[str]:
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and include(name):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, make(name, module))
            swapped.append(name)
    return swapped


def _make_quantized(
    linear: nn.Linear, scheme: QuantScheme, search: bool = True, importance: torch.Tensor | None = None
) -> nn.Module:
    if scheme.method == "int8":
        return Int8Linear.from_linear(linear)
    module = Int4Linear.from_linear(
        linear, scheme.group_size or DEFAULT_INT4_GROUP_SIZE, search=search, importance=importance
    )
    module.use_cpu_layout()
    return module


def quantize_model(
    model: nn.Module,
    scheme: str | QuantScheme,
    *,
    skip: Iterable[str] = (),
    head: str | QuantScheme | None = "int8",
    search: bool = True,
    importance: dict[str, torch.Tensor] | str | None = "auto",
) -> nn.Module:
    """Swap ``model``'s ``nn.Linear`` layers for quantized ones in place and return it.

    ``skip``: regexes of module names to leave in floating point. ``head``: the scheme for the output
    layer (``lm_head``) under an int4 scheme; int8 by default, as llama.cpp keeps its Q4 models' output
    layer at 6-8 bits: the logits are the most sensitive product in the model. ``None``: same as the
    rest. A head tied to the embedding is quantized as its own copy; the embedding stays as it was.
    ``search``: int4 scales from a per-group error-minimising search (default) rather than min/max.
    ``importance``: module name -> per-input-channel weight of the int4 search's error, e.g. from
    ``activation_importance`` (activation-aware, as AWQ); missing names weigh every channel alike.
    ``"auto"`` (default): for int4 on an engine ``Transformer``, from one prefill of seeded random token
    ids (no calibration text needed: the channels that carry the activation energy are a property of
    the model more than of the input); ``None``: every channel alike.
    """
    scheme = QuantScheme.parse(scheme)
    if scheme.method == "none":
        return model
    if getattr(model, "quant_scheme", None) is not None:
        raise ValueError(f"model is already quantized ({model.quant_scheme})")
    head_scheme = QuantScheme.parse(head) if head is not None and scheme.method == "int4" else scheme
    chosen: dict[str, QuantScheme] = {}

    def make(name: str, linear: nn.Linear) -> nn.Module:
        chosen[name] = head_scheme if name == "lm_head" else scheme
        if chosen[name].method == "none":
            return linear
        weights = importance.get(name) if isinstance(importance, dict) else None
        return _make_quantized(linear, chosen[name], search, weights)

    if importance == "auto":
        # the head's inputs only when the head is int4 too: its product is a fifth of the prefill
        importance = (
            _random_token_importance(model, head=head_scheme.method == "int4")
            if scheme.method == "int4"
            else None
        )
    elif isinstance(importance, str):
        raise ValueError(f"importance must be a dict, 'auto' or None, not {importance!r}")
    patterns = [re.compile(p) for p in skip]
    with torch.no_grad():
        _swap_linears(model, make, lambda name: not any(p.search(name) for p in patterns))
    model.quant_scheme = scheme
    model.quantized_modules = {n: str(s) for n, s in chosen.items() if s.method != "none"}
    return model


CALIBRATION_TOKENS = 512


def _random_token_importance(model: nn.Module, head: bool = True) -> dict[str, torch.Tensor] | None:
    """``activation_importance`` over seeded random token ids, for engine ``Transformer``s only."""
    embed = getattr(model, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding) or not hasattr(model, "allocate_kv_cache"):
        return None
    if embed.weight.device.type == "meta":
        return None
    ids = torch.randint(
        0, embed.num_embeddings, (CALIBRATION_TOKENS,), generator=torch.Generator().manual_seed(0)
    )
    return activation_importance(model, ids, head=head)


@torch.no_grad()
def activation_importance(
    model: nn.Module, token_ids: torch.Tensor, block_size: int = 16, *, head: bool = True
) -> dict[str, torch.Tensor]:
    """Mean squared input of every ``nn.Linear`` per input channel over one prefill of ``token_ids`` [T]
    through an engine ``Transformer``: how much each weight column's error costs (AWQ's observation that
    a few input channels carry most of the activation energy). The KV cache is borrowed and put back.
    ``head=False`` leaves out the output layer (``lm_head``), whose product is a fifth of the prefill."""
    from engine.model import AttentionMetadata, PrefillChunk, attention_metadata

    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def record(_: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                sums[name] = sums.get(name, 0) + x.square().sum(0)

            hooks.append(module.register_forward_pre_hook(record))
    n = int(token_ids.numel())
    blocks = -(-n // block_size)
    attns = [layer.self_attn for layer in model.layers]
    saved = [(a.k_cache, a.v_cache) for a in attns]
    param = model.embed_tokens.weight
    try:
        model.allocate_kv_cache(blocks, block_size, param.dtype, param.device)
        table = torch.arange(blocks, dtype=torch.int32, device=param.device)
        positions = torch.arange(n, device=param.device)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=positions,
            num_decodes=0,
            block_tables=None,
            context_lens=None,
            max_context_len=n,
            prefills=[PrefillChunk(start=0, length=n, context_len=n, block_table=table)],
            block_size=block_size,
        )
        with attention_metadata(meta):
            hidden = model(token_ids.to(param.device).reshape(-1))
        if head:
            model.lm_head(hidden)  # the head's input too (its forward is not part of ``model(...)``)
    finally:
        for hook in hooks:
            hook.remove()
        for a, (k, v) in zip(attns, saved, strict=True):
            a.k_cache, a.v_cache = k, v
    return {name: total / n for name, total in sums.items()}


def save_quantized(
    model: nn.Module, directory: str | Path, *, metadata: dict[str, Any] | None = None
) -> Path:
    """Write ``model.safetensors`` (every tensor, quantized ones in the portable layout) and
    ``quantization.json`` (scheme, swapped modules, and ``metadata``, e.g. the model config)."""
    from safetensors.torch import save_file

    scheme: QuantScheme | None = getattr(model, "quant_scheme", None)
    if scheme is None:
        raise ValueError("model is not quantized; call quantize_model first")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    # tied weights appear under two names; safetensors refuses shared storage, so store each tensor once
    seen: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in seen and state[seen[key]].shape == t.shape:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(directory / CHECKPOINT_FILE))
    info = {
        "format_version": FORMAT_VERSION,
        "scheme": str(scheme),
        "method": scheme.method,
        "group_size": scheme.group_size,
        "modules": dict(getattr(model, "quantized_modules", {})),  # name -> scheme
        "aliases": aliases,
        "metadata": metadata or {},
    }
    (directory / SCHEME_FILE).write_text(json.dumps(info, indent=2, default=str) + "\n")
    return directory


def read_scheme(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / SCHEME_FILE).read_text())


def load_quantized(model: nn.Module, directory: str | Path) -> nn.Module:
    """Load a ``save_quantized`` directory into ``model``, a float skeleton of the same architecture
    (its weights are never read: build it on the ``meta`` device to skip allocating them)."""
    from safetensors.torch import load_file

    info = read_scheme(directory)
    if info.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"unsupported quantized checkpoint format {info.get('format_version')!r}")
    scheme = QuantScheme.parse(info["scheme"])
    modules = {name: QuantScheme.parse(spec) for name, spec in info["modules"].items()}
    # safetensors hands out views at arbitrary file offsets; PyTorch's packed CPU kernels read with
    # aligned vector loads and crash on those, so give every tensor its own (64-byte aligned) storage
    state = {k: v.clone() for k, v in load_file(str(Path(directory) / CHECKPOINT_FILE)).items()}
    for alias, name in info.get("aliases", {}).items():
        state[alias] = state[name]

    def make(name: str, linear: nn.Linear) -> nn.Module:
        method = modules[name]
        dtype = state[f"{name}.scales" if method.method == "int8" else f"{name}.scales_and_zeros"].dtype
        args = (linear.in_features, linear.out_features, linear.bias is not None)
        if method.method == "int8":
            return Int8Linear(*args, dtype=dtype, device="cpu")
        return Int4Linear(
            *args, group_size=method.group_size or DEFAULT_INT4_GROUP_SIZE, dtype=dtype, device="cpu"
        )

    swapped = _swap_linears(model, make, modules.__contains__)
    if set(swapped) != set(modules):
        raise ValueError(
            f"checkpoint quantizes modules this model lacks: {sorted(set(modules) - set(swapped))[:5]}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.use_cpu_layout()
    model.quant_scheme = scheme
    model.quantized_modules = {name: str(spec) for name, spec in modules.items()}
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers, each storage counted once (tied weights share one)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if t.device.type == "meta" or ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def config_metadata(model: nn.Module) -> dict[str, Any]:
    """The engine model's config as JSON-able metadata for ``save_quantized``."""
    config = getattr(model, "config", None)
    return {"model_config": dataclasses.asdict(config)} if dataclasses.is_dataclass(config) else {}


def build_quantized_model(
    directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> nn.Module:
    """An engine ``Transformer`` straight from a quantized checkpoint saved with ``config_metadata``:
    the float weights are never materialised (the skeleton lives on the meta device)."""
    from engine.config import ModelConfig
    from engine.model import Transformer

    raw = read_scheme(directory)["metadata"].get("model_config")
    if raw is None:
        raise ValueError(f"{directory} has no model_config; save with metadata=config_metadata(model)")
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids") or ())
    config = ModelConfig(**raw)
    with torch.device("meta"):
        model = Transformer(config)
    load_quantized(model, directory)
    model.rotary = type(model.rotary)(config)  # computed buffers, not stored
    if dtype is not None:
        model.to(dtype=dtype)
        model.rotary.float()
    return model.to(device).eval()
