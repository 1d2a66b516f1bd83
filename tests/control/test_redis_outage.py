"""Usage events while Redis is unreachable: they go to the local spool on disk (not only memory),
survive a restart, and reach the ledger exactly once when Redis is back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.accounting.queue import RedisStreamQueue, SpoolQueue
from gateway.accounting.writer import BatchWriter
from gateway.db import migrate
from gateway.db.models import UsageEventRow
from gateway.db.session import create_engine
from tests.control.events import random_events
from tests.control.helpers import TcpProxy

pytestmark = pytest.mark.redis


@pytest.fixture
async def engine(sqlite_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate.upgrade_async(sqlite_url)
    e = create_engine(sqlite_url)
    yield e
    await e.dispose()


def stream_queue(port: int, prefix: str, spool: Path) -> RedisStreamQueue:
    client = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
    return RedisStreamQueue(client, prefix=prefix, spool=SpoolQueue(spool), timeout_s=1.0, retry_s=0.05)


async def test_events_spool_while_redis_is_away_and_land_once(
    redis_prefix: str, tmp_path: Path, engine: AsyncEngine
) -> None:
    proxy = TcpProxy(6379)  # Redis as this client sees it: stop() plays an outage
    await proxy.start()
    spool_dir = tmp_path / "spool"
    queue = stream_queue(proxy.port, redis_prefix, spool_dir)
    batches = [
        random_events(40, seed=11),
        random_events(120, seed=12),
        random_events(30, seed=13),
        random_events(10, seed=14),
    ]
    try:
        for event in batches[0]:
            queue.put(event)
        await queue.flush()
        assert not queue.spooling and queue.spool is not None and not queue.spool.read_lines(1)

        await proxy.stop()  # Redis goes away
        for event in batches[1]:
            queue.put(event)
        with pytest.raises(Exception):  # noqa: B017 - whatever redis-py raises for a dead server
            await queue.flush()
        assert queue.spooling
        for event in batches[2]:
            queue.put(event)  # straight to the spool while it is not empty
        assert len(queue.spool.read_lines(1000)) == 150  # on disk, not in memory
        await queue.close()  # the gateway stops (or crashes) before Redis is back
    finally:
        await proxy.start()

    # The restarted gateway finds the spooled events and forwards them before new ones.
    queue = stream_queue(proxy.port, redis_prefix, spool_dir)
    try:
        assert queue.spooling
        for event in batches[3]:
            queue.put(event)
        await queue.flush()
        assert not queue.spooling and queue.spool is not None and not queue.spool.read_lines(1)
        writer = BatchWriter(queue, engine)
        await writer.drain()
        expected = {e.event_id for batch in batches for e in batch}
        async with engine.connect() as conn:
            ids = (await conn.execute(select(UsageEventRow.event_id))).scalars().all()
            total = (await conn.execute(select(func.sum(UsageEventRow.cost_pico_usd)))).scalar()
        assert len(ids) == 200 and set(ids) == expected
        assert total == sum(e.cost_pico_usd for batch in batches for e in batch)
    finally:
        await queue.close()
        await proxy.stop()
