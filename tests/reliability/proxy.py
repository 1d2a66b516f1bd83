"""The control tests' TcpProxy, driven from synchronous tests: its own event loop in a thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from tests.control.helpers import TcpProxy


class ThreadedProxy:
    """127.0.0.1:<port> -> target; `stop()` plays the target going down, `start()` brings it back.
    `target` is the target's port, or a proxy of a TcpProxy subclass to run as it is."""

    def __init__(self, target: int | TcpProxy) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._proxy = target if isinstance(target, TcpProxy) else TcpProxy(target)
        self.port = self._proxy.port
        self.start()

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def start(self) -> None:
        self._run(self._proxy.start())

    def stop(self) -> None:
        self._run(self._proxy.stop())

    def close(self) -> None:
        self.stop()
        self._run(_cancel_others())  # relays still unwinding (or asleep in a slow `forward`)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


async def _cancel_others() -> None:
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            task.cancel()
