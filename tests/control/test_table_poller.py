"""The shared admin-DB table poller: it keeps polling through failures, stops cleanly, and reloads
a table only when its signature moved."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
from sqlalchemy import delete, select

from gateway.db import migrate
from gateway.db.models import BackendCredential, RouteRow
from gateway.db.poller import TablePoller
from gateway.db.session import create_engine, sessionmaker
from routing.routes import Candidate, Route
from routing.store import RouteStore, route_spec, stamp


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


@pytest.mark.postgres
async def test_an_edit_committed_after_a_later_stamped_one_still_reaches_the_replicas(pg_url: str) -> None:
    """Two admins save two routes at once: the save stamped earlier commits last. The table's latest
    `updated_at` does not move on that commit, so a replica that polled between the two commits
    never reloaded it and served the old route until some other edit (the revision sum moves)."""
    await migrate.upgrade_async(pg_url)
    engine = create_engine(pg_url)
    sessions = sessionmaker(engine)
    loaded: list[dict[str, str]] = []
    store = RouteStore(
        sessions, lambda routes: loaded.append({r.name: r.candidates[0].model for r in routes}), []
    )

    def spec(name: str, model: str) -> dict[str, object]:
        return route_spec(Route(name=name, candidates=[Candidate(model=model)]))

    try:
        async with sessions() as session, session.begin():
            session.add_all([RouteRow(name=n, position=i, spec=spec(n, "old")) for i, n in enumerate("ab")])
        await store.start()
        assert loaded[-1] == {"a": "old", "b": "old"}

        t0 = dt.datetime.now(dt.UTC)
        first, second = sessions(), sessions()
        async with first, second:
            await first.begin()
            row_a = (await first.scalars(select(RouteRow).where(RouteRow.name == "a"))).one()
            row_a.spec, row_a.updated_at = spec("a", "new"), await stamp(first, t0 + dt.timedelta(seconds=1))
            await first.flush()
            await second.begin()
            row_b = (await second.scalars(select(RouteRow).where(RouteRow.name == "b"))).one()
            row_b.spec, row_b.updated_at = spec("b", "new"), await stamp(second, t0 + dt.timedelta(seconds=2))
            await second.commit()
            assert await store.refresh()
            assert loaded[-1] == {"a": "old", "b": "new"}
            await first.commit()
        assert await store.refresh()
        assert loaded[-1] == {"a": "new", "b": "new"}
    finally:
        await store.stop()
        await engine.dispose()


async def test_every_write_of_a_mirrored_row_counts_a_revision(db_url: str) -> None:
    await migrate.upgrade_async(db_url)
    engine = create_engine(db_url)
    sessions = sessionmaker(engine)
    try:
        async with sessions() as session, session.begin():
            session.add(RouteRow(name="r", position=0, spec={}))
            session.add(
                BackendCredential(backend="b", ciphertext="c", key_id="k", fingerprint="f", last4="1234")
            )
        for last4 in ("0001", "0002"):
            async with sessions() as session, session.begin():
                (await session.get(BackendCredential, "b")).last4 = last4  # type: ignore[union-attr]
                (await session.scalars(select(RouteRow))).one().position += 1
        async with sessions() as session:
            assert (await session.scalars(select(RouteRow.revision))).all() == [3]
            assert (await session.scalars(select(BackendCredential.revision))).all() == [3]
    finally:
        await engine.dispose()
