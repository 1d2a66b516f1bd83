"""Fixtures for the control plane: throwaway PostgreSQL databases, SQLite files, Redis namespaces."""

from __future__ import annotations

import asyncio
import os
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import asyncpg
import pytest
import redis
import redis.asyncio as aioredis
from sqlalchemy import text

from gateway.state import MemoryState, SharedState
from gateway.state.redis import RedisState

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


@contextmanager
def fresh_pg_database(prefix: str = "weir_test") -> Iterator[str]:
    """A fresh, empty PostgreSQL database's URL (asyncpg driver), dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://") + f"/{name}"
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


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def state(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[SharedState]:
    """Each shared state: in process, and on the test Redis under this test's prefix."""
    if request.param == "memory":
        s: SharedState = MemoryState()
    else:
        s = RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)
    yield s
    await s.close()
