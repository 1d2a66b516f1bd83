"""Backends of `type: engine` with `model:` instead of `url:`: Weir starts `weir engine serve --model M
--port P` itself, waits for its /health, restarts it when it dies and stops it on shutdown. Each time
it is up, its model list (`/v1/models`, with the model's `max_model_len`) goes to `on_models`: the
gateway fits output limits in the window of the engine running now, flags changed between restarts
included."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import aiohttp
import msgspec
import structlog

from gateway.config import Backend

log = structlog.get_logger("weir.engine")

# Seconds before the next start: the n-th failure in a row waits the n-th entry (the last one for every
# failure after). A failure is an engine that exited or was stopped, a command that could not be run,
# or a port another process holds; an engine that had run for RAN_LONG_S before it died starts the
# count again, so its death is a first failure (1 s), not the next after the last quick one.
RESTART_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)
RAN_LONG_S = 60.0
# The engine polls this pid and shuts down once it is gone (gateway/parent_watch.py, which names it too).
PARENT_PID_ENV = "WEIR_ENGINE_PARENT_PID"
# A running engine's /health is checked this often: an exception inside the engine's step stops its
# loop but not its process, which then answers 503 {"status": "error"} to /health and `engine_dead`
# to every request for ever. DEAD_AFTER such answers in a row and it is restarted.
WATCH_INTERVAL_S = 1.0
DEAD_AFTER = 3


def restart_delay(failures: int) -> float:
    """Seconds to wait after the `failures`-th failure in a row (counted from 1)."""
    return RESTART_BACKOFF[min(failures, len(RESTART_BACKOFF)) - 1]


def port_taken(port: int) -> bool:
    """Whether another process listens on 127.0.0.1:`port` (or on every address), where our engine's
    /health is asked: its 200 would pass for our engine's, whose bind fails. SO_REUSEADDR as the
    engine binds (aiohttp's default), so our last engine's connections in TIME_WAIT do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


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
            "--log-format", "json",  # its lines share the gateway's stdout: JSON lines too
            *backend.args,
        ]  # fmt: skip
        self.health_url = f"http://127.0.0.1:{self.port}/health"
        self.models_url = f"http://127.0.0.1:{self.port}/v1/models"
        # The body of the engine's model list, each time it is up (gateway.runtime: its context window).
        self.on_models: Callable[[bytes], None] | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.healthy = False
        self.loaded = False  # healthy once: its first start is over (the gateway's /readyz waits for it)
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def state(self) -> str:
        """What /readyz reports: "ready", "loading" (its first start, or a command that never ran) or
        "restarting" (healthy once, now down: exited, dead, or being started again)."""
        if self.healthy:
            return "ready"
        return "restarting" if self.loaded else "loading"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"engine:{self.backend.name}")

    async def _spawn(self) -> None:
        env = {**os.environ, "WEIR_ENGINE_PORT": str(self.port), PARENT_PID_ENV: str(os.getpid())}
        # A session of its own: a terminal's Ctrl+C reaches only the gateway, which stops the engine in
        # order (`stop`), and `_terminate` signals the whole group (a `command:`'s children too). The
        # engine ends with the gateway by watching PARENT_PID_ENV, since no signal reaches it then.
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
        failures = 0  # in a row (see RESTART_BACKOFF)
        async with aiohttp.ClientSession() as session:
            while not self._stopping:
                if port_taken(self.port):
                    # Another process holds the port, such as an engine a SIGKILLed gateway left behind
                    # (it ends itself within a second or so): its /health would make ours look ready.
                    failures += 1
                    log.error(
                        "engine_port_in_use",
                        backend=self.backend.name,
                        port=self.port,
                        retry_in=restart_delay(failures),
                    )
                    await asyncio.sleep(restart_delay(failures))
                    continue
                try:
                    await self._spawn()
                except OSError as exc:
                    # A `command` that cannot be run (not found, not executable): said in the log, and
                    # tried again after the backoff. Raised, it ended supervision without a word, left
                    # /readyz at 503 for ever and failed the gateway's shutdown.
                    failures += 1
                    log.error(
                        "engine_start_failed",
                        backend=self.backend.name,
                        command=self.command,
                        error=str(exc),
                        retry_in=restart_delay(failures),
                    )
                    await asyncio.sleep(restart_delay(failures))
                    continue
                started = time.monotonic()
                if await self._wait_healthy(session):
                    self.healthy = self.loaded = True
                    log.info("engine_ready", backend=self.backend.name, port=self.port)
                    await self._read_models(session)
                    await self._watch(session)
                else:
                    log.error("engine_not_ready", backend=self.backend.name, port=self.port)
                    await self._terminate()
                assert self.process is not None
                code = await self.process.wait()
                self.healthy = False
                if self._stopping:
                    return
                failures = 1 if time.monotonic() - started > RAN_LONG_S else failures + 1
                self.restarts += 1
                log.warning(
                    "engine_exited", backend=self.backend.name, code=code, restart_in=restart_delay(failures)
                )
                await asyncio.sleep(restart_delay(failures))

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        """Until the process exits: check /health, and terminate an engine that says it is dead (its
        process alive, its loop not), so that it is restarted like one that exited. A slow or
        unreachable /health proves nothing (a busy engine on a small CPU): only the engine's own
        "error" counts."""
        assert self.process is not None
        exited = asyncio.ensure_future(self.process.wait())
        dead = 0
        try:
            while not exited.done():
                await asyncio.wait({exited}, timeout=WATCH_INTERVAL_S)
                if exited.done() or self._stopping:
                    return
                said = await self._health(session)
                if said == "ok":
                    dead, self.healthy = 0, True
                elif said == "error":
                    dead, self.healthy = dead + 1, False  # /readyz says so at once
                    if dead >= DEAD_AFTER:
                        log.error("engine_dead", backend=self.backend.name, port=self.port)
                        await self._terminate()
                        return
        finally:
            exited.cancel()

    async def _read_models(self, session: aiohttp.ClientSession) -> None:
        """The engine's model list to `on_models`, once it is up: the health probes read it every
        round too, but only for routes that probe, and only after their first interval."""
        if self.on_models is None:
            return
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(self.models_url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status == 200:
                    self.on_models(await response.read())

    async def _health(self, session: aiohttp.ClientSession) -> str | None:
        """What the engine's /health says: "ok", "error" (its loop died), or None (no clear answer)."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(self.health_url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status == 200:
                    return "ok"
                body = await response.json(content_type=None)
                if response.status == 503 and isinstance(body, dict) and body.get("status") == "error":
                    return "error"
        return None

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
