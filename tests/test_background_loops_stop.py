"""Background loops stop when cancelled even if a round swallows the CancelledError (library code
deep inside a round can catch it; CI once saw a stopped gateway's health prober run on for ever).
Each loop checks `gateway.aio.stop_if_cancelled()` every round."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from sqlalchemy.ext.asyncio import create_async_engine

from gateway.accounting.queue import SpoolQueue
from gateway.accounting.uptime import ProbeRecorder
from gateway.accounting.writer import BatchWriter


async def _swallow_cancel(counter: list[int]) -> int:
    counter.append(1)
    with contextlib.suppress(asyncio.CancelledError):  # as some library code does
        await asyncio.sleep(10)
    return 0


async def _stops_after_one_round(task: asyncio.Task[None], rounds: list[int]) -> None:
    while not rounds:
        await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done, "the loop went on after its cancel"
    assert len(rounds) == 1


async def test_the_usage_writer_stops_even_when_a_round_swallows_the_cancel(tmp_path: Path) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
    writer = BatchWriter(SpoolQueue(tmp_path / "spool"), engine, linger_s=0.01)
    rounds: list[int] = []

    async def step(**_: object) -> int:
        return await _swallow_cancel(rounds)

    writer.step = step  # type: ignore[method-assign]
    try:
        await _stops_after_one_round(asyncio.create_task(writer.run()), rounds)
    finally:
        await engine.dispose()


async def test_the_probe_recorder_stops_even_when_a_round_swallows_the_cancel(tmp_path: Path) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
    recorder = ProbeRecorder(engine, flush_s=0.01)
    rounds: list[int] = []

    async def flush() -> int:
        return await _swallow_cancel(rounds)

    recorder.flush = flush  # type: ignore[method-assign]
    try:
        await _stops_after_one_round(asyncio.create_task(recorder._run()), rounds)
    finally:
        await engine.dispose()
