"""The end of a stopping server's drain: streams still running then end with their API's error event.

`weir serve` stops (SIGTERM, SIGINT) by letting in-flight requests finish for `server.drain_timeout`
seconds; the server cancels what still runs after that. A stream cancelled so was cut off: an
incomplete chunked body, no error event, and the server's traceback in the log. Instead, at the
deadline the server calls `end_streams()`, and each stream under `ending_at_deadline` closes its
upstream (the attempt is recorded as the server's 503, billed what was streamed) and raises
`ServerShuttingDown`, which each API renders as its own error event; the response then ends cleanly.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

from gateway.errors import ServerShuttingDown
from gateway.pipeline import Call

T = TypeVar("T")

# The attempts a stream ended at the deadline had under way, as `Call.stopped` records them.
SHUT_DOWN = (ServerShuttingDown.code, ServerShuttingDown.status)


@dataclass(eq=False, slots=True)
class _Live:
    task: asyncio.Task[object]
    call: Call
    waiting: bool = False  # on its upstream (not on its client): cancelled there, at once
    ended: bool = False


# The streams in flight in this process, whatever their event loop (the server runs one).
_live: set[_Live] = set()


def end_streams() -> int:
    """The drain's deadline: every stream in flight ends with its API's error event. A stream waiting
    on its upstream is cancelled there now; one whose last batch is still being written to its client
    ends once it is written. Call it on the streams' event loop; returns how many there were."""
    for stream in _live:
        stream.ended = True
        for attempt in stream.call.admitted:  # recorded as the server's, not as the client's 499
            stream.call.stopped.setdefault(attempt, SHUT_DOWN)
        if stream.waiting:
            stream.task.cancel()
    return len(_live)


async def ending_at_deadline(call: Call, batches: AsyncIterator[T]) -> AsyncIterator[T]:
    """`batches` (a stream's), until the drain's deadline (`end_streams`): then the upstream is closed
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
                # Ours (the deadline's) alone becomes the error event; anyone else's goes on up.
                if not live.ended or task.uncancel() > 0:
                    raise
                break
            finally:
                live.waiting = False
            yield batch
        await batches.aclose()  # type: ignore[attr-defined]  # a generator: its attempt is recorded
        raise ServerShuttingDown("The server is shutting down; retry the request.")
    finally:
        _live.discard(live)


def end_streams_after_stop_signal(seconds: float) -> None:
    """For a server that drains on SIGTERM or SIGINT with no deadline of its own (granian, whose worker
    waits for every stream to end): `end_streams` `seconds` after the first such signal. Call it on
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
                loop.call_soon_threadsafe(loop.call_later, seconds, end_streams)
            if callable(previous):
                previous(signum, frame)

        return handler

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, heard(signal.getsignal(signum)))
