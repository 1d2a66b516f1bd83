"""Fixtures for the control plane: throwaway PostgreSQL databases, SQLite files, Redis namespaces, and
the real gateway in front of the fake OpenAI (`weir`, `sqlite_weir`) for the tests of any folder."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import os
import shutil
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
from sqlalchemy import text

from gateway.app import create_app
from gateway.config import parse_config
from gateway.db import migrate
from gateway.state import MemoryState, SharedState
from gateway.state.redis import RedisState
from tests.conftest import free_port
from tests.fakes import FakeOpenAI
from tests.gateway.conftest import serve

PG_ADMIN_URL = os.environ.get("WEIR_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("WEIR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_PORT = urllib.parse.urlsplit(REDIS_URL).port or 6379  # what the tests' proxies relay to


def _pg_admin(statement: str) -> None:
    # CREATE/DROP DATABASE cannot run inside a transaction, so this talks to asyncpg directly.
    async def run() -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


def _pg_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://") + f"/{name}"


@contextmanager
def fresh_pg_database(prefix: str = "weir_test", template: str | None = None) -> Iterator[str]:
    """A fresh PostgreSQL database's URL (asyncpg driver), dropped afterwards: empty, or a copy of
    database `template`."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _pg_admin(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    try:
        yield _pg_url(name)
    finally:
        _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped afterwards."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: object) -> str:
    return f"sqlite+aiosqlite:///{tmp_path}/weir.db"


@functools.cache
def _migrated_sqlite_template() -> Path:
    """A SQLite admin DB at the schema's head, migrated once a session (alembic's batch-mode steps take
    about a second on a loaded 2-core machine: most of a gateway fixture's start)."""
    directory = Path(tempfile.mkdtemp(prefix="weir-test-template-"))
    atexit.register(shutil.rmtree, directory, True)
    path = directory / "weir.db"
    # In a thread of its own: env.py runs its own event loop, and a test's may be running here.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(migrate.upgrade, f"sqlite+aiosqlite:///{path}", configure_logger=False).result()
    return path


def premigrated(url: str) -> str:
    """`url` as `migrated_sqlite` leaves a SQLite one; a PostgreSQL one as it is (its test migrates it)."""
    return migrated_sqlite(url) if url.startswith("sqlite") else url


def migrated_sqlite(url: str) -> str:
    """Put a copy of the migrated template at SQLite `url`'s file, for a gateway fixture: its start then
    finds the schema at head (its upgrade a no-op check). What a start migrates from an empty file is
    the tests' of migrations (test_migrations, test_db_cli) and of the modules that make their own."""
    shutil.copyfile(_migrated_sqlite_template(), url.split(":///", 1)[1])
    return url


@functools.cache
def _migrated_pg_template() -> str:
    """A PostgreSQL database at the schema's head, migrated once a session, for `migrated_pg_url` to
    copy. Its name is this session's own: other runs may share the server."""
    name = f"weir_template_{uuid.uuid4().hex[:12]}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    atexit.register(_pg_admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    # In a thread of its own: env.py runs its own event loop, and a test's may be running here.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(migrate.upgrade, _pg_url(name), configure_logger=False).result()
    return name


@pytest.fixture
def migrated_pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database at the schema's head (a copy of the session's migrated template),
    dropped afterwards, for a gateway fixture: its start's upgrade is then a no-op check. Copying
    takes about what creating an empty database does; migrating it took as long again. What a start
    migrates from an empty database is the tests' that take `pg_url` or `fresh_pg_database`."""
    with fresh_pg_database(template=_migrated_pg_template()) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key namespace of its own in the shared Redis, deleted afterwards."""
    prefix = f"weirtest:{uuid.uuid4().hex[:10]}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def sync_exec(url: str, sql: str) -> list[tuple]:
    """Run one statement on a throwaway engine, from synchronous tests, and commit it (a write made
    on `connect()` alone was rolled back when the connection closed: a no-op)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    async def run() -> list[tuple]:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                result = await conn.execute(text(sql))
                return [tuple(r) for r in result] if result.returns_rows else []
        finally:
            await engine.dispose()

    return asyncio.run(run())


def wait_rows(url: str, sql: str, expect: int = 1, timeout: float = 15) -> list[tuple]:
    """`sql`'s rows once there are `expect` of them (the batch writer lands usage events a moment
    after the response), or what there is after `timeout` seconds, for the caller's assert to show."""
    deadline = time.monotonic() + timeout
    while True:
        rows = sync_exec(url, sql)
        if len(rows) >= expect or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def state(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[SharedState]:
    """Each shared state: in process, and on the test Redis under this test's prefix."""
    if request.param == "memory":
        s: SharedState = MemoryState()
    else:
        s = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    yield s
    await s.close()


# --- the real gateway with its control plane ----------------------------------------------------------

ADMIN = "admin-token-for-tests"
PRICE = {"input": Decimal("0.15"), "cached_input": Decimal("0.075"), "output": Decimal("0.60")}
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, cached_input: 0.075, output: 0.60}}
database_url: "${DB_URL}"
"""


class Weir:
    def __init__(self, url: str, db_url: str) -> None:
        self.url, self.db_url = url, db_url
        self.admin = httpx.Client(
            base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"}
        )

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=20)

    def tenant_with_key(self, name: str, **limits: Any) -> tuple[str, str, str]:
        tenant = self.admin.post("/tenants", json={"name": name, **limits})
        assert tenant.status_code == 201, tenant.text
        key = self.admin.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "app"})
        assert key.status_code == 201, key.text
        return tenant.json()["id"], key.json()["id"], key.json()["key"]

    def ledger(self, tenant_id: str, expect: int, timeout: float = 15) -> list[tuple]:
        """The tenant's usage rows, once the batch writer has landed `expect` of them."""
        return wait_rows(
            self.db_url,
            "SELECT input_tokens, cached_input_tokens, output_tokens, cost_pico_usd, status, key_id "
            f"FROM usage_events WHERE tenant_id = '{tenant_id}'",
            expect,
            timeout,
        )


@contextmanager
def sqlite_weir(
    config: str,
    fake_openai: FakeOpenAI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
) -> Iterator[Weir]:
    """A gateway on `config` with the control plane on a SQLite ledger in `tmp_path` (`${DB_URL}`), its
    backend `${OPENAI_BASE_URL}` / `${OPENAI_API_KEY}` the fake OpenAI, and `env` besides."""
    db_url = migrated_sqlite(f"sqlite+aiosqlite:///{tmp_path}/weir.db")
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    values = {
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "DB_URL": db_url,
    }
    with serve(create_app(parse_config(config, values | (env or {}))), free_port()) as url:
        yield Weir(url, db_url)


@pytest.fixture
def weir_config() -> str:
    """The gateway's config (`${OPENAI_BASE_URL}`, `${OPENAI_API_KEY}`, `${DB_URL}` filled in): a
    module that imports `weir` overrides it to change the backend's settings."""
    return CONFIG


@pytest.fixture(
    params=["sqlite", pytest.param("postgres+redis", marks=[pytest.mark.postgres, pytest.mark.redis])]
)
def weir(
    request: pytest.FixtureRequest,
    weir_config: str,
    fake_openai: FakeOpenAI,
    tmp_path: Path,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Weir]:
    if request.param == "sqlite":
        db_url = migrated_sqlite(request.getfixturevalue("sqlite_url"))
    else:
        db_url = request.getfixturevalue("migrated_pg_url")
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    if request.param != "sqlite":
        monkeypatch.setenv("WEIR_REDIS_URL", REDIS_URL)
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": db_url}
    app = create_app(parse_config(weir_config, env))
    with serve(app, free_port()) as url:
        yield Weir(url, db_url)
