"""A real gateway with the control plane on (SQLite ledger, in-process state) in front of the fakes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes import FakeOpenAI
from tests.fixtures.gateway import CONFIG, Weir, sqlite_weir


@pytest.fixture
def weir_config() -> str:
    """The config of `weir` (`${OPENAI_BASE_URL}`, `${OPENAI_API_KEY}`, `${DB_URL}` filled in): the
    control tests' unless a module overrides this fixture with its own."""
    return CONFIG


@pytest.fixture
def weir(
    weir_config: str, fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Weir]:
    with sqlite_weir(weir_config, fake_openai, tmp_path, monkeypatch) as weir:
        yield weir
