"""Build and load the C kernels beside this file (`cpu_decode.c`, `cpu_ops.c`) for this machine.

Each is compiled at first use with the system C compiler (``-march=native``: AVX-512 or AVX2 where the
CPU has them, plain C elsewhere) and cached under ``$WEIR_CACHE_DIR/kernels`` (default
``~/.cache/weir/kernels``), keyed by the source, the flags and the CPU, so a changed file or a moved disk
image rebuilds rather than loading code for another machine. No compiler (or an unwritable cache): the
loader returns None and logs why, and the caller keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


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


def load(source: Path, what: str) -> ctypes.CDLL | None:
    """`source` compiled and loaded, or None (logged, naming `what`) where it cannot be."""
    cc = _compiler()
    if cc is None:
        log.info("%s unavailable: no C compiler (set CC or install gcc)", what)
        return None
    flags = _flags()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), *headers, " ".join([cc, *flags]).encode(), _cpu_identity().encode()])
    )
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists() and not _build(cc, flags, source, target, what):
            return None
        # PyTorch has loaded its libgomp.so.1 by now; the library's dependency resolves to that one, so
        # both share one OpenMP thread pool
        import torch  # noqa: F401

        return ctypes.CDLL(str(target))
    except OSError as exc:  # a read-only cache directory, a library that will not load
        log.warning("%s unavailable: %s", what, exc)
        return None


def _build(cc: str, flags: list[str], source: Path, target: Path, what: str) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent engines never load a half-written file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    result = subprocess.run(
        [cc, *flags, "-o", partial, str(source), "-lm"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        os.unlink(partial)
        log.warning("%s unavailable: %s failed:\n%s", what, cc, result.stderr.strip())
        return False
    os.replace(partial, target)
    return True
