"""Active health-probe results into `uptime_samples`, batched and off the request path.

The routing prober calls `record` (synchronous, memory only) after every probe; a background task
writes what gathered every `flush_s` in one transaction. If the DB is down the samples wait in
memory, up to `max_buffered` (the oldest are dropped beyond that, with a warning: probes are samples,
and an outage long enough to fill the buffer is visible in the request outcomes anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections import deque
from typing import Any

from sqlalchemy import Table, insert
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.aio import stop_if_cancelled
from gateway.db.models import UptimeSample

log = logging.getLogger(__name__)

SAMPLES: Table = UptimeSample.__table__  # type: ignore[assignment]


class ProbeRecorder:
    def __init__(self, engine: AsyncEngine, flush_s: float = 5.0, max_buffered: int = 20_000) -> None:
        self.engine = engine
        self.flush_s = flush_s
        self._buffer: deque[dict[str, Any]] = deque(maxlen=max_buffered)
        self._dropped = 0
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self.written = 0
        self.batches = 0  # transactions that wrote samples

    def record(self, backend: str, ok: bool, latency_ms: float | None, at: dt.datetime) -> None:
        if len(self._buffer) == self._buffer.maxlen:
            self._dropped += 1
        self._buffer.append({"backend": backend, "ts": at, "ok": ok, "latency_ms": latency_ms})

    async def flush(self) -> int:
        """Write everything buffered now in one transaction; raises (keeping the samples) if it fails."""
        batch = list(self._buffer)
        if not batch:
            return 0
        self._buffer.clear()
        try:
            async with self.engine.begin() as conn:
                await conn.execute(insert(SAMPLES), batch)
        except BaseException:
            # Back in front of what was recorded meanwhile; beyond the cap the oldest go.
            self._buffer = deque(batch + list(self._buffer), maxlen=self._buffer.maxlen)
            raise
        self.written += len(batch)
        self.batches += 1
        return len(batch)

    async def _run(self) -> None:
        while True:
            stop_if_cancelled()  # a cancel that library code swallowed last round
            await asyncio.sleep(self.flush_s)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._failing:
                    log.warning("uptime samples not written (%s); keeping them", exc.__class__.__name__)
                self._failing = True
                continue
            if self._failing:
                log.warning("uptime samples written again")
                self._failing = False
            if self._dropped:
                log.warning("dropped %d uptime samples while the DB was unreachable", self._dropped)
                self._dropped = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="uptime-recorder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.flush()
