"""A real gateway with the control plane on (SQLite ledger, in-process state) in front of the fakes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.config import parse_config
from tests.conftest import free_port
from tests.control.conftest import pg_url, redis_prefix, sqlite_url  # noqa: F401  (fixtures shared with tests/control)
from tests.control.test_gateway_control import ADMIN, CONFIG, Weir
from tests.fakes import FakeOpenAI
from tests.gateway.conftest import serve


@pytest.fixture
def weir(fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Weir]:
    db_url = f"sqlite+aiosqlite:///{tmp_path}/weir.db"
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": db_url}
    with serve(create_app(parse_config(CONFIG, env)), free_port()) as url:
        yield Weir(url, db_url)
