"""Backends of `type: engine` with `model:` instead of `url:`: Weir starts `weir engine serve --model M
--port P` itself, waits for its /health, restarts it when it dies and stops it on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time

import aiohttp
import msgspec
import structlog

from gateway.config import Backend

log = structlog.get_logger("weir.engine")

RESTART_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)  # seconds between restarts after quick deaths


def engine_base_url(backend: Backend) -> str:
    """The OpenAI base URL (ending in /v1) of an engine backend."""
    if backend.url or backend.base_url:
        url = (backend.url or backend.base_url or "").rstrip("/")
        return url if url.endswith("/v1") else f"{url}/v1"
    return f"http://127.0.0.1:{backend.port or 8000}/v1"


def resolve_engine_backend(backend: Backend) -> Backend:
    return msgspec.structs.replace(backend, base_url=engine_base_url(backend))


class EngineProcess:
    """One supervised engine subprocess."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.port = backend.port or 8000
        self.command = backend.command or [
            sys.executable, "-c", "from weir.cli import main; main()",
            "engine", "serve", "--model", backend.model or "", "--port", str(self.port),
        ]  # fmt: skip
        self.health_url = f"http://127.0.0.1:{self.port}/health"
        self.process: asyncio.subprocess.Process | None = None
        self.healthy = False
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"engine:{self.backend.name}")

    async def _spawn(self) -> None:
        env = {**os.environ, "WEIR_ENGINE_PORT": str(self.port)}
        self.process = await asyncio.create_subprocess_exec(*self.command, env=env, start_new_session=True)
        log.info("engine_started", backend=self.backend.name, pid=self.process.pid, command=self.command)

    async def _wait_healthy(self, session: aiohttp.ClientSession) -> bool:
        deadline = time.monotonic() + self.backend.startup_timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.returncode is not None:
                return False
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(self.health_url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        return True
            await asyncio.sleep(0.2)
        return False

    async def _supervise(self) -> None:
        failures = 0
        async with aiohttp.ClientSession() as session:
            while not self._stopping:
                await self._spawn()
                started = time.monotonic()
                if await self._wait_healthy(session):
                    self.healthy = True
                    log.info("engine_ready", backend=self.backend.name, port=self.port)
                else:
                    log.error("engine_not_ready", backend=self.backend.name, port=self.port)
                    await self._terminate()
                assert self.process is not None
                code = await self.process.wait()
                self.healthy = False
                if self._stopping:
                    return
                failures = 0 if time.monotonic() - started > 60 else failures + 1
                delay = RESTART_BACKOFF[min(failures, len(RESTART_BACKOFF) - 1)]
                self.restarts += 1
                log.warning("engine_exited", backend=self.backend.name, code=code, restart_in=delay)
                await asyncio.sleep(delay)

    async def _terminate(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def stop(self) -> None:
        self._stopping = True
        await self._terminate()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.healthy = False
