"""Build and load `cpu_decode.c`: one fused decode step of a few sequences on the CPU.

The C file is compiled at first use for this machine (``-march=native``: AVX-512 or AVX2 where the
CPU has them, plain C elsewhere) and cached under ``$WEIR_CACHE_DIR/kernels`` (default
``~/.cache/weir/kernels``), keyed by the source, the flags and the CPU, so a changed file or a moved
disk image rebuilds rather than loading code for another machine. No compiler, no fused step: the
caller keeps the eager path (``library()`` returns None and logs why, once).

The structures mirror the C ones field for field; ``engine/fused_step.py`` fills them from a model.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]

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


def cache_dir() -> Path:
    root = os.environ.get("WEIR_CACHE_DIR") or Path.home() / ".cache" / "weir"
    return Path(root) / "kernels"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one line of each: the cores repeat them


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else shutil.which("gcc") or shutil.which("cc")


def _flags() -> list[str]:
    # WEIR_CPU_DECODE_MARCH: another target than this CPU (tests build the AVX2 and plain-C variants)
    return [*FLAGS, f"-march={os.environ.get('WEIR_CPU_DECODE_MARCH') or 'native'}"]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled step, or None where it cannot be built (no C compiler, no OpenMP)."""
    cc = _compiler()
    if cc is None:
        log.info("fused CPU decode step unavailable: no C compiler (set CC or install gcc)")
        return None
    source, flags = SOURCE.read_bytes(), _flags()
    key = hashlib.sha256(b"\0".join([source, " ".join([cc, *flags]).encode(), _cpu_identity().encode()]))
    target = cache_dir() / f"cpu_decode-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists() and not _build(cc, flags, target):
            return None
        # PyTorch has loaded its libgomp.so.1 by now; the library's dependency resolves to that one, so
        # both share one OpenMP thread pool
        import torch  # noqa: F401

        lib = ctypes.CDLL(str(target))
    except OSError as exc:  # a read-only cache directory, a library that will not load
        log.warning("fused CPU decode step unavailable: %s", exc)
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


def _build(cc: str, flags: list[str], target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent engines never load a half-written file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    result = subprocess.run(
        [cc, *flags, "-o", partial, str(SOURCE), "-lm"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        os.unlink(partial)
        log.warning("fused CPU decode step unavailable: %s failed:\n%s", cc, result.stderr.strip())
        return False
    os.replace(partial, target)
    return True


def scratch_floats(shape: Mapping[str, int], batch: int, threads: int) -> int:
    """Floats of scratch the step needs (the C function's layout), from the `SHAPE_FIELDS` values."""
    hidden, inter, head_dim = shape["hidden"], shape["intermediate"], shape["head_dim"]
    q_size, kv_size = shape["heads"] * head_dim, shape["kv_heads"] * head_dim
    per_seq = 2 * hidden + q_size + 2 * kv_size + q_size + inter
    scores = threads * shape["heads"] * shape["max_len"]
    parts = 4 * threads * (q_size + 2 * shape["heads"])  # attention of few sequences, in parts
    return batch * per_seq + scores + threads * batch * (max(hidden, inter, q_size) // 2 + 1) + parts
