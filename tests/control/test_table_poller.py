"""The shared admin-DB table poller: it keeps polling through failures, stops cleanly, and reloads
a table only when its signature moved."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import delete

from gateway.db import migrate
from gateway.db.models import RouteRow
from gateway.db.poller import TablePoller
from gateway.db.session import create_engine, sessionmaker
from routing.routes import Candidate, Route
from routing.store import RouteStore, route_spec


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


async def test_route_polls_read_a_signature_on_a_held_connection_and_reload_on_change(db_url: str) -> None:
    """A route edit on one replica reaches another's poll; an unchanged table costs one small query on
    the connection the poller holds (no reload), and a connection the DB dropped is replaced."""
    await migrate.upgrade_async(db_url)
    engine = create_engine(db_url)
    sessions = sessionmaker(engine)
    loaded: list[list[str]] = []
    store = RouteStore(sessions, lambda routes: loaded.append([r.name for r in routes]), [])
    reloads = 0
    refresh = store.refresh

    async def counting_refresh(force: bool = False) -> bool:
        nonlocal reloads
        reloads += 1
        return await refresh(force)

    store._poller.refresh = counting_refresh
    try:
        await store.start()
        assert loaded == [[]]
        for _ in range(3):
            await store._poller.poll()
        assert reloads == 0  # the signature did not move: no reload
        held = store._poller.signature._conn  # type: ignore[union-attr]
        assert held is not None

        async with sessions() as session, session.begin():
            route = Route(name="fast", candidates=[Candidate(model="m")])
            session.add(RouteRow(name="fast", position=0, spec=route_spec(route)))
        await store._poller.poll()
        assert (reloads, loaded[-1]) == (1, ["fast"])
        assert store._poller.signature._conn is held  # type: ignore[union-attr]

        await held.invalidate()  # as if the DB had restarted under it
        with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises for a dead connection
            await store._poller.poll()
        async with sessions() as session, session.begin():
            await session.execute(delete(RouteRow))
        await store._poller.poll()  # a fresh connection from the pool
        assert (reloads, loaded[-1]) == (2, [])
    finally:
        await store.stop()
        await engine.dispose()
