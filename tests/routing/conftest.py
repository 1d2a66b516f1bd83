"""Fixtures for the routing tests: the shipped classifier (loaded once) and the tiny MMLU slice."""

from __future__ import annotations

from pathlib import Path

import pytest

from routing.difficulty import DifficultyClassifier
from tests.control.conftest import redis_prefix  # noqa: F401  (a fixture shared with tests/control)

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def classifier() -> DifficultyClassifier:
    # The encoder head, named: "auto" would pick by this machine's speed, and the tests pin v4.
    return DifficultyClassifier.default("encoder")
