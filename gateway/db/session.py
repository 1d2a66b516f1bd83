"""Where the admin DB lives and how to open it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./var/weir.db"
T = TypeVar("T")


def resolve_database_url(explicit: str | None = None) -> str:
    """A command's explicit `--database-url`, else `WEIR_DATABASE_URL`, else a SQLite file under ./var/.

    The explicit URL wins: an operator whose shell exports WEIR_DATABASE_URL (production, say) and
    names another database on the command line means that one. Plain driver-less URLs are accepted
    (`postgresql://`, `sqlite:///`).
    """
    return normalise_url(explicit or os.environ.get("WEIR_DATABASE_URL") or DEFAULT_DATABASE_URL)


def normalise_url(url: str) -> str:
    """Give driver-less URLs their async driver: `postgresql://` -> asyncpg, `sqlite://` -> aiosqlite."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    elif parsed.drivername == "sqlite":
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    return parsed.render_as_string(hide_password=False)


def create_engine(url: str) -> AsyncEngine:
    """The admin DB's engine. `hide_parameters`: a statement's error text (logged by the writers that
    retry, and in a 500's traceback) leaves out its values, which hold stored prompts and completions
    (in clear without WEIR_MASTER_KEY)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": 30}, hide_parameters=True)
        # Foreign keys are off by default in SQLite; WAL lets the batch writer and readers overlap.
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    return create_async_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10, hide_parameters=True)


def _sqlite_pragmas(dbapi_connection: object, _record: object) -> None:
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def run_with_sessions(url: str, work: Callable[[async_sessionmaker[AsyncSession]], Awaitable[T]]) -> T:
    """Run `work(sessions)` against the database at `url` in an event loop of its own, as a CLI
    command does, and close the engine afterwards."""

    async def main() -> T:
        engine = create_engine(url)
        try:
            return await work(sessionmaker(engine))
        finally:
            await engine.dispose()

    return asyncio.run(main())
