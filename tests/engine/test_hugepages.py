"""KV caches on transparent huge pages (engine/hugepages.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine import hugepages


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_zeros_are_zeros_of_the_asked_shape() -> None:
    t = hugepages.zeros((3, 5, 7), torch.bfloat16, "cpu")
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()


def _thp_available() -> bool:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform.startswith("linux") and setting.exists() and "[never]" not in setting.read_text()


@pytest.mark.skipif(not _thp_available(), reason="no transparent huge pages here")
def test_a_large_cache_lands_on_huge_pages() -> None:
    before = _anon_huge_kib()
    cache = hugepages.zeros((64 << 20,), torch.uint8, "cpu")  # 64 MiB
    assert _anon_huge_kib() > before  # the kernel backed at least part of it with 2 MiB pages
    plain = torch.zeros(64 << 20, dtype=torch.uint8)  # PyTorch's own allocation does not ask
    assert cache.sum() == 0 and plain.sum() == 0
