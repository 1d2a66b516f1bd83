"""Hooks and fixtures shared by every test package. Each package (tests/gateway, tests/engine, ...) keeps
its own conftest.py for what only it needs; plain helpers are imported from tests/fixtures/, never from a
conftest."""

from __future__ import annotations

import os
from collections.abc import Iterator

# Triton kernels run through Triton's interpreter on machines without an NVIDIA GPU. Set before any test
# module imports the engine (which imports kernels/), since Triton reads it when a kernel is defined.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import structlog

from tests.fixtures.net import free_port


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
