"""Fixtures shared by every test package. Each package (tests/gateway, tests/engine, ...) keeps its own
conftest.py for what only it needs."""

from __future__ import annotations

import os
import socket

# Triton kernels run through Triton's interpreter on machines without an NVIDIA GPU. Set before any test
# module imports the engine (which imports kernels/), since Triton reads it when a kernel is defined.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unused_port() -> int:
    return free_port()


pytest_plugins = ["tests.fakes.plugin"]
