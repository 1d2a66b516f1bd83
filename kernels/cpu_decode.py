"""Build and load `cpu_decode.c`: one fused decode step of a few sequences on the CPU.

The C file is compiled at first use for this machine and cached (kernels/native.py). No compiler, no
fused step: the caller keeps the eager path (``library()`` returns None and logs why, once).

The structures mirror the C ones field for field; ``engine/fused_step.py`` fills them from a model.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping
from pathlib import Path

from weir.kernels import native

SOURCE = Path(__file__).with_name("cpu_decode.c")

F32, BF16, I8, I4 = 0, 1, 2, 3  # weight and cache element types, as the C enum
MAX_BATCH = 64  # sequences per call, as the C file's MAX_BATCH
SHAPE_FIELDS = [
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "intermediate",
    "vocab",
    "layers",
    "block_size",
    "kv_type",
    "embed_type",
    "max_len",
]


class Linear(ctypes.Structure):
    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("type", ctypes.c_int64),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("zero", ctypes.c_void_p),
        ("group", ctypes.c_int64),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("qkv", Linear),
        ("o", Linear),
        ("post_norm", ctypes.c_void_p),
        ("gate_up", Linear),
        ("down", Linear),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class Globals(ctypes.Structure):
    _fields_ = [
        ("embed", ctypes.c_void_p),
        ("embed_stride", ctypes.c_int64 * 2),
        ("norm", ctypes.c_void_p),
        ("head", Linear),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled step, or None where it cannot be built (no C compiler, no OpenMP)."""
    lib = native.load(SOURCE, "fused CPU decode step")
    if lib is None:
        return None
    lib.weir_panel_width.restype = ctypes.c_int64
    lib.weir_panel_width.argtypes = []
    lib.weir_amx.restype = ctypes.c_int
    lib.weir_amx.argtypes = [ctypes.c_int]
    lib.weir_decode_step.restype = ctypes.c_int
    lib.weir_decode_step.argtypes = [
        ctypes.c_void_p,  # shape (int64[len(SHAPE_FIELDS)])
        ctypes.POINTER(Globals),
        ctypes.POINTER(Layer),
        ctypes.c_int64,  # batch
        ctypes.c_void_p,  # tokens (int64 [batch])
        ctypes.c_void_p,  # positions (int64 [batch])
        ctypes.c_void_p,  # block tables (int32 [batch, stride])
        ctypes.c_int64,  # stride
        ctypes.c_float,  # eps
        ctypes.c_int,  # threads
        ctypes.c_void_p,  # scratch (fp32)
        ctypes.c_void_p,  # logits (fp32 [batch, vocab])
    ]
    return lib


def scratch_floats(shape: Mapping[str, int], batch: int, threads: int) -> int:
    """Floats of scratch the step needs (the C function's layout), from the `SHAPE_FIELDS` values."""
    hidden, inter, head_dim = shape["hidden"], shape["intermediate"], shape["head_dim"]
    q_size, kv_size = shape["heads"] * head_dim, shape["kv_heads"] * head_dim
    per_seq = 2 * hidden + q_size + 2 * kv_size + q_size + inter
    scores = threads * shape["heads"] * shape["max_len"]
    parts = 4 * threads * (q_size + 2 * shape["heads"])  # attention of few sequences, in parts
    return batch * per_seq + scores + threads * batch * (max(hidden, inter, q_size) // 2 + 1) + parts
