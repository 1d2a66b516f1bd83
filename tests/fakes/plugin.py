"""Pytest fixtures for the fake vendor servers (registered in tests/conftest.py).

`fake_openai`, `fake_anthropic`, `fake_gemini` and `fake_deepseek` each yield a running fake
(`tests.fakes.FakeOpenAI` and friends): one server per test session, `reset()` before every test, so a
test sees no requests, faults, usage overrides or cached prompts from another. `fresh_fakes` resets all
four; `fake_vendors` is the four session servers, unreset, for a module's or the session's gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import pytest

from tests.fakes.anthropic import FakeAnthropic
from tests.fakes.gemini import FakeGemini
from tests.fakes.openai import FakeOpenAI
from tests.fakes.server import FakeServer


class FakeVendors(NamedTuple):
    """The session's four fake vendors, in `tests.fixtures.vendor_gateway.fakes_env`'s order."""

    openai: FakeOpenAI
    anthropic: FakeAnthropic
    gemini: FakeGemini
    deepseek: FakeOpenAI


def _fresh(server: FakeServer) -> Iterator[FakeServer]:
    if not server.running:  # a test stopped it to simulate an outage
        server.start()
    server.reset()
    yield server
    server.reset()  # releases anything a test left hanging


@pytest.fixture(scope="session")
def _fake_openai_server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        yield server


@pytest.fixture(scope="session")
def _fake_deepseek_server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(flavour="deepseek") as server:
        yield server


@pytest.fixture(scope="session")
def _fake_anthropic_server() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture(scope="session")
def _fake_gemini_server() -> Iterator[FakeGemini]:
    with FakeGemini() as server:
        yield server


@pytest.fixture
def fake_openai(_fake_openai_server: FakeOpenAI) -> Iterator[FakeOpenAI]:
    yield from _fresh(_fake_openai_server)  # type: ignore[misc]


@pytest.fixture
def fake_deepseek(_fake_deepseek_server: FakeOpenAI) -> Iterator[FakeOpenAI]:
    yield from _fresh(_fake_deepseek_server)  # type: ignore[misc]


@pytest.fixture
def fake_anthropic(_fake_anthropic_server: FakeAnthropic) -> Iterator[FakeAnthropic]:
    yield from _fresh(_fake_anthropic_server)  # type: ignore[misc]


@pytest.fixture
def fake_gemini(_fake_gemini_server: FakeGemini) -> Iterator[FakeGemini]:
    yield from _fresh(_fake_gemini_server)  # type: ignore[misc]


@pytest.fixture(scope="session")
def fake_vendors(
    _fake_openai_server: FakeOpenAI,
    _fake_anthropic_server: FakeAnthropic,
    _fake_gemini_server: FakeGemini,
    _fake_deepseek_server: FakeOpenAI,
) -> FakeVendors:
    """The four fake vendors as the session runs them (not reset): what a gateway started once for a
    module or the session is configured with (`fakes_env(*fake_vendors)`)."""
    return FakeVendors(
        _fake_openai_server, _fake_anthropic_server, _fake_gemini_server, _fake_deepseek_server
    )


@pytest.fixture
def fresh_fakes(
    fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini, fake_deepseek: FakeOpenAI
) -> None:
    """Every fake vendor reset for this test (their own fixtures do it)."""
