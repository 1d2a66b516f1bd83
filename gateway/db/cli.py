"""`weir db upgrade|downgrade|current`: manage the admin DB schema."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click


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
        hint = (
            " (an older schema? `weir db upgrade` brings it up to date)" if "no such table" in reason else ""
        )
        raise click.ClickException(f"admin DB: {reason}{hint}") from None
    except CommandError as exc:  # alembic: a revision it does not know, a step it cannot take
        raise click.ClickException(f"admin DB: {exc}") from None
    except (OSError, ImportError) as exc:  # a server that does not answer; a driver Weir does not ship
        raise click.ClickException(f"admin DB: {exc}") from None


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

    with reported_db_errors():
        migrate.upgrade(database_url, revision)


@db.command()
@database_url_option
@click.argument("revision", default="-1")
def downgrade(database_url: str | None, revision: str) -> None:
    """Downgrade the schema to REVISION (default: one step back; `base` drops everything)."""
    from gateway.db import migrate

    with reported_db_errors():
        migrate.downgrade(database_url, revision)


@db.command()
@database_url_option
def current(database_url: str | None) -> None:
    """Print the schema revision the DB is at."""
    from gateway.db import migrate

    with reported_db_errors():
        revision = migrate.current(database_url)
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
