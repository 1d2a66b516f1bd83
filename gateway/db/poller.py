"""Keeping an in-memory copy of an admin-DB table fresh on every replica.

Stores that mirror a table (routes, stored backend credentials) poll a cheap signature of it and reload
when it changes; this is the loop they share. A failed poll (the DB briefly away) is logged and the
store keeps serving what it loaded last.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("weir.db")


class TablePoller:
    def __init__(self, refresh: Callable[[], Awaitable[object]], interval: float, name: str) -> None:
        self.refresh = refresh
        self.interval = interval
        self.name = name  # names the log event of a failed poll: f"{name}_poll_failed"
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

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception as exc:  # keep what was loaded; the next poll tries again
                log.warning(f"{self.name}_poll_failed", error=str(exc))
