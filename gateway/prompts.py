"""Opt-in storage of request and response bodies, and the retention that deletes them.

Only tenants with `store_prompts` on are captured (gateway.limits.Exchange). A finished exchange is
queued in memory and written in batches by a background task, so storing never delays a response;
when the queue is full (the DB is slow or away) bodies are dropped and counted, never waited for.
Bodies are encrypted with the master key when one is set (gateway.vault). Retention deletes a
tenant's rows older than its `prompt_retention_days` (default 30), and every row of a tenant that
no longer exists; it runs in the gateway every `retention_interval_s` and as `weir db purge-prompts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections import deque
from dataclasses import dataclass

import structlog
from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.aio import stop_if_cancelled
from gateway.credentials import prompt_context
from gateway.db.models import StoredPrompt, Tenant
from gateway.limits import MAX_CAPTURED_BYTES, Exchange
from gateway.vault import Vault, VaultError

log = structlog.get_logger("weir.prompts")

DEFAULT_RETENTION_DAYS = 30
MAX_QUEUED_BYTES = 64 * 1024 * 1024  # bodies waiting for the DB; beyond this they are dropped
BATCH = 200


@dataclass(frozen=True, slots=True)
class Captured:
    request_id: str
    tenant_id: str
    ts: dt.datetime
    endpoint: str
    status: int
    request_body: bytes
    response_body: bytes

    @property
    def size(self) -> int:
        return len(self.request_body) + len(self.response_body)


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class PromptStore:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        vault: Vault | None,
        *,
        flush_interval_s: float = 0.5,
        retention_interval_s: float = 3600.0,
    ) -> None:
        self.sessions = sessions
        self.vault = vault
        self.flush_interval_s = flush_interval_s
        self.retention_interval_s = retention_interval_s
        self.queue: deque[Captured] = deque()
        self.queued_bytes = 0
        self.dropped = 0
        self._warned_clear = False
        self._tasks: list[asyncio.Task[None]] = []

    def capture(self, exchange: Exchange, request_id: str, endpoint: str) -> None:
        """Called by the guard middleware as an exchange ends: queue it, never wait."""
        captured = Captured(
            request_id=request_id,
            tenant_id=exchange.tenant_id,
            ts=dt.datetime.now(dt.UTC),
            endpoint=endpoint,
            status=exchange.status,
            request_body=b"".join(exchange.request)[:MAX_CAPTURED_BYTES],
            response_body=b"".join(exchange.response)[:MAX_CAPTURED_BYTES],
        )
        size = captured.size
        if self.queued_bytes + size > MAX_QUEUED_BYTES:  # the DB is slow or away: memory stays bounded
            self.dropped += 1
            if self.dropped % 1000 == 1:
                log.warning("prompt_store_full", dropped=self.dropped)
            return
        self.queue.append(captured)
        self.queued_bytes += size

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write_loop()), loop.create_task(self._retention_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):  # best effort at shutdown: bodies are not the ledger
            await self.flush()

    async def flush(self) -> int:
        """Write everything queued now; returns the number of rows written."""
        written = 0
        while self.queue:
            batch = [self.queue[i] for i in range(min(BATCH, len(self.queue)))]
            rows = [self._row(c) for c in batch]
            async with self.sessions() as session, session.begin():
                await session.execute(insert(StoredPrompt), rows)
            for captured in batch:  # only once written: a failed batch is retried on the next round
                self.queue.popleft()
                self.queued_bytes -= captured.size
            written += len(rows)
        return written

    def _row(self, c: Captured) -> dict[str, object]:
        request, response, key_id = _text(c.request_body), _text(c.response_body), None
        if self.vault is None and not self._warned_clear:
            self._warned_clear = True
            log.warning("prompts_stored_in_clear", detail="set WEIR_MASTER_KEY to encrypt stored prompts")
        if self.vault is not None:
            where = prompt_context(c.tenant_id, c.request_id)
            request = self.vault.encrypt(request, where + ":request")
            response = self.vault.encrypt(response, where + ":response")
            key_id = self.vault.primary_id
        return {
            "request_id": c.request_id,
            "tenant_id": c.tenant_id,
            "ts": c.ts,
            "endpoint": c.endpoint,
            "status": c.status,
            "key_id": key_id,
            "request_body": request,
            "response_body": response,
        }

    async def _write_loop(self) -> None:
        while True:
            stop_if_cancelled()  # a cancel that library code swallowed last round
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except Exception as exc:
                log.warning("prompt_store_write_failed", error=str(exc), queued=len(self.queue))

    async def _retention_loop(self) -> None:
        while True:
            stop_if_cancelled()  # a cancel that library code swallowed last round
            try:
                deleted = await purge_expired(self.sessions)
                if deleted:
                    log.info("prompt_retention", deleted=deleted)
            except Exception as exc:
                log.warning("prompt_retention_failed", error=str(exc))
            await asyncio.sleep(self.retention_interval_s)


async def purge_expired(sessions: async_sessionmaker[AsyncSession], now: dt.datetime | None = None) -> int:
    """Delete stored bodies past their tenant's retention, and those of deleted tenants."""
    now = now or dt.datetime.now(dt.UTC)
    deleted = 0
    async with sessions() as session, session.begin():
        tenants = (await session.execute(select(Tenant.id, Tenant.prompt_retention_days))).all()
        for tenant_id, days in tenants:
            cutoff = now - dt.timedelta(days=DEFAULT_RETENTION_DAYS if days is None else days)
            result = await session.execute(
                delete(StoredPrompt).where(StoredPrompt.tenant_id == tenant_id, StoredPrompt.ts < cutoff)
            )
            deleted += result.rowcount or 0  # type: ignore[attr-defined]  # a DELETE gives a CursorResult
        orphans = await session.execute(
            delete(StoredPrompt).where(StoredPrompt.tenant_id.not_in(select(Tenant.id)))
        )
        deleted += orphans.rowcount or 0  # type: ignore[attr-defined]  # a DELETE gives a CursorResult
    return deleted


def read_body(row: StoredPrompt, vault: Vault | None) -> tuple[str, str]:
    """(request, response) in clear; VaultError when encrypted under a key this gateway lacks."""
    if row.key_id is None:
        return row.request_body, row.response_body
    if vault is None:
        raise VaultError("this body is encrypted and WEIR_MASTER_KEY is not set")
    where = prompt_context(row.tenant_id, row.request_id)
    return vault.decrypt(row.request_body, where + ":request"), vault.decrypt(
        row.response_body, where + ":response"
    )
