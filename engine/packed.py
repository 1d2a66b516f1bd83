"""Linear layers over weights laid out once at load for the CPU's matmul libraries.

`F.linear` hands each call a plain row-major weight, and the CPU matmul library re-blocks it, or falls
back to a slow path for the small row counts of decoding (1 row per sequence, k+1 for speculation, 32
for a batch). Packing the weight once at load into oneDNN's blocked layout (what inductor's CPU freezing
pass does) skips that work on every call. Measured on this project's AMX/AVX-512 CPU, one thread,
bfloat16: the 576x1536 projection 0.16 -> 0.08 ms for one row, the 49152-wide head 9.2 -> 7.8 ms for one
row and 11.4 -> 8.8 ms for 32 rows, prefill no slower. In float32 the packed path wins from about 6 rows
up but loses 10-20% on the single-row decode that bounds a lone stream.

Float32 instead stores each weight column-major (the transpose made contiguous, viewed back as
[out, in]): `F.linear` then hands MKL an [in, out] row-major operand, whose kernels for few rows stream
it faster than the row-major one. Measured on the same CPU, one thread, SmolLM2-135M's linears per
decode step: 1 row 29.9 -> 26.0 ms, 5 rows (a speculative verification) 63 -> 45 ms, 8 rows 89 -> 48 ms,
32 rows 119 -> 97 ms, 256 rows the same. Nothing else changes: same module, same values, same shape,
and a tied embedding keeps sharing the weight (a lookup from the column-major table is a strided
gather: ~10 ms more for a 1024-token prompt, nothing for a decode step).

On CPUs where MKL's few-row float32 kernels are weak (measured on a 2-core AMD EPYC/AVX2 VM: 5 rows
cost 6x one row column-major, 2.2x one row oneDNN-packed), float32 linears keep both layouts
(`DualLinear`): column-major for one row, oneDNN-packed for more (speculative verification, small
batches). That doubles float32 weight memory, so `auto` does it only where a quick measurement at load
shows oneDNN at least 1.15x faster for 4 rows; `dual` forces it. Where oneDNN also wins for one row and
for prefills (AVX-512 AMD EPYC), `auto` keeps the packed copy alone (`PackedLinear`).

Like quantization, this is a module swap after loading: the model code does not change, and anything
already swapped (a quantized linear) is left alone.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import weights_changed

log = logging.getLogger(__name__)

PACK_BATCH_HINT = 32  # the row count oneDNN tunes the layout for; others run on it too

# DualLinear goes back to MKL over the column-major weight from this many rows (a prefill chunk, a large
# batch) on CPUs where MKL matches oneDNN there (`mkl_min_rows`): on the 2-core AVX2 AMD EPYC (Zen 3) MKL
# matched or beat oneDNN on every SmolLM2 layer but the head (one thread, 128 rows: qkv 3.15 vs 3.73 ms,
# o 1.20 vs 1.52, gate_up 6.33 vs 6.52, down 2.86 vs 3.28; a whole 1,024-token prefill on two threads
# tied). On AMD CPUs with AVX-512 (Zen 5) MKL still runs its AVX2 kernels while oneDNN uses AVX-512, and
# oneDNN is 2.2-2.4x faster at 128-1,024 rows, so there multi-row steps stay on oneDNN. A vocabulary-wide
# head (WIDE_OUT+ outputs) stays on oneDNN everywhere, 10-20% faster there at 64-512 rows even on Zen 3.
MKL_MIN_ROWS = 128
WIDE_OUT = 16384


def packing_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack `dtype` weights on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    if not packing_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: int
) -> torch.Tensor:
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, shape[-1]).contiguous(), packed, bias, "none", [], ""
    )
    return y.view(*shape[:-1], out)


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight lives only in oneDNN's blocked layout (no second copy), unless another
    module holds the same weight (`keep_weight`: a head tied to the embedding), where keeping a
    reference costs nothing and keeps the tie visible to checkpoints and quantization."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # non-persistent: the blocked layout is a property of this machine, never of a checkpoint
        self.register_buffer("packed", _packed_weight(linear.weight), persistent=False)
        self.bias = linear.bias
        self.weight: nn.Parameter | None = None
        if keep_weight:
            # nn.Linear's stubs say Tensor, but its registered weight can only be a Parameter
            self.weight = cast(nn.Parameter, linear.weight)
            self._packed_version = linear.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.weight._version != self._packed_version:
            # the shared weight changed in place (a load into the embedding): the copy follows
            self.packed = _packed_weight(self.weight)
            self._packed_version = self.weight._version
        return _onednn_linear(x, self.packed, self.bias, self.out_features)

    def to_linear(self) -> nn.Linear:
        """A plain `nn.Linear` of this weight again (the shared Parameter where one is kept; else
        oneDNN's layout converted back, which is exact)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight = self.weight if self.weight is not None else nn.Parameter(self.packed.to_dense())
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


class DualLinear(nn.Linear):
    """float32 `nn.Linear` with two layouts of one weight: column-major for a single row (MKL's GEMV
    streams it fastest, except where `onednn_wins_for_one_row`) and, where MKL matches oneDNN there
    (`mkl_min_rows`), for MKL_MIN_ROWS+ rows; oneDNN-packed for the rest (far faster than MKL there on
    some CPUs; on an AVX-512 AMD EPYC, where MKL runs AVX2 code, at every row count). Still an
    `nn.Linear` with the same weight Parameter, so quantization and anything else that looks for
    linears sees it as one (the packed copy goes with the module)."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a fresh weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        column_major(linear)
        self.weight = linear.weight  # the same Parameter: a tied embedding keeps sharing it
        self.bias = linear.bias
        self.register_buffer("packed", _packed_weight(linear.weight), persistent=False)
        self._packed_version = self.weight._version
        self.mkl_min_rows = mkl_min_rows()
        self.mkl_one_row = not onednn_wins_for_one_row()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (rows == 1 and self.mkl_one_row) or (rows >= self.mkl_min_rows and self.out_features < WIDE_OUT):
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self._packed_version:
            # the weight changed in place since it was packed (load_state_dict, a tied embedding's
            # update): the copy follows, or the two layouts would disagree
            self.packed = _packed_weight(self.weight)
            self._packed_version = self.weight._version
        return _onednn_linear(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, packed=column+onednn"


def _best_thread_time(fn: Callable[[], object], rounds: int, inner: int = 1) -> float:
    """Best of `rounds` of `inner` calls of `fn`, in CPU seconds of this thread on one torch thread, so
    other processes' load hardly moves it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        with torch.inference_mode():
            for _ in range(rounds):
                start = time.thread_time()
                for _ in range(inner):
                    fn()
                times.append(time.thread_time() - start)
        return min(times)
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _onednn_speedup(rows: int, in_features: int, out_features: int, inner: int = 4) -> float:
    """MKL over a column-major weight / oneDNN-packed, at `rows` rows (`_best_thread_time`, best of 5)."""
    weight = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    packed = _packed_weight(weight)
    column = weight.t().contiguous().t()
    mkl = _best_thread_time(lambda: F.linear(x, column), 5, inner)
    onednn = _best_thread_time(lambda: _onednn_linear(x, packed, None, out_features), 5, inner)
    log.debug(
        "float32 at %d rows: MKL column-major %.3f ms, oneDNN %.3f ms",
        rows,
        mkl * 1e3 / inner,
        onednn * 1e3 / inner,
    )
    return mkl / onednn


def onednn_wins_for_few_rows(rows: int = 4, in_features: int = 512, out_features: int = 4096) -> bool:
    """Whether oneDNN-packed float32 beats MKL over a column-major weight by 1.15x at `rows` rows on this
    CPU (a wide layer, as a vocabulary head or an MLP up-projection, where the gap shows most; ~40 ms).

    The bar sits between the CPUs measured: MKL/oneDNN 0.88 on the AMX Xeon (5 rows), 1.36-1.60 on the
    AVX2 EPYC (4 rows, six probes on a quiet machine). At 1.3 the EPYC's verdict flipped under load."""
    return _onednn_speedup(rows, in_features, out_features) >= 1.15


@functools.cache
def mkl_min_rows() -> int:
    """From how many rows `DualLinear` runs on MKL again: MKL_MIN_ROWS where MKL over the column-major
    weight is within 1.1x of oneDNN at that many rows, else never. Measured MKL/oneDNN at 128 rows:
    0.85-0.98 on the AVX2 EPYC (Zen 3), 2.2-2.4 on the AVX-512 EPYC (Zen 5), where MKL runs AVX2 code
    (~20 ms)."""
    speedup = _onednn_speedup(MKL_MIN_ROWS, 512, 1024, inner=2)
    return MKL_MIN_ROWS if speedup < 1.1 else sys.maxsize


@functools.cache
def onednn_wins_for_one_row(in_features: int = 2048, out_features: int = 1024, layers: int = 6) -> bool:
    """Whether oneDNN-packed float32 streams one row through weights that do not fit in cache 1.1x faster
    than MKL over column-major ones, as a decode step reads them (`layers` distinct weights, 48 MB by
    default; one thread, CPU time, best of 3; 0.2-0.6 s). Measured MKL/oneDNN on SmolLM2's 121 linears, one
    row, one thread: 0.7 on the AVX2 EPYC (Zen 3; 38 vs 54 ms), 1.24 on the AVX-512 EPYC (Zen 5; 18.8
    vs 15.2 ms)."""
    weights = [torch.full((out_features, in_features), 0.5) for _ in range(layers)]
    packed = [_packed_weight(w) for w in weights]
    columns = [w.t().contiguous().t() for w in weights]
    del weights
    x = torch.rand(1, in_features)
    mkl = _best_thread_time(lambda: [F.linear(x, w) for w in columns], 3)
    onednn = _best_thread_time(lambda: [_onednn_linear(x, w, None, out_features) for w in packed], 3)
    log.debug("float32 at 1 row, streamed: MKL column-major %.2f ms, oneDNN %.2f ms", mkl * 1e3, onednn * 1e3)
    return onednn * 1.1 <= mkl


def onednn_serves_every_row_count() -> bool:
    """Whether oneDNN-packed float32 is the faster path at one row and at MKL_MIN_ROWS+ rows too, so a
    `DualLinear` here would only ever use its packed copy (the AVX-512 AMD EPYC, Zen 5)."""
    return onednn_wins_for_one_row() and mkl_min_rows() == sys.maxsize


def _matches(linear: nn.Linear, packed: PackedLinear) -> bool:
    """One check per model that the packed path computes what F.linear does (a wrong oneDNN build or
    an unsupported dtype must fall back, not serve garbage)."""
    x = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
    with torch.inference_mode():
        want, got = linear(x).float(), packed(x).float()
    tol = 2e-2 if linear.weight.dtype in (torch.bfloat16, torch.float16) else 1e-4
    return torch.allclose(want, got, rtol=tol, atol=tol * want.abs().max().item())


def column_major(linear: nn.Linear) -> bool:
    """Store `linear`'s weight transposed in memory, in place (the tensor keeps its shape and values)."""
    weight = linear.weight
    if weight.stride() == (1, weight.shape[0]):
        return False
    weight.data = weight.detach().t().contiguous().t()
    return True


PACKING_MODES = ("auto", "dual", "on", "off")


def pack_linears(model: nn.Module, mode: str = "auto") -> int:
    """Lay out every plain CPU `nn.Linear` of `model` for fast CPU matmuls. Returns how many changed.

    mode: "auto" swaps bfloat16/float16 linears for `PackedLinear` (faster at every row count) and
    stores float32 weights column-major (faster at every row count up to a prefill), as `DualLinear`
    where oneDNN is measured much faster for few rows (which of the two serves one row and many rows is
    measured too: `onednn_wins_for_one_row`, `mkl_min_rows`), and as `PackedLinear` alone where oneDNN
    wins at every row count (`onednn_serves_every_row_count`); "dual" always makes float32 `DualLinear`; "on"
    packs float32 for oneDNN only (faster for batches, slower for a lone stream); "off" changes nothing.
    """
    changed = _pack_linears(model, mode)
    if changed:
        weights_changed(model)
    return changed


def _pack_linears(model: nn.Module, mode: str) -> int:
    if mode not in PACKING_MODES:
        raise ValueError(f"unknown packing mode {mode!r}; choose one of {', '.join(PACKING_MODES)}")
    if mode == "off":
        return 0
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
    ]
    fp32 = [item for item in linears if item[2].weight.dtype == torch.float32]
    half = [item for item in linears if item[2].weight.dtype in (torch.bfloat16, torch.float16)]
    changed = 0
    if not packing_available():
        return sum(column_major(child) for _, _, child in fp32) if mode in ("auto", "dual") else 0
    # weights another module holds too (a head tied to the embedding)
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(False)}

    def packed(linear: nn.Linear) -> PackedLinear:
        return PackedLinear(linear, keep_weight=id(linear.weight) in shared)

    changed += _swap(half, packed)
    if mode == "on":
        return changed + _swap(fp32, packed)
    if fp32 and (mode == "dual" or onednn_wins_for_few_rows()):
        if mode == "auto" and onednn_serves_every_row_count():
            # DualLinear would never read its plain weight here: dropping it saves a copy of every
            # weight (430 MB for SmolLM2-135M; a tied embedding keeps its own, row-major as loaded)
            return changed + _swap(fp32, packed)
        dual = _swap(fp32, DualLinear)
        if dual:
            return changed + dual
    return changed + sum(column_major(child) for _, _, child in fp32)


def unpack_linears(model: nn.Module) -> int:
    """Turn every `PackedLinear` of `model` back into an `nn.Linear` (for a pass that looks for linears,
    as quantization does). Returns how many changed."""
    packed = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, PackedLinear)
    ]
    for parent, name, child in packed:
        setattr(parent, name, child.to_linear())
    if packed:
        weights_changed(model)
    return len(packed)


def _swap(targets: list[tuple[nn.Module, str, nn.Linear]], cls: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every target by `cls(target)` if the first one computes what F.linear does, else none."""
    if not targets:
        return 0
    first = targets[0][2]
    try:
        ok = _matches(first, PackedLinear(first))
    except RuntimeError as exc:  # oneDNN without support for this dtype on this CPU
        log.info("weight packing unavailable here (%s); using F.linear", exc)
        return 0
    if not ok:
        log.warning("packed linear disagrees with F.linear on this machine; using F.linear")
        return 0
    for parent, name, child in targets:
        setattr(parent, name, cls(child))
    return len(targets)
