"""`weir db upgrade|downgrade|current`: manage the admin DB schema."""

from __future__ import annotations

import click


@click.group()
def db() -> None:
    """Admin DB schema migrations (SQLite by default, PostgreSQL via WEIR_DATABASE_URL)."""


_url_option = click.option(
    "--database-url", envvar="WEIR_DATABASE_URL", default=None, help="Defaults to sqlite ./var/weir.db."
)


@db.command()
@_url_option
@click.argument("revision", default="head")
def upgrade(database_url: str | None, revision: str) -> None:
    """Upgrade the schema to REVISION (default: head)."""
    from gateway.db import migrate

    migrate.upgrade(database_url, revision)


@db.command()
@_url_option
@click.argument("revision", default="-1")
def downgrade(database_url: str | None, revision: str) -> None:
    """Downgrade the schema to REVISION (default: one step back; `base` drops everything)."""
    from gateway.db import migrate

    migrate.downgrade(database_url, revision)


@db.command()
@_url_option
def current(database_url: str | None) -> None:
    """Print the schema revision the DB is at."""
    from gateway.db import migrate

    click.echo(migrate.current(database_url) or "(empty database)")
