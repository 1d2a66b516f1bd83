"""`weir db upgrade|downgrade|current`: manage the admin DB schema."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

T = TypeVar("T")
UPGRADE_HINT = "`weir db upgrade` creates its tables"


@contextmanager
def reported_db_errors() -> Iterator[None]:
    """A database a command cannot reach, open or migrate becomes one `Error: admin DB: ...` line
    naming the cause (exit status 1), not a traceback of a hundred lines ending in it."""
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:  # a URL that does not parse, too
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        missing_table = "no such table" in reason or ("relation" in reason and "does not exist" in reason)
        hint = " (an older schema? `weir db upgrade` brings it up to date)" if missing_table else ""
        raise click.ClickException(f"admin DB: {reason}{hint}") from None
    except CommandError as exc:  # alembic: a revision it does not know, a step it cannot take
        raise click.ClickException(f"admin DB: {exc}") from None
    except (OSError, ImportError) as exc:  # a server that does not answer; a driver Weir does not ship
        raise click.ClickException(f"admin DB: {exc}") from None


def sqlite_path(url: str) -> str | None:
    """The file a SQLite URL names; None for another backend or an in-memory database."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    path = parsed.database if parsed.get_backend_name() == "sqlite" else None
    return path if path and path != ":memory:" else None


def check_sqlite_opens(url: str) -> None:
    """Open a SQLite file once here, synchronously, before a command's own event loop does: aiosqlite
    reports a failed open (a directory, a path under a file, no permission) from its worker thread,
    which could run after `asyncio.run` had closed the loop and print an "Event loop is closed"
    traceback before the one-line error. Opening it here fails in this thread, naming the path."""
    if (path := sqlite_path(url)) is None:
        return
    try:
        sqlite3.connect(path).close()
    except sqlite3.Error as exc:
        raise click.ClickException(f"admin DB: cannot open {path}: {exc}") from None


def existing_database_url(database_url: str | None) -> str:
    """The admin DB's URL (`--database-url`, else WEIR_DATABASE_URL, else ./var/weir.db), once a
    SQLite file it names is known to be there: only `weir db upgrade` creates a database. Opening a
    SQLite file that is not there made an empty one (./var/weir.db, where no database was configured,
    or a mistyped path) and the command then failed on a missing table, or stored what it wrote where
    no gateway reads it."""
    from gateway.db.session import DEFAULT_DATABASE_URL, normalise_url, resolve_database_url

    url = resolve_database_url(database_url)
    path = sqlite_path(url)
    if path and not os.path.exists(path):
        if url == normalise_url(DEFAULT_DATABASE_URL):
            raise click.ClickException(
                f"admin DB: none configured (--database-url or WEIR_DATABASE_URL), and the default "
                f"{path} does not exist; name the gateway's database, or {UPGRADE_HINT} there"
            )
        raise click.ClickException(f"admin DB: {path} does not exist; {UPGRADE_HINT}")
    check_sqlite_opens(url)
    return url


def run_on_admin_db(database_url: str | None, work: Callable[[Any], Awaitable[T]]) -> T:
    """Run `work(sessions)` against the admin DB (`existing_database_url`) for a command that reads or
    writes it, once it is known to exist and to have tables."""
    from sqlalchemy import inspect
    from sqlalchemy.engine import make_url

    from gateway.db.session import run_with_sessions

    with reported_db_errors():
        url = existing_database_url(database_url)
        shown = make_url(url).render_as_string(hide_password=True)

        async def checked(sessions: Any) -> T:
            async with sessions() as session:
                tables = await session.run_sync(lambda s: inspect(s.connection()).get_table_names())
            if not tables:
                raise click.ClickException(f"admin DB: {shown} has no tables (not migrated); {UPGRADE_HINT}")
            return await work(sessions)

        return run_with_sessions(url, checked)


@click.group()
def db() -> None:
    """Admin DB schema migrations (SQLite by default, PostgreSQL via WEIR_DATABASE_URL)."""


database_url_option = click.option(
    "--database-url",
    envvar="WEIR_DATABASE_URL",
    default=None,
    help="Default: WEIR_DATABASE_URL, else sqlite ./var/weir.db.",
)


@db.command()
@database_url_option
@click.argument("revision", default="head")
def upgrade(database_url: str | None, revision: str) -> None:
    """Upgrade the schema to REVISION (default: head)."""
    from gateway.db import migrate
    from gateway.db.session import resolve_database_url

    with reported_db_errors():
        url = resolve_database_url(database_url)
        if path := sqlite_path(url):
            try:
                migrate.make_sqlite_directory(url)
            except OSError as exc:  # a path under a file: "File exists: <that file>" alone
                raise click.ClickException(f"admin DB: cannot open {path}: {exc}") from None
        check_sqlite_opens(url)
        if (at := migrate.past(url, revision)) is not None:
            # alembic's upgrade does nothing here, and says nothing.
            click.echo(
                f"admin DB: already at {at}, past {revision}: nothing to upgrade "
                f"(`weir db downgrade {revision}` goes back to it)",
                err=True,
            )
            return
        migrate.upgrade(url, revision)


@db.command()
@database_url_option
@click.argument("revision", default="-1")
def downgrade(database_url: str | None, revision: str) -> None:
    """Downgrade the schema to REVISION (default: one step back; `base` drops everything)."""
    from gateway.db import migrate

    with reported_db_errors():
        url = existing_database_url(database_url)
        if migrate.current_revision(url) is None:
            # alembic says "Relative revision -1 didn't produce 1 migrations".
            click.echo(f"admin DB: nothing to downgrade: it has no schema yet; {UPGRADE_HINT}", err=True)
            return
        migrate.downgrade(url, revision)


@db.command()
@database_url_option
def current(database_url: str | None) -> None:
    """Print the schema revision the DB is at."""
    from gateway.db import migrate

    with reported_db_errors():
        revision = migrate.current(existing_database_url(database_url))
    click.echo(revision or "(empty database)")


@db.command("new-master-key")
def new_master_key() -> None:
    """Print a fresh random master key for WEIR_MASTER_KEY (secrets at rest; docs/security.md)."""
    from gateway.vault import generate_key

    click.echo(generate_key())


@db.command("rotate-master-key")
@database_url_option
def rotate_master_key(database_url: str | None) -> None:
    """Re-encrypt every stored secret under the first key of WEIR_MASTER_KEY ("new,old")."""
    from gateway.db.secrets_cli import rotate

    with reported_db_errors():
        rotate(database_url)


@db.command("purge-prompts")
@database_url_option
def purge_prompts(database_url: str | None) -> None:
    """Delete stored prompts past their tenant's retention period (the gateway also does this hourly)."""
    from gateway.db.secrets_cli import purge

    with reported_db_errors():
        purge(database_url)


@db.command("replay-usage")
@database_url_option
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
def replay_usage(database_url: str | None, path: str) -> None:
    """Write the usage events set aside in PATH (the batch writer's dead-letter file) to the ledger.

    Each event lands once, whatever was replayed before; the file is only read. Exit status 1 when an
    event is refused again or a line holds none (docs/accounting.md, "Refused events")."""
    from gateway.accounting.deadletter import replay

    result = run_on_admin_db(database_url, lambda sessions: replay(path, sessions.kw["bind"]))
    click.echo(
        f"{result.events} events in {path}: {result.written} written to the ledger, "
        f"{result.duplicates} there already, {len(result.refused)} refused again"
    )
    for r in result.refused:
        click.echo(f"refused: event {r.event.event_id} of tenant {r.event.tenant_id}: {r.reason} {r.error}")
    if result.unreadable:
        click.echo(f"unreadable lines: {', '.join(map(str, result.unreadable))}")
    if result.refused or result.unreadable:
        raise SystemExit(1)
