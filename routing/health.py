"""Active health probes: every backend a route can send to is asked a cheap question (its model list)
every `interval` seconds. An answer below 500 (even 401) means it is up; a refused connection,
timeout or 5xx counts as a failure for every breaker of that backend. The log says when a backend
changes state (down, back up, or not up yet at start, as a bundled engine loading its model), not
every failed probe: an outage is one warning, not one every `interval` seconds. A breaker opened
because the backend could not be reached (by the probes, or by requests that got no connection) goes
half-open as soon as a probe reaches the backend again, so a backend that came back gets its trial
request without waiting out the whole cooldown (`Breakers.reached`), unless a trial the probes' word
let through failed there since the breaker last closed: a backend that answers its model list but
fails requests then costs one request per cooldown, not one per round (`CircuitBreaker.refuted`).
Each round also adopts the breaker openings and recoveries other replicas published in the shared
state (`Breakers.sync`): a probe that reached the backend within a cooldown makes another replica's
opening for an unreachable backend a trial here, not an opening (`CircuitBreaker.answered_lately`).
Every result also goes to `on_result` (the control plane's uptime recorder) when one is given.
The model list an OpenAI-compatible server answers with gives each model's context window where it
says it (`max_model_len`: the bundled engine, vLLM, SGLang), in place of what the last round said
(`routing.windows`): a server restarted with another window is followed from the next round.
A probe is asked as the backend's adapter asks every request (`Provider.models_request`): with the
backend's own key (the config's, or the one stored for it), never a client's, so a vLLM server
started with `--api-key` shows its list, windows included. A probe whose answer says the backend
refused that key (as a request's would be read: 401, 403, Google's 400 `API_KEY_INVALID`) still counts
the backend up, since it answered, and is logged once per backend until a probe is let in again:
a wrong or revoked key shows in the log before the first request fails on it."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import structlog

from gateway.aio import stop_if_cancelled
from gateway.config import Backend
from gateway.providers import PROVIDERS
from gateway.providers.base import CREDENTIALS_REFUSED, UpstreamRequest
from gateway.transport import describe
from routing.breaker import Breakers
from routing.load import LoadReports
from routing.windows import ContextWindows, served_windows

log = structlog.get_logger("weir.routing")

# Backends whose model list may say each model's context window (`max_model_len`), and the most of
# it read: a model list is a few KiB; an aggregator's (OpenRouter's, a megabyte) is not read.
WINDOW_TYPES = ("openai", "engine")
MAX_LIST_BYTES = 256 * 1024
# The statuses an answer refusing the gateway's key comes with (Google says a wrong key with a 400),
# and the most of such an answer read to tell: an error body is a few hundred bytes.
REFUSAL_STATUSES = (400, 401, 403)
MAX_ERROR_BYTES = 16 * 1024


# (backend name, reached it, latency in ms, when): e.g. gateway.accounting.uptime.ProbeRecorder.record
ProbeListener = Callable[[str, bool, float | None, dt.datetime], None]


def record_windows(store: ContextWindows, backend: str, windows: dict[str, int]) -> None:
    """`backend`'s model list's windows into `store`, logged where one changed (a server restarted
    with another window; 0: no longer said), not every round."""
    for model, window in store.served(backend, windows).items():
        if model:  # ANY_MODEL repeats the engine's sole model's
            log.info("context_window_served", backend=backend, model=model, window=window)


def probe_request(backend: Backend) -> UpstreamRequest:
    """The probe of `backend`: its model list, asked as its adapter asks every request."""
    return PROVIDERS[backend.type].models_request(backend)


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """A probe's answer's body; None for one longer than `limit` or cut short (the backend answered:
    a body cut short says nothing of its health)."""
    if (response.content_length or 0) > limit:
        return None
    body = b""
    try:
        while len(body) <= limit and (chunk := await response.content.read(limit + 1 - len(body))):
            body += chunk
    except (aiohttp.ClientError, TimeoutError):
        return None
    return body if len(body) <= limit else None


class HealthProber:
    def __init__(
        self,
        transport: Any,
        breakers: Breakers,
        interval: float,
        timeout: float = 2.0,
        on_result: ProbeListener | None = None,
        loads: LoadReports | None = None,
        windows: ContextWindows | None = None,
    ) -> None:
        self.windows = windows
        self.transport = transport  # gateway.transport.Transport (its shared aiohttp session)
        # Engines answer probes with their load too: a replica prefix affinity skipped as
        # overloaded gets no requests, so without probes its last report would only age.
        self.loads = loads
        self.breakers = breakers
        self.interval = interval
        self.timeout = timeout
        self.on_result = on_result
        self.targets: dict[str, tuple[Backend, list[str]]] = {}  # backend name -> (backend, breaker keys)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._down_since: dict[str, float] = {}  # backend name -> monotonic time its probes began failing
        self._seen_up: set[str] = set()
        self._key_refused: set[str] = set()  # backends whose probes' key was refused, logged once

    def watch(self, targets: dict[str, tuple[Backend, list[str]]]) -> None:
        self.targets = targets

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop probing. Bounded: a cancel that library code inside a round swallows must not hold up
        the app's shutdown (CI saw a stopped gateway's prober go on every 0.2 s); the loop also ends
        at its next turn on the flag."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            done, _ = await asyncio.wait({self._task}, timeout=self.timeout + self.interval + 1)
            if not done:
                log.warning("health_prober_did_not_stop")
            elif not self._task.cancelled() and self._task.exception() is not None:
                log.warning("health_prober_failed", error=str(self._task.exception()))

    async def probe(self, backend: Backend) -> bool:
        healthy, _ = await self._timed_probe(backend)
        return healthy

    async def _timed_probe(self, backend: Backend) -> tuple[bool, float]:
        question = probe_request(backend)
        started = time.perf_counter()
        try:
            async with self.transport.session.get(
                question.url,
                headers=question.headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                # A probe reads what the backend itself says: following a redirect sent the probe (and
                # its key: aiohttp drops only `Authorization` across origins) to wherever the backend
                # pointed, an internal address included.
                allow_redirects=False,
            ) as response:
                latency_ms = (time.perf_counter() - started) * 1000
                healthy = response.status < 500
                if self.loads is not None:
                    self.loads.observe(backend.name, response.headers)
                if response.status == 200:
                    await self._read_windows(backend, response)
                await self._check_key(backend, response)
        except (aiohttp.ClientError, TimeoutError):
            return False, (time.perf_counter() - started) * 1000
        return healthy, latency_ms

    async def _read_windows(self, backend: Backend, response: aiohttp.ClientResponse) -> None:
        """Each model's context window as `backend`'s model list says it, into `windows`. A list
        without it, a body that is no list, or one too long to read say nothing: no log, no change."""
        if self.windows is None or backend.type not in WINDOW_TYPES:
            return
        body = await read_at_most(response, MAX_LIST_BYTES)
        if body is None:
            return
        windows = served_windows(body, sole=backend.type == "engine")
        if windows is not None:
            record_windows(self.windows, backend.name, windows)

    async def _check_key(self, backend: Backend, response: aiohttp.ClientResponse) -> None:
        """Log once per backend a probe's answer that says the backend refused its key, read by the
        backend's adapter as a request's answer would be; a probe let in (below 400) re-arms it."""
        if response.status < 400:
            self._key_refused.discard(backend.name)
            return
        if response.status not in REFUSAL_STATUSES or backend.name in self._key_refused:
            return
        body = await read_at_most(response, MAX_ERROR_BYTES)
        if body is None:
            return
        refusal = PROVIDERS[backend.type].error(response.status, body, response.headers)
        if refusal.code == CREDENTIALS_REFUSED:
            self._key_refused.add(backend.name)
            # The status alone: the key is the backend's secret, and the vendor's words (some quote
            # part of the key) are in the adapter's `upstream_credentials_refused` line.
            log.warning(
                "backend_probe_key_refused",
                backend=backend.name,
                status=response.status,
                with_key=bool(backend.api_key),
            )

    async def run_once(self) -> None:
        targets = list(self.targets.values())
        at = dt.datetime.now(dt.UTC)
        results = await asyncio.gather(*(self._timed_probe(backend) for backend, _ in targets))
        for (backend, keys), (healthy, latency_ms) in zip(targets, results, strict=True):
            if self.on_result is not None:
                self.on_result(backend.name, healthy, latency_ms if healthy else None, at)
            for key in keys:
                if healthy:
                    self.breakers.reached(key)
                else:
                    await self.breakers.failure(key, probe=True)
            self._log_change(backend.name, healthy)
        await self.breakers.sync()

    def _log_change(self, name: str, healthy: bool) -> None:
        down_since = self._down_since.get(name)
        if healthy:
            if down_since is not None:
                del self._down_since[name]
                waited = round(time.monotonic() - down_since, 1)
                event = "backend_probe_recovered" if name in self._seen_up else "backend_probe_up"
                log.info(event, backend=name, after_s=waited)
            self._seen_up.add(name)
        elif down_since is None:
            self._down_since[name] = time.monotonic()
            if name in self._seen_up:
                log.warning("backend_probe_failed", backend=name)
            else:  # never reached yet: still starting, or misconfigured; the breakers count it either way
                log.info("backend_probe_not_up_yet", backend=name)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self._stopping:
                return
            try:
                await self.run_once()
            except Exception as exc:  # a probe round must never take the gateway down
                log.warning("health_probe_round_failed", error=describe(exc))  # a URL's query may hold a key
            stop_if_cancelled()
