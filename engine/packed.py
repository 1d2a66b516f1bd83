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

Like quantization, this is a module swap after loading: the model code does not change, and anything
already swapped (a quantized linear) is left alone.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PACK_BATCH_HINT = 32  # the row count oneDNN tunes the layout for; others run on it too


def packing_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight lives only in oneDNN's blocked layout (no second copy)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # non-persistent: the blocked layout is a property of this machine, never of a checkpoint
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT), persistent=False
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features).contiguous(), self.packed, self.bias, "none", [], ""
        )
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


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


def pack_linears(model: nn.Module, mode: str = "auto") -> int:
    """Lay out every plain CPU `nn.Linear` of `model` for fast CPU matmuls. Returns how many changed.

    mode: "auto" swaps bfloat16/float16 linears for `PackedLinear` (faster at every row count) and
    stores float32 weights column-major (faster at every row count up to a prefill); "on" packs float32
    for oneDNN too (faster for batches of 5-30 rows, slower for a lone stream); "off" changes nothing.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"unknown packing mode {mode!r}; choose auto, on or off")
    if mode == "off":
        return 0
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
    ]
    changed = 0
    if mode == "auto":
        changed = sum(column_major(child) for _, _, child in linears if child.weight.dtype == torch.float32)
    if not packing_available():
        return changed
    targets: list[tuple[nn.Module, str, nn.Linear]] = [
        (parent, name, child)
        for parent, name, child in linears
        if child.weight.dtype in (torch.bfloat16, torch.float16)
        or (mode == "on" and child.weight.dtype == torch.float32)
    ]
    if not targets:
        return changed
    parent, name, first = targets[0]
    try:
        ok = _matches(first, PackedLinear(first))
    except RuntimeError as exc:  # oneDNN without support for this dtype on this CPU
        log.info("weight packing unavailable here (%s); using F.linear", exc)
        return changed
    if not ok:
        log.warning("packed linear disagrees with F.linear on this machine; using F.linear")
        return changed
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return changed + len(targets)
