"""Alembic, driven from code: `weir db ...` and the automatic upgrade at gateway start use this."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import TextIO

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url

from gateway.db.session import resolve_database_url

ROOT = Path(__file__).resolve().parents[2]


def alembic_config(database_url: str | None = None, stdout: TextIO | None = None) -> Config:
    config = Config(str(ROOT / "alembic.ini"), stdout=stdout) if stdout else Config(str(ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(ROOT / "migrations"))
    # '%' is ConfigParser's interpolation marker; escape it for passwords that contain it.
    config.set_main_option("sqlalchemy.url", resolve_database_url(database_url).replace("%", "%%"))
    return config


def make_sqlite_directory(url: str) -> None:
    """Upgrade creates the database, and so its directory, as the gateway's own engine does
    (session.create_engine): SQLite cannot open a file in a directory that is not there, and aiosqlite's
    failed open raced the closing event loop, printing an "Event loop is closed" traceback from its
    worker thread before the one-line error."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


def upgrade(
    database_url: str | None = None, revision: str = "head", *, configure_logger: bool = True
) -> None:
    config = alembic_config(database_url)
    config.attributes["configure_logger"] = configure_logger  # read by migrations/env.py
    make_sqlite_directory(resolve_database_url(database_url))
    command.upgrade(config, revision)


def downgrade(database_url: str | None = None, revision: str = "-1") -> None:
    command.downgrade(alembic_config(database_url), revision)


def current(database_url: str | None = None) -> str:
    out = io.StringIO()
    command.current(alembic_config(database_url, stdout=out))
    return out.getvalue().strip()


def current_revision(database_url: str | None = None) -> str | None:
    """The revision the DB is at; None for one with no schema yet (never upgraded)."""
    text = current(database_url)
    return text.split()[0] if text else None


def past(database_url: str | None, revision: str) -> str | None:
    """The DB's revision where it is already past `revision` (a later revision of the same line), which
    alembic's upgrade leaves as it is without a word; None otherwise (not past it, no schema yet, or a
    revision alembic must resolve itself: a relative one, an unknown one, whose error it reports)."""
    from alembic.script import ScriptDirectory

    at = current_revision(database_url)
    if at is None:
        return None
    script = ScriptDirectory.from_config(alembic_config(database_url))
    try:
        target = script.get_revision(revision)
    except Exception:  # alembic's own words for it come from the upgrade itself
        return None
    if target is None or target.revision == at:
        return None
    return at if any(r.revision == target.revision for r in script.iterate_revisions(at, "base")) else None


async def upgrade_async(database_url: str | None = None, revision: str = "head") -> None:
    """For callers already inside an event loop (the migrations' env.py runs its own loop): the
    gateway at start, whose logging is configured already (gateway.logging); alembic.ini's would
    replace its JSON root handler with a plain-text one."""
    await asyncio.to_thread(lambda: upgrade(database_url, revision, configure_logger=False))
