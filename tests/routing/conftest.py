"""Fixtures for the routing tests: the shipped classifier (loaded once) and the tiny MMLU slice."""

from __future__ import annotations

from pathlib import Path

import pytest

from routing.difficulty import DifficultyClassifier
from tests.control.conftest import redis_prefix  # noqa: F401  (a fixture shared with tests/control)
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def classifier() -> DifficultyClassifier:
    # The encoder head, named: "auto" would pick by this machine's speed, and the tests pin v4.
    return DifficultyClassifier.default("encoder")


@pytest.fixture
def fresh_fakes(
    fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini, fake_deepseek: FakeOpenAI
) -> None:
    """Every fake vendor reset for this test (their own fixtures do it)."""
