"""The end of a stopping server's drain: requests still running then end with their API's 503.

`weir serve` stops (SIGTERM, SIGINT) by letting in-flight requests finish for `server.drain_timeout`
seconds; uvicorn cancels what still runs 2 s after that (granian waits for it however long it runs).
A stream cancelled so was cut off: an incomplete chunked body, no error event; a request not streamed
got a 500; and the server's traceback was in the log. Instead, at the deadline the server calls
`end_requests()`: each request still awaiting its answer (or a stream its first batch) under
`answered_by_deadline`, and each stream under `ending_at_deadline`, closes its upstream (the attempt
is recorded as the server's 503, billed what was streamed) and raises `ServerShuttingDown`, which
each API renders as its own 503, or its own error event once a stream's response has started.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

from gateway.errors import ServerShuttingDown
from gateway.pipeline import Call

T = TypeVar("T")

# The attempts a request ended at the deadline had under way, as `Call.stopped` records them.
SHUT_DOWN = (ServerShuttingDown.code, ServerShuttingDown.status)
SHUTTING_DOWN = "The server is shutting down; retry the request."


@dataclass(eq=False, slots=True)
class _Live:
    task: asyncio.Task[object]
    call: Call
    waiting: bool = False  # on its upstream (not on its client): cancelled there, at once
    ended: bool = False


# The requests in flight in this process, whatever their event loop (the server runs one).
_live: set[_Live] = set()


def end_requests() -> int:
    """The drain's deadline: every request in flight ends with its API's 503 or error event. One
    waiting on its upstream is cancelled there now; a stream whose last batch is still being written
    to its client ends once it is written. Call it on the requests' event loop; returns how many
    there were."""
    for request in _live:
        request.ended = True
        for attempt in request.call.admitted:  # recorded as the server's, not as the client's 499
            request.call.stopped.setdefault(attempt, SHUT_DOWN)
        if request.waiting:
            request.task.cancel()
    return len(_live)


def _the_deadlines(live: _Live) -> bool:
    """Whether the cancellation `live`'s task meets is the deadline's (`end_requests`) alone, which
    then becomes the API's 503 or error event; it is taken back (uncancelled) if so."""
    return live.ended and live.task.uncancel() == 0


async def ending_at_deadline(call: Call, batches: AsyncIterator[T]) -> AsyncIterator[T]:
    """`batches` (a stream's), until the drain's deadline (`end_requests`): then the upstream is closed
    and ServerShuttingDown raised, for the API to render as its error event."""
    task = asyncio.current_task()
    assert task is not None
    live = _Live(task, call)
    _live.add(live)
    try:
        while not live.ended:
            live.waiting = True
            try:
                batch = await anext(batches)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not _the_deadlines(live):  # anyone else's (a client gone) goes on up
                    raise
                break
            finally:
                live.waiting = False
            yield batch
        await batches.aclose()  # type: ignore[attr-defined]  # a generator: its attempt is recorded
        raise ServerShuttingDown(SHUTTING_DOWN)
    finally:
        _live.discard(live)


async def answered_by_deadline(call: Call, answer: Awaitable[T]) -> T:
    """`answer` (the executor's: a whole answer, or a stream once its first batch came), unless the
    drain's deadline (`end_requests`) comes first: then its upstream attempts are cancelled and
    ServerShuttingDown raised, which the API renders as its 503. Without it the server cancelled the
    request later (a 500 and a traceback), or never (granian)."""
    task = asyncio.current_task()
    assert task is not None
    live = _Live(task, call, waiting=True)
    _live.add(live)
    try:
        return await answer
    except asyncio.CancelledError:
        if not _the_deadlines(live):  # anyone else's (a client gone) goes on up
            raise
        raise ServerShuttingDown(SHUTTING_DOWN) from None
    finally:
        _live.discard(live)


def end_requests_after_stop_signal(seconds: float) -> None:
    """For a server that drains on SIGTERM or SIGINT with no deadline of its own (granian, whose worker
    waits for every request to end): `end_requests` `seconds` after the first such signal. Call it on
    the server's event loop in the main thread, once the server has set its own handlers, which go on
    running: an asyncio loop's (`add_signal_handler`) hear the signal through the loop's wakeup fd
    whatever Python-level handler is set, and any other is called from this one."""
    loop = asyncio.get_running_loop()
    stopping = False

    def heard(
        previous: Callable[[int, FrameType | None], Any] | int | None,
    ) -> Callable[[int, FrameType | None], None]:
        def handler(signum: int, frame: FrameType | None) -> None:
            nonlocal stopping
            if not stopping:
                stopping = True
                # A signal handler may run between any two bytecodes of the loop: it only wakes it.
                loop.call_soon_threadsafe(loop.call_later, seconds, end_requests)
            if callable(previous):
                previous(signum, frame)

        return handler

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, heard(signal.getsignal(signum)))
