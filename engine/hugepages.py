"""Large CPU tensors on transparent huge pages.

The fused decode step reads the paged KV cache a 16-position block at a time, and a sequence's blocks lie
anywhere in it: on 4 KiB pages every block costs TLB misses (page walks). The attention of a
32-sequence fp32 step (the C code alone, 216 positions, 30 layers) took 17-19 ms on 4 KiB pages and 12
on 2 MiB ones, 23-24 and 20 with the blocks scattered (docs/engine.md). Linux
backs memory with huge pages when asked by `madvise(MADV_HUGEPAGE)` before it is first touched (the
default `transparent_hugepage=madvise` setting honours nothing else); PyTorch's allocator does not ask
unless `THP_MEM_ALLOC_ENABLE` is set at start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.zeros`, on huge pages where the tensor is on the CPU, spans some and the OS allows it."""
    t = torch.empty(shape, dtype=dtype, device=device)
    madvise = _madvise()
    if t.device.type == "cpu" and madvise is not None:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the whole huge pages inside the tensor
        end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
        if end > start and madvise(start, end - start, MADV_HUGEPAGE) != 0:
            log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return t.zero_()  # the first touch: faults the pages in, huge where the kernel has them
