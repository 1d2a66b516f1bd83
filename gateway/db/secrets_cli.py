"""What `weir db rotate-master-key` and `weir db purge-prompts` run (kept out of cli.py so that
`weir --help` does not import SQLAlchemy or cryptography)."""

from __future__ import annotations

import click

from gateway.credentials import rotate_master_key
from gateway.db.cli import run_on_admin_db
from gateway.prompts import purge_expired
from gateway.vault import ENV, Vault, VaultError


def rotate(database_url: str | None) -> None:
    try:
        vault = Vault.from_env()
        if vault is None:
            raise VaultError(f"{ENV} is not set: put the new key first, then the old ones (new,old)")
        counts = run_on_admin_db(database_url, lambda sessions: rotate_master_key(sessions, vault))
    except VaultError as exc:
        raise click.ClickException(f"{exc}; nothing was changed") from None
    click.echo(
        f"re-encrypted under master key {vault.primary_id}: {counts['credentials']} vendor keys, "
        f"{counts['prompts']} stored prompts ({counts['unchanged']} keys already were). "
        f"The other keys in {ENV} can now be removed."
    )


def purge(database_url: str | None) -> None:
    deleted = run_on_admin_db(database_url, purge_expired)
    click.echo(f"deleted {deleted} stored prompts past their retention")
