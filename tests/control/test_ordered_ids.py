"""Request and event ids start with the time, so the ledger's indexes on them grow at one edge: a batch
of events dirties a few index pages, not one page per event (which made the SQLite writer's CPU per
event grow with the table; docs/benchmarks.md, "Seventh pass")."""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import text

from gateway import ids
from gateway.accounting.events import UsageEvent
from gateway.accounting.writer import BatchWriter
from gateway.db import migrate
from gateway.db.session import create_engine
from gateway.usage import Usage
from tests.control.events import usage_event


def test_ids_are_32_hex_digits_sorted_by_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([1_700_000_000_000_000_000 + k * 1_000_000 for k in range(200)])
    monkeypatch.setattr(ids.time, "time_ns", lambda: next(clock))
    made = [ids.ordered_id() for _ in range(200)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in made)
    assert made == sorted(made)
    assert made[0][:12] == f"{1_700_000_000_000:012x}"
    # Within one millisecond the 80 random bits keep them apart.
    monkeypatch.setattr(ids.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    same = {ids.ordered_id() for _ in range(10_000)}
    assert len(same) == 10_000 and len({i[:12] for i in same}) == 1


def test_usage_events_get_ordered_ids_by_default() -> None:
    before = f"{dt.datetime.now(dt.UTC).timestamp() * 1000:.0f}"
    event = usage_event("r", tenant_id=None, key_id=None, usage=Usage())
    assert abs(int(event.event_id[:12], 16) - int(before)) < 60_000


def test_ids_are_unique_across_threads_and_a_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    # All in one millisecond, so only the random part keeps ids apart. The random bytes come from a
    # pool (gateway/ids.py): two threads must never take the same slice of it, and a forked worker must
    # not hand out the slices its parent will.
    monkeypatch.setattr(ids.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    per_thread = 2_000
    with ThreadPoolExecutor(8) as pool:
        made = [
            i
            for part in pool.map(lambda _: [ids.ordered_id() for _ in range(per_thread)], range(8))
            for i in part
        ]
    assert len(set(made)) == len(made) == 8 * per_thread

    ids.ordered_id()  # the parent now holds a partly used pool that the child inherits
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's report arrives through the pipe
        try:
            os.write(write, " ".join(ids.ordered_id() for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = set(f.read().split())
    os.waitpid(pid, 0)
    parent = {ids.ordered_id() for _ in range(50)}
    assert len(child) == 50 and not child & parent


async def _frames_of_one_batch(db: Path, make_id: Callable[[], str], rows_before: int) -> int:
    """WAL frames (pages) written by one batch of 500 events into a ledger of `rows_before` rows."""
    url = f"sqlite+aiosqlite:///{db}"
    await migrate.upgrade_async(url)
    engine = create_engine(url)
    writer = BatchWriter(None, engine)  # type: ignore[arg-type]  # write() needs no queue
    now = dt.datetime.now(dt.UTC)

    def batch() -> list[UsageEvent]:
        return [
            UsageEvent(
                request_id=make_id(),
                attempt=1,
                ts=now,
                tenant_id="t" * 32,
                key_id="k" * 32,
                route="m",
                backend="b",
                model="m",
                usage=Usage(input_tokens=10, output_tokens=20),
                prices={"input": 1_000_000, "output": 2_000_000},
                cost_pico_usd=50_000_000,
                latency_ms=1.5,
                event_id=make_id(),
            )
            for _ in range(500)
        ]

    try:
        for _ in range(rows_before // 500):
            await writer.write(batch())
        async with engine.connect() as conn:
            await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        await writer.write(batch())
        async with engine.connect() as conn:
            busy, frames, _ = (await conn.execute(text("PRAGMA wal_checkpoint(PASSIVE)"))).one()
        assert busy == 0
        return int(frames)
    finally:
        await engine.dispose()


async def test_a_batch_writes_few_index_pages_however_big_the_ledger(tmp_path: Path) -> None:
    ordered = await _frames_of_one_batch(tmp_path / "ordered.db", ids.ordered_id, 15_000)
    random_ids = await _frames_of_one_batch(tmp_path / "random.db", lambda: os.urandom(16).hex(), 15_000)
    # 500 rows of ~350 bytes fill ~45 table pages; ordered ids add a few pages per index, random ones a
    # page per row per index once the index has more leaves than the batch has rows (~190 here).
    assert ordered < 120, ordered
    assert random_ids > 2 * ordered, (random_ids, ordered)
