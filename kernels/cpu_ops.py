"""Row-wise ops of the eager CPU forward in one native pass each (`cpu_ops.c`): RMSNorm, rotary embedding,
SiLU-times-up; and a prefill chunk's causal attention over the paged KV cache.

Each function takes what its PyTorch counterpart in engine/model.py takes and returns the same result,
or None where it does not apply (not a CPU tensor, not fp32 / bf16, rows not laid out as the C code
reads them, or no C compiler): the caller then runs the PyTorch op. `WEIR_CPU_OPS=0` switches them off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from weir.kernels import native

SOURCE = Path(__file__).with_name("cpu_ops.c")
_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C enum
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("WEIR_CPU_OPS", "1") == "0":
        return None
    lib = native.load(SOURCE, "native CPU row ops")
    if lib is None:
        return None
    for name, args in {
        "weir_rms_norm": [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _F32, _INT, _INT],
        "weir_rope": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _INT, _INT],
        "weir_silu_mul": [_PTR, _I64, _PTR, _I64, _I64, _INT, _INT],
        "weir_prefill_attention": [
            *[_PTR, _I64, _PTR, _PTR, _PTR, _I64],  # q, its row stride, k and v caches, block table, blocks
            *[_I64, _I64, _I64, _I64, _I64, _I64],  # context_len, n, block_size, heads, kv_heads, d
            *[_F32, _PTR, _INT, _INT],  # scale, out, type, threads
        ],
    }.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, args
    return lib


def _rows(x: torch.Tensor) -> bool:
    """A CPU tensor of rows the C code can walk: 2-D, unit stride along a row, of a supported type."""
    return x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and x.dtype in _TYPES


def _heads(x: torch.Tensor) -> bool:
    """A CPU tensor [rows, heads, d] of a supported type whose rows (any stride apart) hold their heads
    side by side: the q / k heads of a fused QKV output."""
    return (
        x.device.type == "cpu"
        and x.dim() == 3
        and x.dtype in _TYPES
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
    )


def _check(code: int, name: str) -> None:
    if code == 2:
        raise IndexError(
            f"{name}: an index out of range (a position past the tables, a block id past the cache)"
        )
    if code:
        raise RuntimeError(f"{name} failed ({'out of memory' if code == 3 else 'bad arguments'})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`F.rms_norm(x, (x.shape[-1],), weight, eps)` for x [rows, n]."""
    lib = library()
    if lib is None or not _rows(x) or weight.dtype != x.dtype or not weight.is_contiguous():
        return None
    rows, n = x.shape
    y = torch.empty(rows, n, dtype=x.dtype)
    code = lib.weir_rms_norm(
        x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), n, rows, n, eps, _TYPES[x.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    _check(code, "rms_norm")
    return y


def rope_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor | None:
    """In place, `x * cos[positions] + x.roll(d // 2, -1) * sin[positions]` for x [rows, heads, d] (rows
    may be strided: the q and k heads of a fused QKV output), with fp32 tables [max_pos, d]; returns x."""
    lib = library()
    if (
        lib is None
        or not _heads(x)
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
        or cos.dtype != torch.float32
        or cos.shape != sin.shape
        or cos.shape[1] != x.shape[2]
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        return None
    rows, heads, d = x.shape
    code = lib.weir_rope(
        x.data_ptr(), x.stride(0), rows, heads, d, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        cos.shape[0], _TYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    _check(code, "rope")
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`F.silu(gate) * up` for gate_up [rows, 2 * inter] = [gate | up]."""
    lib = library()
    if lib is None or not _rows(gate_up) or gate_up.shape[1] % 2:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    code = lib.weir_silu_mul(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, _TYPES[gate_up.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    _check(code, "silu_mul")
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor | None:
    """Causal attention of a prefill chunk's queries q [n, heads, d] (the last n of `context_len`
    positions) over its sequence's paged cache [blocks, block_size, kv_heads, d], which holds the chunk's
    keys and values already; returns [n, heads, d] (what engine/model.py's gather + SDPA computes)."""
    lib = library()
    if (
        lib is None
        or not _heads(q)
        or k_cache.dtype != q.dtype
        or v_cache.dtype != q.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.shape != v_cache.shape
        or k_cache.shape[3] != q.shape[2]
        or block_table.dtype != torch.int32
        or not block_table.is_contiguous()
    ):
        return None
    n, heads, d = q.shape
    blocks, block_size, kv_heads = k_cache.shape[:3]
    if block_table.numel() * block_size < context_len:
        raise IndexError("prefill_attention: the block table does not cover the context")
    out = torch.empty(n, heads, d, dtype=q.dtype)
    code = lib.weir_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), blocks,
        context_len, n, block_size, heads, kv_heads, d, scale, out.data_ptr(), _TYPES[q.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    _check(code, "prefill_attention")
    return out
