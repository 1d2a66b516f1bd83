"""Vendor API keys stored in the admin DB (encrypted by gateway.vault) and applied to the backends.

A stored key wins over the config's `api_key` for its backend; deleting it brings the config's back.
Every replica polls a cheap signature of the table (row count, last update) like the route table, so
a change reaches all of them within `interval` seconds. A row that does not decrypt (wrong or missing
master key) is logged and reported by the admin API; that backend keeps its config key meanwhile.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import structlog
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.config import Backend
from gateway.db.models import BackendCredential, StoredPrompt
from gateway.db.poller import TablePoller
from gateway.vault import Vault, VaultError, token_key_id

log = structlog.get_logger("weir.credentials")
SIGNATURE = select(
    func.count(BackendCredential.backend),
    func.max(BackendCredential.updated_at),
    func.sum(BackendCredential.revision),  # an edit committed after a later-stamped one moves it too
)


def context(backend: str) -> str:
    return f"backend_credentials:{backend}"


class CredentialStore:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        backends: Sequence[Backend],
        vault: Vault | None,
        interval: float = 1.0,
    ) -> None:
        self.sessions = sessions
        self.vault = vault
        self.interval = interval
        self.backends = {b.name: b for b in backends}
        self.config_keys = {b.name: b.api_key for b in backends}
        self.errors: dict[str, str] = {}  # backend -> why its stored key is not in use
        self.in_use: set[str] = set()  # backends running on their stored key
        self.signature: tuple[Any, ...] | None = None
        self._poller = TablePoller(
            self.refresh,
            interval,
            "backend_credentials",
            sessions=sessions,
            signature_query=SIGNATURE,
            current=lambda: self.signature,
        )

    async def start(self) -> None:
        await self.refresh()
        self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()

    async def refresh(self) -> bool:
        """Reload and apply the stored keys if the table changed; True when it did."""
        async with self.sessions() as session:
            signature = tuple((await session.execute(SIGNATURE)).one())
            if signature == self.signature:
                return False
            rows = (await session.scalars(select(BackendCredential))).all()
        self.apply({row.backend: row.ciphertext for row in rows})
        self.signature = signature
        return True

    def apply(self, stored: dict[str, str]) -> None:
        errors: dict[str, str] = {}
        in_use: set[str] = set()
        for name, backend in self.backends.items():
            token = stored.get(name)
            key = self.config_keys[name]
            if token is not None:
                try:
                    if self.vault is None:
                        raise VaultError("WEIR_MASTER_KEY is not set, so stored keys cannot be read")
                    key = self.vault.decrypt(token, context(name))
                    in_use.add(name)
                except VaultError as exc:
                    errors[name] = str(exc)
                    if self.errors.get(name) != str(exc):
                        log.error("backend_credential_unreadable", backend=name, error=str(exc))
            # Providers read `api_key` when they build each upstream request, so this takes effect
            # from the next request on.
            backend.api_key = key
        self.errors, self.in_use = errors, in_use
        log.info("backend_credentials_loaded", stored=len(stored), in_use=len(in_use), unreadable=len(errors))


async def rotate_master_key(sessions: async_sessionmaker[AsyncSession], vault: Vault) -> dict[str, int]:
    """Re-encrypt every stored secret under the vault's primary key, in one transaction: either all
    rows move or (one fails to decrypt: VaultError, naming it) none do."""
    counts = {"credentials": 0, "prompts": 0, "unchanged": 0}
    now = dt.datetime.now(dt.UTC)
    async with sessions() as session, session.begin():
        for cred in (await session.scalars(select(BackendCredential).with_for_update())).all():
            try:
                token = vault.rotate(cred.ciphertext, context(cred.backend))
            except VaultError as exc:
                raise VaultError(f"backend {cred.backend!r}: {exc}") from None
            if token == cred.ciphertext:
                counts["unchanged"] += 1
                continue
            cred.ciphertext, cred.key_id, cred.updated_at = token, vault.primary_id, now
            counts["credentials"] += 1
        query = select(StoredPrompt).where(
            StoredPrompt.key_id.is_not(None), StoredPrompt.key_id != vault.primary_id
        )
        for row in (await session.scalars(query)).all():
            where = prompt_context(row.tenant_id, row.request_id)
            try:
                row.request_body = vault.rotate(row.request_body, where + ":request")
                row.response_body = vault.rotate(row.response_body, where + ":response")
            except VaultError as exc:
                raise VaultError(f"stored prompt {row.id}: {exc}") from None
            row.key_id = token_key_id(row.request_body)
            counts["prompts"] += 1
    return counts


def prompt_context(tenant_id: str, request_id: str) -> str:
    return f"stored_prompts:{tenant_id}:{request_id}"
