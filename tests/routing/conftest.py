"""Fixtures for the routing tests: the shipped classifier (loaded once) and the tiny MMLU slice."""

from __future__ import annotations

from pathlib import Path

import pytest

from routing.difficulty import DifficultyClassifier

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def classifier() -> DifficultyClassifier:
    # The first use on a machine distils the static table from MiniLM (~20 s on 2 cores), then caches it.
    return DifficultyClassifier.default()
