"""Optional Triton import and a kernel wrapper that picks compile or interpret at launch time.

Triton decides between compiling for a GPU and interpreting on the CPU (``TRITON_INTERPRET=1``) when a
function is decorated. Decorating at import time would freeze that choice the first time anything
imports ``kernels``, so ``jit`` defers it to the first launch and keeps one decorated copy per mode.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional (e.g. macOS); references still work
    triton = None

    class _NoTritonLanguage:
        constexpr = int  # lets kernel signatures evaluate; the kernels themselves are never launched

    tl = _NoTritonLanguage()

HAS_TRITON = triton is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_force_cpu = False


def use_triton(t: torch.Tensor) -> bool:
    """The dispatch rule every kernel shares: Triton for CUDA tensors, PyTorch everywhere else (and
    also for CPU tensors inside ``triton_on_cpu()`` under the interpreter, so tests can drive the
    engine's CUDA code path on a machine without a GPU)."""
    return HAS_TRITON and (t.is_cuda or (_force_cpu and t.is_cpu and interpreting()))


@contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Route CPU tensors through the Triton kernels while ``TRITON_INTERPRET=1`` (tests only: slow)."""
    global _force_cpu
    if not interpreting():
        raise RuntimeError("triton_on_cpu() needs TRITON_INTERPRET=1")
    previous, _force_cpu = _force_cpu, True
    try:
        yield
    finally:
        _force_cpu = previous


class LazyKernel:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._decorated: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Any:
        if triton is None:
            raise RuntimeError("Triton is not installed; use the PyTorch reference")
        mode = interpreting()
        kernel = self._decorated.get(mode)
        if kernel is None:
            kernel = self._decorated[mode] = triton.jit(self.fn)
        return kernel[grid]


def jit(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
