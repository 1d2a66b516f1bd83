"""Backends of `type: engine` with `model:` instead of `url:`: Weir starts `weir engine serve --model M
--port P` itself, waits for its /health, restarts it when it dies and stops it on shutdown. Each time
it is up, its model list (`/v1/models`, with the model's `max_model_len`) goes to `on_models`: the
gateway fits output limits in the window of the engine running now, flags changed between restarts
included.

An engine that never became ready failed to load its model, which is not a crash: a bad path, a
corrupt file or a model too large for the machine fail the same way each time, so the supervisor gives
up (`"failed"` in /readyz, one `engine_failed` log line with the engine's own last error) after
LOAD_ATTEMPTS, or at once for a configuration error. A crash while serving is restarted on the backoff,
at most CRASH_RESTARTS times in CRASH_WINDOW_S."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import aiohttp
import msgspec
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.config import Backend

log = structlog.get_logger("weir.engine")

# Seconds before the next start: the n-th failure in a row waits the n-th entry (the last one for every
# failure after). A failure is an engine that exited or was stopped, a command that could not be run,
# or a port another process holds; an engine that had served for RAN_LONG_S before it died starts the
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
# Starts in a row that never got to ready before the supervisor gives up on an engine that has never been
# ready. At once for a configuration error: a `command` that cannot run, or an exit status of
# CONFIG_ERROR_EXITS (2: a flag the engine refuses; os.EX_CONFIG: no such model, engine.server.run).
LOAD_ATTEMPTS = 3
CONFIG_ERROR_EXITS = (2, os.EX_CONFIG)
# Restarts after crashes while serving: at most CRASH_RESTARTS in CRASH_WINDOW_S. One more crash holds
# the next start until the oldest of them leaves the window ("crash_loop" in /readyz): an input that
# crashes the engine, sent again and again, costs a bounded share of the machine in model loads.
CRASH_RESTARTS = 10
CRASH_WINDOW_S = 600.0
# How much of the engine's latest stdout and stderr is kept (each) to find its last error in.
TAIL_BYTES = 16384
STATES = ("ready", "loading", "restarting", "crash_loop", "failed")


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


def last_error(stdout: bytes | bytearray, stderr: bytes | bytearray) -> str | None:
    """The engine's own last word before it stopped: its last log line at level error or above (JSON, as
    the gateway starts it), else the last line of its stderr that says error (a traceback's last line,
    text logs), else stderr's last line."""
    for line in reversed(_lines(stdout) + _lines(stderr)):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
                    exception = str(entry.get("exception") or "").strip().splitlines()
                    return " ".join([str(entry.get("event", "")), *exception[-1:]])
    text = _lines(stderr)
    return next((line for line in reversed(text) if "error" in line.lower()), text[-1] if text else None)


def _lines(output: bytes | bytearray) -> list[str]:
    return [line.strip() for line in output.decode(errors="replace").splitlines() if line.strip()]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


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
        self.error: str | None = None  # why it last stopped: the engine's own last error, else ours
        self.failed = False  # given up on: it never loaded (LOAD_ATTEMPTS), not started again
        self.crash_loop = False  # holding its next start (CRASH_RESTARTS in CRASH_WINDOW_S)
        self._crashes: deque[float] = deque()  # when each restart after a crash while serving began
        self._task: asyncio.Task[None] | None = None
        self._relays: list[asyncio.Task[None]] = []
        self._stdout, self._stderr = bytearray(), bytearray()  # the last TAIL_BYTES of each
        self._stopping = False

    @property
    def state(self) -> str:
        """What /readyz reports: "ready", "loading" (its first start), "restarting" (healthy once, now
        down: exited, dead, or being started again), "crash_loop" (healthy once, crashed too often:
        its next start held) or "failed" (never loaded: given up on)."""
        if self.healthy:
            return "ready"
        if self.failed:
            return "failed"
        if self.crash_loop:
            return "crash_loop"
        return "restarting" if self.loaded else "loading"

    @property
    def given_up(self) -> str | None:
        """Why requests for this engine's models cannot be served, once it is given up on ("failed"):
        nothing listens on its port until the gateway restarts, so a connection error would say only
        that, and the client and operator would not learn why. None while it may still come up."""
        if not self.failed:
            return None
        # The engine's own error names files and paths: it goes to operators (the log, the admin API's
        # routes/status), not to every tenant whose request meets it.
        return (
            f"backend {self.backend.name}: its engine failed to load its model and is not started again "
            "(the reason is in the gateway's log and the admin API's routes/status)"
        )

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"engine:{self.backend.name}")

    async def _spawn(self) -> None:
        env = {**os.environ, "WEIR_ENGINE_PORT": str(self.port), PARENT_PID_ENV: str(os.getpid())}
        # A session of its own: a terminal's Ctrl+C reaches only the gateway, which stops the engine in
        # order (`stop`), and `_terminate` signals the whole group (a `command:`'s children too). The
        # engine ends with the gateway by watching PARENT_PID_ENV, since no signal reaches it then.
        # Its output is relayed to the gateway's own stdout and stderr, the last of it kept: its last
        # error is what says why a model did not load.
        self.process = await asyncio.create_subprocess_exec(
            *self.command,
            env=env,
            start_new_session=True,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self._stdout.clear()
        self._stderr.clear()
        assert self.process.stdout is not None and self.process.stderr is not None
        self._relays = [
            asyncio.create_task(_relay(self.process.stdout, 1, self._stdout)),
            asyncio.create_task(_relay(self.process.stderr, 2, self._stderr)),
        ]
        log.info("engine_started", backend=self.backend.name, pid=self.process.pid, command=self.command)

    async def _exited(self) -> int:
        """The engine's exit status, once its output is relayed: a `command:`'s child that keeps the
        pipes open is given a moment, not waited for."""
        assert self.process is not None
        code = await self.process.wait()
        _, pending = await asyncio.wait(self._relays, timeout=1.0)
        for relay in pending:
            relay.cancel()
        return code

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
        failed_loads = 0  # starts that ended before the engine was ever ready (see LOAD_ATTEMPTS)
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
                    # A `command` that cannot be run (not found, not executable): said in the log.
                    # Raised, it ended supervision without a word, left /readyz at 503 for ever and
                    # failed the gateway's shutdown. Before any start it is a configuration error.
                    failures += 1
                    self.error = f"cannot run {self.command[0]}: {exc}"
                    if not self.loaded:
                        self._give_up(failed_loads + 1, None)
                        return
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
                not_ready = None
                if await self._wait_healthy(session):
                    self.healthy = self.loaded = True
                    self.crash_loop = False
                    log.info("engine_ready", backend=self.backend.name, port=self.port)
                    await self._read_models(session)
                    await self._watch(session)
                elif self.process is not None and self.process.returncode is None:  # too slow
                    not_ready = f"not ready within {self.backend.startup_timeout:g}s (startup_timeout)"
                    log.error("engine_not_ready", backend=self.backend.name, port=self.port)
                    await self._terminate()
                code = await self._exited()
                self.healthy = False
                if self._stopping:
                    return
                self.error = _why(code, last_error(self._stdout, self._stderr), not_ready)
                # A load that failed after a long time (a large model) still counts: only a serving
                # engine's long run starts the count again.
                ran_long = self.loaded and time.monotonic() - started > RAN_LONG_S
                failures = 1 if ran_long else failures + 1
                failed_loads += not self.loaded
                if not self.loaded and (failed_loads >= LOAD_ATTEMPTS or code in CONFIG_ERROR_EXITS):
                    self._give_up(failed_loads, code)
                    return
                if self.loaded:
                    await self._hold_crash_loop()
                self.restarts += 1
                log.warning(
                    "engine_exited",
                    backend=self.backend.name,
                    code=code,
                    error=self.error,
                    restart_in=restart_delay(failures),
                )
                await asyncio.sleep(restart_delay(failures))

    def _give_up(self, attempts: int, code: int | None) -> None:
        """An engine that never loaded: not started again, and said once, with its own last error."""
        self.failed = True
        log.error(
            "engine_failed",
            backend=self.backend.name,
            model=self.backend.model,
            attempts=attempts,
            code=code,
            error=self.error,
            detail="the engine could not load its model and is not started again: fix the backend "
            "(its model, command or args) and restart the gateway; its routes fail over meanwhile",
        )

    async def _hold_crash_loop(self) -> None:
        """At most CRASH_RESTARTS restarts after crashes in CRASH_WINDOW_S: beyond them, wait until the
        oldest leaves the window."""
        now = time.monotonic()
        while self._crashes and now - self._crashes[0] > CRASH_WINDOW_S:
            self._crashes.popleft()
        if len(self._crashes) >= CRASH_RESTARTS:
            wait = self._crashes[0] + CRASH_WINDOW_S - now
            self.crash_loop = True
            log.error(
                "engine_crash_loop",
                backend=self.backend.name,
                crashes=len(self._crashes) + 1,
                window_s=CRASH_WINDOW_S,
                error=self.error,
                restart_in=round(wait, 1),
            )
            await asyncio.sleep(wait)
            self._crashes.popleft()
            self.crash_loop = False  # restarting again
        self._crashes.append(time.monotonic())

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
        for task in (self._task, *self._relays):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.healthy = False


async def _relay(source: asyncio.StreamReader, fd: int, tail: bytearray) -> None:
    """The engine's output to the gateway's own `fd` as it comes, its last TAIL_BYTES kept in `tail`."""
    while chunk := await source.read(65536):
        _write_all(fd, chunk)
        tail += chunk
        del tail[:-TAIL_BYTES]


def _why(code: int, said: str | None, not_ready: str | None) -> str:
    """Why an engine stopped: what it said, else how it ended (a signal: the kernel's OOM killer, say)."""
    if not_ready is not None:
        return f"{not_ready}: {said}" if said else not_ready
    if said:
        return said
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with status {code}"


class EngineCollector(Collector):
    """The supervised engines in /metrics: each one's state (1 for the one it is in) and its restarts."""

    def __init__(self, engines: Sequence[EngineProcess]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = GaugeMetricFamily(
            "weir_engine_state",
            "1 for the state each supervised engine is in (ready, loading, restarting, crash_loop, failed)",
            labels=("backend", "state"),
        )
        restarts = CounterMetricFamily(
            "weir_engine_restarts", "Restarts of each supervised engine", labels=("backend",)
        )
        for engine in self.engines:
            for name in STATES:
                state.add_metric((engine.backend.name, name), float(engine.state == name))
            restarts.add_metric((engine.backend.name,), engine.restarts)
        yield state
        yield restarts
