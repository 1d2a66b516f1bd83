"""A background loop stops when cancelled even if something inside a round swallows the
CancelledError (CI, 2026-11-30: a stopped gateway's health prober kept probing every 0.2 s, and its
app's shutdown waited for it for ever)."""

from __future__ import annotations

import asyncio
import contextlib

from routing.breaker import Breakers
from routing.health import HealthProber


async def test_the_prober_stops_even_when_a_round_swallows_the_cancel() -> None:
    prober = HealthProber(transport=None, breakers=Breakers(), interval=0.01)
    rounds = 0

    async def round_that_swallows_cancel() -> None:
        nonlocal rounds
        rounds += 1
        with contextlib.suppress(asyncio.CancelledError):  # as some library code does
            await asyncio.sleep(10)

    prober.run_once = round_that_swallows_cancel  # type: ignore[method-assign]
    prober.start()
    while rounds == 0:
        await asyncio.sleep(0.01)
    await asyncio.wait_for(prober.stop(), timeout=5)
    assert prober._task is not None and prober._task.done()
    assert rounds == 1  # it did not go round again after the cancel
