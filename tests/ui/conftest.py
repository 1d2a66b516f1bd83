"""The UI tests' fixtures: a real gateway (SQLite admin DB, fake OpenAI upstream) on each of
`tests.ui.helpers`' configs, and Debian's chromium driven by Playwright."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes import FakeOpenAI
from tests.ui.helpers import CONFIG, LIMITED_CONFIG, ROUTED_CONFIG, Weir, serve_ui

CHROMIUM = os.environ.get("WEIR_TEST_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "ui"


@pytest.fixture
def weir(fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Weir]:
    yield from serve_ui(CONFIG, fake_openai, tmp_path, monkeypatch)


@pytest.fixture
def routed(fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Weir]:
    yield from serve_ui(ROUTED_CONFIG, fake_openai, tmp_path, monkeypatch)


@pytest.fixture
def limited(fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Weir]:
    yield from serve_ui(LIMITED_CONFIG, fake_openai, tmp_path, monkeypatch)


# Module scope: Playwright's sync API runs an event loop of its own, which must be gone before
# other modules' asyncio tests start.
@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `make services` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture
def shots() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
