"""The engine loop, run off the HTTP event loop.

`LLMEngine.step()` is synchronous and takes milliseconds to seconds, so it runs in one dedicated thread
that owns the engine: requests and aborts reach it through a small locked queue, and each step's outputs
go back to the event loop with one `call_soon_threadsafe` per step, fanned out to per-request asyncio
queues. The thread sleeps when there is nothing to do and wakes when a request arrives. A consumer that
goes away (client disconnect, cancellation) aborts its request, so its KV blocks are freed before the
next step."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats, LLMEngine, RequestOutput
    from engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an unexpected error; no request can be served any more."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue[Any]


@dataclass
class _Abort:
    request_id: str


@dataclass
class StepTiming:
    """What the metrics need about the engine loop, updated by the engine thread after every step."""

    steps: int = 0
    busy_seconds: float = 0.0
    last_step_seconds: float = 0.0


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.timing = StepTiming()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: list[_Add | _Abort] = []
        self._queues: dict[str, asyncio.Queue[Any]] = {}  # owned by the engine thread
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._stats: EngineStats = engine.stats()

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts the engine thread; outputs are delivered on `loop` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="weir-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def stats(self) -> EngineStats:
        """The engine's counters as of the end of its last step (read without touching the engine)."""
        return self._stats

    # --- requests --------------------------------------------------------------------------------------

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's outputs as the engine produces them, the last one with `finished`.
        Raises `ValueError` when the engine rejects the request. Leaving the iteration early (break,
        cancellation, `aclose()`) aborts the request."""
        if params.json_format is not None:
            # compiled here, off the engine's thread, so that a schema taking seconds does not stall
            # every other request's generation (add_request then finds it in the cache); before the
            # checks below, which must see the engine as it is when the request is submitted
            await asyncio.to_thread(self.engine.compile_grammar, params.json_format)
        if self._error is not None:
            raise EngineDeadError("the engine stopped") from self._error
        if self._thread is None:
            self.start()
        request_id = request_id or self.new_request_id()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._submit(_Add(request_id, list(prompt_token_ids), params, queue))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # never added, or the engine died: nothing to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request (thread-safe, idempotent); its blocks are freed before the next step."""
        self._submit(_Abort(request_id))

    def _submit(self, item: _Add | _Abort) -> None:
        with self._lock:
            # a request submitted once the engine is stopping may come after its thread's last look at
            # the inbox (its grammar compiled through the shutdown): nobody would ever answer it
            if self._stopping and isinstance(item, _Add):
                raise EngineDeadError("the engine is shutting down")
            self._inbox.append(item)
            self._wakeup.set()

    # --- the engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                    stopping = self._stopping
                    # aborted requests still count as unfinished until a step reports them
                    busy = self._queues or self.engine.has_unfinished_requests()
                    idle = not inbox and not busy and not stopping
                    if idle:
                        self._wakeup.clear()
                if idle:
                    self._wakeup.wait()
                    continue
                self._apply(inbox)
                if stopping:
                    self._abort_all(EngineDeadError("the engine is shutting down"))
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._finish_orphans()
        except BaseException as exc:  # an engine bug must reach every waiting client, not hang them
            log.exception("engine loop stopped")
            self._error = exc
            for request_id in self._queues:  # best effort: free their KV blocks
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    log.exception("could not abort %s", request_id)
            dead = EngineDeadError(f"the engine stopped: {exc!r}")
            dead.__cause__ = exc
            self._deliver([(q, dead) for q in self._queues.values()])
            self._queues.clear()

    def _abort_all(self, error: BaseException) -> None:
        """Shutdown: every request still running is aborted (its blocks freed) and its consumer told."""
        for request_id in list(self._queues):
            self.engine.abort_request(request_id)
        self._deliver([(q, error) for q in self._queues.values()])
        self._queues.clear()
        while self.engine.has_unfinished_requests():  # let the engine report (and drop) the aborts
            self.engine.step()
        self._stats = self.engine.stats()

    def _apply(self, inbox: list[_Add | _Abort]) -> None:
        rejected: list[tuple[asyncio.Queue[Any], Any]] = []
        for item in inbox:
            if isinstance(item, _Add):
                try:
                    self.engine.add_request(item.request_id, item.prompt_token_ids, item.params)
                except ValueError as exc:
                    rejected.append((item.queue, exc))
                    continue
                self._queues[item.request_id] = item.queue
            elif self._queues.pop(item.request_id, None) is not None:
                self.engine.abort_request(item.request_id)
        if rejected:
            self._deliver(rejected)
        self._stats = self.engine.stats()

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - started
        self.timing.steps += 1
        self.timing.busy_seconds += elapsed
        self.timing.last_step_seconds = elapsed
        self._stats = self.engine.stats()
        batch = []
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue  # aborted by its consumer; nobody is listening
            if out.finished:
                del self._queues[out.request_id]
            batch.append((queue, out))
        if batch:
            self._deliver(batch)

    def _finish_orphans(self) -> None:
        """Requests the engine no longer holds but that never reported finishing (defensive: a consumer
        must never wait forever)."""
        if self._queues:
            err = RuntimeError("the engine dropped the request")
            self._deliver([(q, err) for q in self._queues.values()])
            self._queues.clear()

    def _deliver(self, batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
        assert self._loop is not None
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
