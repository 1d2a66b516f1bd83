"""Every migration runs up and down on SQLite and PostgreSQL, and the models agree with them."""

from __future__ import annotations

import asyncio

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.db import migrate
from gateway.db.models import Base
from tests.control.conftest import sync_exec
from weir.cli import main


def _tables(url: str) -> set[str]:
    if url.startswith("sqlite"):
        rows = sync_exec(url, "SELECT name FROM sqlite_master WHERE type='table'")
    else:
        rows = sync_exec(url, "SELECT tablename FROM pg_tables WHERE schemaname='public'")
    return {r[0] for r in rows}


def _diff(url: str) -> list:
    async def run() -> list:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(
                    lambda sync_conn: compare_metadata(
                        MigrationContext.configure(sync_conn, opts={"compare_type": True}), Base.metadata
                    )
                )
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_every_migration_up_and_down(db_url: str) -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config(db_url))
    revisions = [r.revision for r in reversed(list(script.walk_revisions()))]
    assert revisions, "no migrations found"
    for revision in revisions:  # one step at a time, so each upgrade() runs on its own
        migrate.upgrade(db_url, revision)
        assert migrate.current(db_url).startswith(revision)
    assert set(Base.metadata.tables) <= _tables(db_url)
    assert _diff(db_url) == [], "models and migrations disagree: write a migration"
    for _ in revisions:
        migrate.downgrade(db_url, "-1")
    assert _tables(db_url) <= {"alembic_version"}
    assert migrate.current(db_url) == ""
    migrate.upgrade(db_url)  # and back up again from nothing
    assert set(Base.metadata.tables) <= _tables(db_url)


def test_cli_upgrade_current_downgrade(sqlite_url: str) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["db", "upgrade", "--database-url", sqlite_url])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["db", "current", "--database-url", sqlite_url])
    assert result.exit_code == 0 and "(head)" in result.output
    result = runner.invoke(main, ["db", "downgrade", "--database-url", sqlite_url, "base"])
    assert result.exit_code == 0, result.output
    assert "(empty database)" in runner.invoke(main, ["db", "current", "--database-url", sqlite_url]).output


@pytest.mark.postgres
def test_database_url_from_environment(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_DATABASE_URL", pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    result = CliRunner().invoke(main, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert "tenants" in _tables(pg_url)
