"""Small asyncio helpers shared by the gateway's background loops."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger("weir.gateway")


def detached(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task of the running loop in a context of its own, for work a request starts that is not
    that request's (a prober, a batch flusher, a comparison): asyncio copies the caller's context into
    a new task, which would then carry the request's log fields (gateway.logging) and exchange tag
    (gateway.ids)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


class Background:
    """Tasks of work that must run to its end though nothing waits for it (the usage event of an
    attempt cancelled while its answer's body still came: whoever cancelled it does not wait): held
    here, since the loop keeps only weak references to tasks, and awaited at shutdown (`drain`). Each
    runs in its starter's context (the request's log fields)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("background_task_failed", exc_info=error)  # nobody else will ever see it

    async def drain(self) -> None:
        """Wait for every task, those started meanwhile included."""
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


def stop_if_cancelled() -> None:
    """Raise CancelledError when this task has been cancelled but no CancelledError reached it.

    Library code deep inside a round of a background loop can catch the CancelledError that `cancel()`
    threw in and carry on; the loop then sleeps and runs again for ever, and whoever awaits the
    cancelled task (an app's shutdown) waits for ever too. Seen in CI: a stopped gateway's health
    prober went on probing every 0.2 s behind later tests. A loop calls this after each round."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def retry_until(
    ask: Callable[[], Awaitable[object]],
    interval_s: float,
    timeout_s: float,
    errors: tuple[type[Exception], ...],
) -> None:
    """Every `interval_s`, `ask` (each call bounded by `timeout_s`) until it returns without one of
    `errors`: how a background task waits, off every request's path, for a store found away to answer
    again (a hanging one would keep the request that asked waiting `timeout_s`)."""
    while True:
        stop_if_cancelled()  # a cancel that library code swallowed last round
        await asyncio.sleep(interval_s)
        with contextlib.suppress(*errors):
            async with asyncio.timeout(timeout_s):
                await ask()
            return
