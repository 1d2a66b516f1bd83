"""Small asyncio helpers shared by the gateway's background loops."""

from __future__ import annotations

import asyncio


def stop_if_cancelled() -> None:
    """Raise CancelledError when this task has been cancelled but no CancelledError reached it.

    Library code deep inside a round of a background loop can catch the CancelledError that `cancel()`
    threw in and carry on; the loop then sleeps and runs again for ever, and whoever awaits the
    cancelled task (an app's shutdown) waits for ever too. Seen in CI: a stopped gateway's health
    prober went on probing every 0.2 s behind later tests. A loop calls this after each round."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
