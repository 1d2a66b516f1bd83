"""The shared admin-DB table poller: it keeps polling through failures and stops cleanly."""

from __future__ import annotations

import asyncio

from gateway.db.poller import TablePoller


async def test_poller_survives_a_failing_refresh_and_stops() -> None:
    calls: list[int] = []

    async def refresh() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise ConnectionError("database away")

    poller = TablePoller(refresh, interval=0.01, name="test")
    poller.start()
    poller.start()  # idempotent: still one loop
    for _ in range(200):
        if len(calls) >= 4:
            break
        await asyncio.sleep(0.01)
    assert len(calls) >= 4  # the failure on the second poll did not end the loop
    await poller.stop()
    stopped_at = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == stopped_at
    await poller.stop()  # stopping twice is harmless
