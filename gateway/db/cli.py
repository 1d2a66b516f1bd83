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


@db.command("new-master-key")
def new_master_key() -> None:
    """Print a fresh random master key for WEIR_MASTER_KEY (secrets at rest; docs/security.md)."""
    from gateway.vault import generate_key

    click.echo(generate_key())


@db.command("rotate-master-key")
@_url_option
def rotate_master_key(database_url: str | None) -> None:
    """Re-encrypt every stored secret under the first key of WEIR_MASTER_KEY ("new,old")."""
    from gateway.db.secrets_cli import rotate

    rotate(database_url)


@db.command("purge-prompts")
@_url_option
def purge_prompts(database_url: str | None) -> None:
    """Delete stored prompts past their tenant's retention period (the gateway also does this hourly)."""
    from gateway.db.secrets_cli import purge

    purge(database_url)
