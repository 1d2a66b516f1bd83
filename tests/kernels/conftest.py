"""Kernel tests run the Triton sources on the CPU through Triton's interpreter.

``kernels`` reads TRITON_INTERPRET at launch time, not import time, so setting it here works even when
another test package imported ``kernels`` first. What the tests compare by is in tests/kernels/checks.py.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_bf16_dot_works() -> bool:
    import triton
    import triton.language as tl

    from weir.kernels._triton import interpreting

    if not interpreting():
        return True

    @triton.jit
    def dot16(a_ptr, b_ptr, o_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(o_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))

    a, b = torch.randn(16, 16, dtype=torch.bfloat16), torch.randn(16, 16, dtype=torch.bfloat16)
    out = torch.empty(16, 16)
    dot16[(1,)](a, b, out)
    return torch.allclose(out, a.float() @ b.float(), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="session")
def bf16_dot_ok() -> bool:
    return _interpreter_bf16_dot_works()
