"""Keeping an in-memory copy of an admin-DB table fresh on every replica.

Stores that mirror a table (routes, stored backend credentials) poll a cheap signature of it and reload
when it changes; this is the loop they share. A failed poll (the DB briefly away) is logged and the
store keeps serving what it loaded last.

The signature is read on a connection this poller holds between polls, in autocommit mode: one round
trip per poll. Through an ORM session every poll was six (the pool's pre-ping is three on asyncpg:
BEGIN, a ping, ROLLBACK; then BEGIN, the query, ROLLBACK) and about 1.3 ms of CPU, every second, on
every replica, for each table.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from sqlalchemy import Executable
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker

from gateway.aio import stop_if_cancelled

log = structlog.get_logger("weir.db")


def _engine_of(sessions: async_sessionmaker[AsyncSession]) -> AsyncEngine | None:
    bind = sessions.kw.get("bind")
    return bind if isinstance(bind, AsyncEngine) else None


class SignatureReader:
    """Runs one small aggregate query (a table's signature) on a connection kept open between calls.

    The connection comes from the engine's pool once (pre-pinged then) and stays checked out; if a
    query fails it is thrown away and the next call takes a fresh one. Autocommit: no transaction is
    left open between polls (none holds back PostgreSQL's vacuum or SQLite's WAL checkpoints)."""

    def __init__(self, engine: AsyncEngine, query: Executable) -> None:
        self.engine = engine
        self.query = query
        self._conn: AsyncConnection | None = None

    async def read(self) -> tuple[Any, ...]:
        conn = self._conn
        if conn is None:
            conn = await self.engine.connect()
            try:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
            except BaseException:
                await _discard(conn)
                raise
            self._conn = conn
        try:
            return tuple((await conn.execute(self.query)).one())
        except BaseException:
            # A broken connection (the DB restarted) or a cancelled read with its reply unread: not
            # reused; the next read starts from the pool.
            self._conn = None
            await _discard(conn)
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


async def _discard(conn: AsyncConnection) -> None:
    with contextlib.suppress(Exception):
        await conn.invalidate()
    with contextlib.suppress(Exception):
        await conn.close()


class TablePoller:
    """Calls `refresh` every `interval` seconds. Given the store's `sessions`, a `signature_query` and
    `current` (the signature the store last loaded), a poll first reads the signature on a held
    connection and calls `refresh` only on a difference."""

    def __init__(
        self,
        refresh: Callable[[], Awaitable[object]],
        interval: float,
        name: str,
        *,
        sessions: async_sessionmaker[AsyncSession] | None = None,
        signature_query: Executable | None = None,
        current: Callable[[], object] | None = None,
    ) -> None:
        self.refresh = refresh
        self.interval = interval
        self.name = name  # names the log event of a failed poll: f"{name}_poll_failed"
        engine = _engine_of(sessions) if sessions is not None and signature_query is not None else None
        self.signature = (
            SignatureReader(engine, signature_query)
            if engine is not None and signature_query is not None
            else None
        )
        self.current = current
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.signature is not None:
            await self.signature.close()

    async def poll(self) -> None:
        """One poll: reload the table if its signature moved (or always, without a reader)."""
        unchanged = (
            self.signature is not None
            and self.current is not None
            and await self.signature.read() == self.current()
        )
        if not unchanged:
            await self.refresh()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll()
            except Exception as exc:  # keep what was loaded; the next poll tries again
                log.warning(f"{self.name}_poll_failed", error=str(exc))
            stop_if_cancelled()
