"""Small helpers shared by the vendor modules."""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web

from tests.fakes.behaviour import count_tokens
from tests.fakes.faults import FaultKind
from tests.fakes.server import FAULT


def deep_merge(dst: dict[str, Any], src: dict[str, Any]) -> dict[str, Any]:
    """Merge `src` into `dst` in place, recursing into nested dicts."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            deep_merge(dst[key], value)
        else:
            dst[key] = value
    return dst


def huge_text(request: web.Request) -> str | None:
    """The reply text for a HUGE fault: about `size` bytes of words."""
    fault = request.get(FAULT)
    if fault is None or fault.kind is not FaultKind.HUGE:
        return None
    return huge_words(fault.size)


@functools.lru_cache(maxsize=4)
def huge_words(size: int) -> str:
    """About `size` bytes of words, made once per size: tens of MiB take the fake a second to build
    (and `count_tokens` another to split), which on a loaded machine outran a test's read timeout
    before the response's headers went out (`Fault.huge` makes it when the test asks for it)."""
    text = " ".join(["lorem"] * max(1, size // 6))
    count_tokens(text)
    return text
