"""Fixtures shared by every test package. Each package (tests/gateway, tests/engine, ...) keeps its own
conftest.py for what only it needs."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator

# Triton kernels run through Triton's interpreter on machines without an NVIDIA GPU. Set before any test
# module imports the engine (which imports kernels/), since Triton reads it when a kernel is defined.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import structlog


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> None:
    """Poll `check` until it holds; fail the test once `timeout` seconds pass without it. The timeout
    is only how long a failing test takes to say so: generous, for a loaded 2-core machine."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture(autouse=True)
def _structlog_config_restored() -> Iterator[None]:
    """A CLI run in-process (`weir router score` through click's CliRunner) points structlog at the
    runner's captured stderr, for good: later tests that read the gateway's log lines found none."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


# Fixtures every folder's tests may take, without importing them (pytest reads `pytest_plugins` only
# here, in the root conftest). A folder's conftest may still override one of them with its own.
pytest_plugins = [
    "tests.fakes.plugin",
    "tests.fixtures.db",
    "tests.fixtures.gateway",
    "tests.fixtures.vendor_gateway",
]
