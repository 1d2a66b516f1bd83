"""Weight quantization as a module swap (gpt-fast style): the model code never learns about it.

``quantize_model(model, "int8" | "int4" | "int4-g32" | "int4-g64" | "int4-g128" | "fp8")`` replaces every
``nn.Linear`` with ``Int8Linear`` (per-output-channel symmetric), ``Int4Linear`` (group-wise with scales
and zero points, two values per byte) or ``Fp8Linear`` (e4m3, per output channel; fast on GPUs with
fp8, compute capability 8.9+). ``save_quantized``/``load_quantized`` write and read a
``model.safetensors`` plus ``quantization.json`` that needs no original checkpoint. The matmuls live in
``kernels/`` (Triton on CUDA, PyTorch's packed CPU kernels where this build has them, else a reference):
weight-only everywhere except int8 on x86 CPUs, which runs fbgemm's int8 x int8 kernels on ~13-bit
activation rows (``Int8Linear``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from engine.model import weights_changed
from engine.packed import unpack_linears
from weir.kernels._triton import use_triton
from weir.kernels.fp8_matmul import fp8_matmul, quantize_fp8
from weir.kernels.int4_matmul import (
    cpu_int4_supported,
    int4_matmul,
    int4_matmul_cpu,
    pack_int4,
)
from weir.kernels.int8_matmul import (
    fbgemm_pack,
    fbgemm_supported,
    fbgemm_unpack,
    int8_matmul,
    int8_matmul_fbgemm,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_INT4_GROUP_SIZE = 32
GROUP_SIZES = (32, 64, 128)
CHECKPOINT_FILE = "model.safetensors"
SCHEME_FILE = "quantization.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "none" | "int8" | "int4" | "fp8"
    group_size: int | None = None  # int4 only

    @classmethod
    def parse(cls, spec: str | QuantScheme) -> QuantScheme:
        """``none``, ``int8``, ``int4`` (group 32), ``int4-g32``, ``int4-g64``, ``int4-g128``, ``fp8``."""
        if isinstance(spec, QuantScheme):
            return spec
        m = re.fullmatch(r"(none|int8|int4|fp8)(?:-g(\d+))?", spec.strip().lower())
        if not m or (m[2] and m[1] != "int4"):
            raise ValueError(
                f"unknown quantization {spec!r}: use none, int8, int4, int4-g{{32,64,128}} or fp8"
            )
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
    w = weight.detach().contiguous()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scales = torch.empty(n, dtype=torch.float32, device=w.device)

    def fit(r: int) -> None:
        chunk = w[r : r + rows].float()
        s = (chunk.abs().amax(dim=1) / 127).clamp_(min=1e-12)
        scales[r : r + rows] = s
        q[r : r + rows] = (chunk / s[:, None]).round_().clamp_(-127, 127)

    # one pass per cache-sized chunk instead of five over a 113 MB head (same values either way)
    rows = _chunk_rows(k) if w.device.type == "cpu" else n
    _parallel_chunks(fit, range(0, n, rows))
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


# torch runs an op on fewer than this many elements on the calling thread (at::internal::GRAIN_SIZE),
# so chunks below it need no change to torch's (process-wide) thread count to stay single-threaded
_SERIAL_ELEMENTS = 32768


def _chunk_rows(k: int) -> int:
    """Rows of width ``k`` per chunk: small enough that every op on it runs serially and stays in cache."""
    return max(1, (_SERIAL_ELEMENTS - 1) // k)


def _parallel_chunks(fn: Callable[[int], None], starts: Iterable[int]) -> None:
    """``fn(start)`` for every start, on as many Python threads as torch has intra-op threads (its
    kernels release the GIL). Each chunk's ops are too small for torch to split across threads, which
    on a busy machine made every op wait for its slowest thread (~4x slower than one thread). torch's
    thread count is left alone: it is process-wide, and a thread that first runs torch while it is
    lowered keeps the lowered count for good."""
    starts = list(starts)
    workers = min(torch.get_num_threads(), len(starts))
    if workers <= 1:
        for start in starts:
            fn(start)
        return
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(fn, starts):  # re-raises the first error
            pass


def _off_grid(w: torch.Tensor) -> torch.Tensor:
    """Rows of ``w`` [R, G] that min/max scaling does not reproduce: a row whose values already sit on
    16 evenly spaced levels from its min to its max (weights that were int4 before, e.g. a dequantised
    GGUF Q4 tensor at this group size) has no error under min/max, so no search can improve on it."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)  # aminmax(dim) parallelises badly
    step = ((hi - lo) / 15).clamp_(min=1e-12)
    t = (w - lo).div_(step)
    return (t - t.round()).abs_().amax(-1) > 1e-3


def _on_int4_grid(weight: torch.Tensor, group_size: int) -> bool:
    """Whether every group of ``weight`` [N, K] (K a multiple of ``group_size``) is on its min/max grid."""
    n, k = weight.shape
    if k % group_size or not weight.is_cpu:
        return False
    rows = _chunk_rows(k)
    off = False

    def check(r: int) -> None:
        nonlocal off
        if not off:  # the first off-grid chunk settles it; the rest return at once
            off = bool(_off_grid(weight[r : r + rows].float().reshape(-1, group_size)).any())

    _parallel_chunks(check, range(0, n, rows))
    return not off


def quantize_int4(
    weight: torch.Tensor, group_size: int, *, search: bool = True, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per group of ``group_size`` inputs onto 16 levels.

    ``search=False``: each group's [min, max] maps onto the 16 levels. ``search=True`` (default): a
    per-group scale/offset search that minimises the reconstruction error (``_fit_int4_groups``), weighted
    per input channel by ``importance`` [K] when given (e.g. mean squared activations, AWQ-style); groups
    that min/max already reproduces exactly skip it. Returns ``qweight`` uint8 ``[N, Kp // 2]`` and
    ``scales_and_zeros`` ``[Kp // group, N, 2]`` with ``w ~= (q - 8) * scale + zero`` (the tinygemm
    convention); K is zero-padded up to the group size and the padding (never multiplied by real inputs)
    does not count in the search.
    """
    q, scales_and_zeros = _quantize_int4_values(weight, group_size, search, importance, torch.uint8)
    return pack_int4(q), scales_and_zeros


def _quantize_int4_values(
    weight: torch.Tensor,
    group_size: int,
    search: bool,
    importance: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int4`` without the packing: q ``[N, Kp]`` in ``dtype`` (int32 is what PyTorch's CPU
    int4 packing takes, so that path never packs and unpacks our layout) and ``scales_and_zeros``."""
    n, k = weight.shape
    kp = -(-k // group_size) * group_size
    groups = kp // group_size
    w = weight.detach()
    if kp != k:
        w = torch.nn.functional.pad(w, (0, kp - k))
    imp = None
    if search:
        imp = torch.ones(k) if importance is None else importance.float().cpu().clamp(min=0)
        imp = torch.nn.functional.pad(imp.to(w.device), (0, kp - k)).view(1, groups, group_size)
    q = torch.empty(n, kp, dtype=dtype, device=w.device)
    scales = torch.empty(n, groups, device=w.device)
    lo = torch.empty_like(scales)

    def fit(r: int) -> None:
        chunk = w[r : r + rows].float().view(-1, groups, group_size)
        flat = chunk.reshape(-1, group_size)
        if imp is None:
            lo_c, hi_c = flat.amin(-1), flat.amax(-1)
            s_c = ((hi_c - lo_c) / 15).clamp_(min=1e-12)
        else:
            imps = imp.expand_as(chunk).reshape(-1, group_size)
            # padded groups (K not a multiple of the group) never sit on a grid that spans their zeros
            todo = _off_grid(flat) if kp == k else torch.ones(len(flat), dtype=torch.bool, device=w.device)
            if bool(todo.all()):
                s_c, lo_c = (t.squeeze(-1) for t in _fit_int4_groups(flat, imps))
            else:
                lo_c, hi_c = flat.amin(-1), flat.amax(-1)
                s_c = ((hi_c - lo_c) / 15).clamp_(min=1e-12)
                if bool(todo.any()):
                    idx = todo.nonzero().squeeze(-1)
                    s_t, lo_t = _fit_int4_groups(flat[idx], imps[idx])
                    s_c[idx], lo_c[idx] = s_t.squeeze(-1), lo_t.squeeze(-1)
        scales[r : r + rows], lo[r : r + rows] = s_c.view(-1, groups), lo_c.view(-1, groups)
        qc = (flat - lo_c[:, None]).div_(s_c[:, None]).round_().clamp_(0, 15)
        q[r : r + rows] = qc.view(-1, kp)

    # a GPU wants few, large launches; on CPU chunks that stay in cache (the search makes ~100 passes
    # over each), one single-threaded chunk per torch thread at a time (``_parallel_chunks``)
    rows = _chunk_rows(kp) if w.device.type == "cpu" else max(1, (1 << 24) // kp)
    if w.device.type == "cpu":
        _parallel_chunks(fit, range(0, n, rows))
    else:
        for r in range(0, n, rows):
            fit(r)
    zeros = lo + 8 * scales
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous().to(weight.dtype)
    return q, scales_and_zeros


@functools.lru_cache(maxsize=8)
def _cpu_layout_source(n: int, kp: int) -> torch.Tensor:
    """For every nibble of PyTorch's CPU int4 layout of an [n, kp] weight, the flat index of the value it
    holds: learned by packing the bits of each element's own index, 4 at a time (the order is PyTorch's
    private business), as ``kernels.int4_matmul.from_cpu_layout`` does, but once per shape (a model has a
    handful of shapes and a hundred layers; probing each layer made saving SmolLM2 take minutes)."""
    index = torch.arange(n * kp, dtype=torch.int32).view(n, kp)
    source = torch.zeros(n * kp, dtype=torch.int32)
    for shift in range(0, max(n * kp - 1, 1).bit_length(), 4):
        probe = torch.ops.aten._convert_weight_to_int4pack_for_cpu((index >> shift) & 15, 1)
        source |= torch.stack([probe & 15, probe >> 4], -1).flatten().int() << shift
    return source


def _from_cpu_layout(packed: torch.Tensor) -> torch.Tensor:
    """Our packed layout from PyTorch's CPU one (``kernels.int4_matmul.from_cpu_layout``, cached)."""
    n, kp = packed.shape[0], packed.shape[1] * 2
    values = torch.empty(n * kp, dtype=torch.uint8)
    values[_cpu_layout_source(n, kp).long()] = torch.stack([packed & 15, packed >> 4], -1).flatten().cpu()
    return pack_int4(values.view(n, kp)).to(packed.device)


def _int4pack_for_cpu(q: torch.Tensor) -> torch.Tensor:
    """int32 values in [0, 15] ``[N, Kp]`` -> PyTorch's CPU int4 layout (what ``to_cpu_layout`` gives)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)


class _RowScaledLinear(nn.Module):
    """A linear layer held as one byte per weight, ``weight [N, K]``, and one scale per output row."""

    # registered as buffers, which nn.Module's stubs cannot see
    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        weight_dtype: torch.dtype,
        scale_dtype: torch.dtype,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=weight_dtype, device=device)
        )
        self.register_buffer("scales", torch.empty(out_features, dtype=scale_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def _take_bias(self, linear: nn.Linear) -> None:
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Int8Linear(_RowScaledLinear):
    """``weight`` (int8) and ``scales`` are the portable layout and always what the state dict holds. On
    x86 CPUs the weight moves into fbgemm's packed layout instead (``cpu_layout``, ``use_cpu_layout``):
    its int8 x int8 kernels are 6-10x faster there than any weight-only int8 path PyTorch has, at the
    price of rounding each activation row to ~13 bits of its own absolute max, as two 7-bit rows
    (``kernels.int8_matmul``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, torch.int8, dtype, dtype, device)
        self.cpu_layout = False
        self._packed: Any = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, cpu_layout: bool = False) -> Int8Linear:
        w = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        module.weight, module.scales = quantize_int8(w)
        module._take_bias(linear)
        module.use_cpu_layout(cpu_layout)
        return module

    def use_cpu_layout(self, enable: bool = True) -> None:
        if enable and not self.cpu_layout and self.weight.is_cpu and fbgemm_supported():
            self._packed = fbgemm_pack(self.weight, self.scales)
            # the packed copy is the only one kept: an empty placeholder holds the buffer's place
            self.weight, self.cpu_layout = self.weight.new_empty(0), True
        elif not enable and self.cpu_layout:
            self.weight = fbgemm_unpack(self._packed)[0].to(self.scales.device)
            self._packed, self.cpu_layout = None, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_layout and x.is_cpu and not use_triton(x):
            y = int8_matmul_fbgemm(x, self._packed)
        else:
            self.use_cpu_layout(False)  # moved off the CPU (or onto Triton): back to the portable layout
            y = int8_matmul(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def portable_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 weight [out, in], fp32 scales [out]) in the portable layout, whichever layout is held."""
        if self.cpu_layout:
            return fbgemm_unpack(self._packed)
        return self.weight, self.scales.float()

    def packed_bytes(self) -> int:
        """Bytes of the fbgemm copy (not a tensor, so ``weight_bytes`` cannot see it): one per weight."""
        return self.in_features * self.out_features if self.cpu_layout else 0

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.cpu_layout:
            destination[prefix + "weight"] = self.portable_weight()[0]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        was_cpu_layout = self.cpu_layout
        if was_cpu_layout:  # the incoming weight is the portable layout: give it a buffer of its shape
            self.weight = self.weight.new_empty(self.out_features, self.in_features)
            self._packed, self.cpu_layout = None, False
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.use_cpu_layout(was_cpu_layout)


class Fp8Linear(_RowScaledLinear):
    """e4m3 weights, one fp32 scale per output row (``kernels/fp8_matmul.py``). ``weight`` holds the
    e4m3 bytes as uint8, so ``Module.to(dtype)`` leaves it alone (torch would cast a float8 tensor)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, torch.uint8, torch.float32, dtype, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        w = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        module.weight, module.scales = quantize_fp8(w)
        module._take_bias(linear)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_matmul(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """``qweight`` is kept in exactly one layout: ours, or tinygemm's on CPU when this PyTorch has the
    kernel (``cpu_layout``). The state dict is always ours, so checkpoints do not depend on the build."""

    # registered as buffers, which nn.Module's stubs cannot see
    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor

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
        cpu_layout: bool = False,
    ) -> Int4Linear:
        """``cpu_layout``: hold the weight in PyTorch's CPU kernel layout where it can (``use_cpu_layout``),
        converted straight from the quantized values rather than through our packed layout."""
        w = linear.weight.detach()
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, group_size, w.dtype, w.device
        )
        cpu_layout = cpu_layout and w.is_cpu and cpu_int4_supported(module.out_features, w.dtype)
        q, module.scales_and_zeros = _quantize_int4_values(
            w, group_size, search, importance, torch.int32 if cpu_layout else torch.uint8
        )
        if cpu_layout:
            module.qweight, module.cpu_layout = _int4pack_for_cpu(q), True
        else:
            module.qweight = pack_int4(q)
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
            # ``to_cpu_layout`` unpacked through torch.stack; writing the two nibble planes into one
            # int32 tensor is the same values at a fraction of the cost (a checkpoint load does all layers)
            q = torch.empty(self.qweight.shape[0], self.qweight.shape[1] * 2, dtype=torch.int32)
            q[:, 0::2], q[:, 1::2] = self.qweight & 15, self.qweight >> 4
            self.qweight, self.cpu_layout = _int4pack_for_cpu(q), True
        elif not enable and self.cpu_layout:
            self.qweight, self.cpu_layout = _from_cpu_layout(self.qweight), False

    def portable_qweight(self) -> torch.Tensor:
        """``qweight`` in the portable packed layout (``pack_int4``), whichever layout is held."""
        return _from_cpu_layout(self.qweight) if self.cpu_layout else self.qweight

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
            destination[prefix + "qweight"] = self.portable_qweight()

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
        return Int8Linear.from_linear(linear, cpu_layout=True)
    if scheme.method == "fp8":
        return Fp8Linear.from_linear(linear)
    return Int4Linear.from_linear(
        linear,
        scheme.group_size or DEFAULT_INT4_GROUP_SIZE,
        search=search,
        importance=importance,
        cpu_layout=True,
    )


def _mark_quantized(model: nn.Module, scheme: QuantScheme, modules: dict[str, str]) -> None:
    """Record on `model` what it was quantized with (`save_quantized` writes it; `quantize_model` refuses
    a model that has it), and note that its layers changed."""
    # nn.Module's stubs type every attribute assignment as Tensor | Module
    model.quant_scheme = scheme  # type: ignore[assignment]
    model.quantized_modules = modules  # type: ignore[assignment]
    weights_changed(model)


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
    unpack_linears(model)  # weights packed for oneDNN (engine/packed.py) are linears to quantize too

    def make(name: str, linear: nn.Linear) -> nn.Module:
        chosen[name] = head_scheme if name == "lm_head" else scheme
        if chosen[name].method == "none":
            return linear
        weights = importance.get(name) if isinstance(importance, dict) else None
        # min/max is exact on a grid layer: the search could only find the same fit again
        return _make_quantized(linear, chosen[name], search and name not in on_grid, weights)

    patterns = [re.compile(p) for p in skip]

    def include(name: str) -> bool:
        return not any(p.search(name) for p in patterns)

    on_grid: set[str] = set()
    off_grid = False
    if scheme.method == "int4" and search:
        on_grid, off_grid = _layers_on_grid(model, scheme, head_scheme, include)
    if importance == "auto":
        # the head's inputs only when the head is int4 too: its product is a fifth of the prefill
        importance = (
            _random_token_importance(model, head=head_scheme.method == "int4")
            if scheme.method == "int4" and search and off_grid
            else None
        )
    elif isinstance(importance, str):
        raise ValueError(f"importance must be a dict, 'auto' or None, not {importance!r}")
    with torch.no_grad():
        _swap_linears(model, make, include)
    _mark_quantized(model, scheme, {n: str(s) for n, s in chosen.items() if s.method != "none"})
    return model


def _layers_on_grid(
    model: nn.Module, scheme: QuantScheme, head: QuantScheme, include: Callable[[str], bool]
) -> tuple[set[str], bool]:
    """(names of linears that become int4 and whose groups all sit on their min/max grid already, e.g. a
    dequantised Q4 checkpoint at this group size; whether some int4 linear has an off-grid group). Grid
    layers need no search (min/max reproduces them exactly), so when no layer is off the grid the
    calibration prefill that weighs the search is skipped too; the first off-grid layer ends the scan."""
    on_grid: set[str] = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or not include(name):
                continue
            chosen = head if name == "lm_head" else scheme
            if chosen.method != "int4":
                continue
            if not _on_int4_grid(module.weight, chosen.group_size or DEFAULT_INT4_GROUP_SIZE):
                return on_grid, True
            on_grid.add(name)
    return on_grid, False


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
    from engine.model import AttentionMetadata, PrefillChunk, Transformer, attention_metadata

    net = cast(Transformer, model)  # an engine Transformer, as documented
    layers = net.decoder_layers

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
    attns = [layer.self_attn for layer in layers]
    saved = [(a.k_cache, a.v_cache) for a in attns]
    param = net.embed_tokens.weight
    try:
        net.allocate_kv_cache(blocks, block_size, param.dtype, param.device)
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
            hidden = net(token_ids.to(param.device).reshape(-1))
        if head:
            net.lm_head(hidden)  # the head's input too (its forward is not part of ``model(...)``)
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
        args = (linear.in_features, linear.out_features, linear.bias is not None)
        if method.method == "fp8":
            bias = state.get(f"{name}.bias")
            return Fp8Linear(*args, dtype=bias.dtype if bias is not None else torch.float32, device="cpu")
        dtype = state[f"{name}.scales" if method.method == "int8" else f"{name}.scales_and_zeros"].dtype
        if method.method == "int8":
            return Int8Linear(*args, dtype=dtype, device="cpu")
        return Int4Linear(
            *args, group_size=method.group_size or DEFAULT_INT4_GROUP_SIZE, dtype=dtype, device="cpu"
        )

    unpack_linears(model)
    swapped = _swap_linears(model, make, modules.__contains__)
    if set(swapped) != set(modules):
        raise ValueError(
            f"checkpoint quantizes modules this model lacks: {sorted(set(modules) - set(swapped))[:5]}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    for module in model.modules():
        if isinstance(module, Int4Linear | Int8Linear):
            module.use_cpu_layout()
    _mark_quantized(model, scheme, {name: str(spec) for name, spec in modules.items()})
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers, each storage counted once (tied weights share one)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta":
            continue
        if t.is_mkldnn:  # oneDNN's opaque packed layout (engine/packed.py) has no storage to look at
            seen.add(id(t))
            total += t.numel() * t.element_size()
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total + sum(m.packed_bytes() for m in model.modules() if isinstance(m, Int8Linear))


def config_metadata(model: nn.Module) -> dict[str, Any]:
    """The engine model's config as JSON-able metadata for ``save_quantized``."""
    config = getattr(model, "config", None)
    if not dataclasses.is_dataclass(config):
        return {}
    # is_dataclass accepts dataclass types too; a model's config is always an instance
    return {"model_config": dataclasses.asdict(cast("DataclassInstance", config))}


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
