"""The routes admin API with two admins editing one route at once, on the default admin DB (SQLite)
and on PostgreSQL: `If-Match` lets one of two writes made from one read win, never both. A real gateway on each
database; plain HTTP as an admin client (the admin UI's own calls)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import sqlalchemy

from tests.fixtures.db import fresh_pg_database
from tests.fixtures.waiting import wait_for
from tests.routing.routes_admin import GOOD, ROUTES, Weir, serving

# Another writer holding off every write of route `id` (not its reads) until the block ends.
Hold = Callable[[int], AbstractContextManager[None]]
# One admin's request: method, path and keyword arguments for httpx.
Edit = tuple[str, str, dict[str, Any]]


@contextmanager
def _sqlite_write_lock(database: Path) -> Iterator[None]:
    """SQLite's write lock, held as the usage batch writer or a CLI would: readers go on (WAL)."""
    blocker = sqlite3.connect(database, isolation_level=None, timeout=30)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        yield
        blocker.execute("ROLLBACK")
    finally:
        blocker.close()


Run = Callable[[Coroutine[Any, Any, Any]], Any]


@contextmanager
def _pg_transaction(url: str) -> Iterator[tuple[Run, Any]]:
    """Another PostgreSQL session, in a transaction rolled back at the end, on a loop of its own (the
    test's requests block this thread): `run` awaits a coroutine there; the asyncpg connection."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(work: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(work, loop).result(timeout=30)

    conn = run(asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://")))
    try:
        run(conn.execute("BEGIN"))
        yield run, conn
        run(conn.execute("ROLLBACK"))
    finally:
        run(conn.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@contextmanager
def _pg_row_lock(url: str, route_id: int) -> Iterator[None]:
    """The route's row lock in another PostgreSQL transaction: its writers wait, its readers do not."""
    with _pg_transaction(url) as (run, conn):
        run(conn.execute("SELECT 1 FROM routes WHERE id = $1 FOR UPDATE", route_id))
        yield


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def admin_db(
    request: pytest.FixtureRequest, vendor_env: dict[str, str], tmp_path: Path
) -> Iterator[tuple[Weir, Hold]]:
    """A gateway on a fresh admin DB, and a way to hold off writes of a route on it."""
    if request.param == "sqlite":
        database = tmp_path / "weir.db"
        with serving(vendor_env, f"sqlite+aiosqlite:///{database}", tmp_path / "spool", ROUTES) as weir:
            yield weir, lambda _route_id: _sqlite_write_lock(database)
    else:
        with (
            fresh_pg_database("weir_route_races") as url,
            serving(vendor_env, url, tmp_path / "spool", ROUTES) as weir,
        ):
            yield weir, lambda route_id: _pg_row_lock(url, route_id)


def _checked_out(weir: Weir) -> int:
    engine = weir.router.sessions.kw["bind"]  # type: ignore[attr-defined]
    return int(engine.sync_engine.pool.checkedout())


def _race(weir: Weir, hold: Hold, route_id: int, edits: list[Edit]) -> list[httpx.Response]:
    """Send `edits` at once while another writer holds off writes of the route: each reads the route,
    then waits to write it. The answers, in the order of `edits`."""
    results: dict[int, httpx.Response] = {}

    def send(i: int, method: str, path: str, kwargs: dict[str, Any]) -> None:
        with httpx.Client(base_url=str(weir.admin.base_url), headers=weir.admin.headers, timeout=60) as admin:
            results[i] = admin.request(method, path, **kwargs)

    with hold(route_id):
        idle = _checked_out(weir)
        threads = [threading.Thread(target=send, args=(i, *edit)) for i, edit in enumerate(edits)]
        for thread in threads:
            thread.start()
        # Each edit holds a connection once it has read the row and waits to write it.
        deadline = time.monotonic() + 10
        while _checked_out(weir) < idle + len(edits) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _checked_out(weir) >= idle + len(edits)
    for thread in threads:
        thread.join(timeout=60)
    return [results[i] for i in range(len(edits))]


def _created(weir: Weir) -> dict[str, Any]:
    created = weir.admin.post("/routes", json={**GOOD, "name": "contested"})
    assert created.status_code == 201, created.text
    return dict(created.json())


def _audited(weir: Weir, route_id: int) -> list[dict[str, Any]]:
    """The audit log's entries for the route, oldest first."""
    listed = weir.admin.get("/audit", params={"entity": "route"})
    assert listed.status_code == 200, listed.text
    return [e for e in reversed(listed.json()["data"]) if e["entity_id"] == str(route_id)]


def _put(read: dict[str, Any], threshold: float, if_match: bool = True) -> Edit:
    headers = {"if-match": read["updated_at"]} if if_match else {}
    return "PUT", f"/routes/{read['id']}", {"json": {**read, "threshold": threshold}, "headers": headers}


def test_two_admins_editing_one_read_of_a_route_cannot_both_win(admin_db: tuple[Weir, Hold]) -> None:
    """Two admins read a route, both edit it and send the `updated_at` they read as `If-Match`: one
    edit must be refused (412 `route_changed`), or the other admin's edit is silently lost. The row
    lock that guarantees it is PostgreSQL's (`SELECT ... FOR UPDATE`); SQLite ignores it and its
    driver reads outside any transaction until the first write, so both PUTs read the old row, both
    pass the check, and the second overwrites the first (two 200s, one edit gone)."""
    weir, hold = admin_db
    read = _created(weir)
    answers = _race(weir, hold, read["id"], [_put(read, 0.2), _put(read, 0.8)])
    assert sorted(a.status_code for a in answers) == [200, 412], [
        (a.status_code, a.text[:200]) for a in answers
    ]
    won, lost = answers if answers[0].status_code == 200 else answers[::-1]
    assert lost.json()["error"]["code"] == "route_changed"
    assert weir.admin.get(f"/routes/{read['id']}").json() == won.json()  # the winner's edit stands
    assert [(e["action"], e["before"]) for e in _audited(weir, read["id"])] == [
        ("create", None),
        ("update", read),
    ]


def test_an_edit_and_a_delete_of_one_read_of_a_route_cannot_both_win(admin_db: tuple[Weir, Hold]) -> None:
    """One admin edits a route while another deletes it, both from one read, with `If-Match`: the
    delete after the edit is refused (412: it would throw the edit away unseen), or the edit after
    the delete finds no route (404). On SQLite both passed their check on the old row: the edit was
    deleted with a 200 to its admin, or was written to a route no longer there (a 500)."""
    weir, hold = admin_db
    read = _created(weir)
    delete: Edit = ("DELETE", f"/routes/{read['id']}", {"headers": {"if-match": read["updated_at"]}})
    # 0.3: an edit (the route's threshold is 0.5, and a PUT that changes nothing is no edit to lose).
    edited, deleted = _race(weir, hold, read["id"], [_put(read, 0.3), delete])
    outcome = (edited.status_code, deleted.status_code)
    assert outcome in ((200, 412), (404, 204)), (edited.text[:200], deleted.text[:200])
    stored = weir.admin.get(f"/routes/{read['id']}")
    if outcome == (200, 412):
        assert deleted.json()["error"]["code"] == "route_changed"
        assert stored.json() == edited.json()
        assert [e["action"] for e in _audited(weir, read["id"])] == ["create", "update"]
    else:
        assert edited.json()["error"]["code"] == "not_found" and stored.status_code == 404
        assert [e["action"] for e in _audited(weir, read["id"])] == ["create", "delete"]


def test_each_edit_audits_the_route_it_overwrote(admin_db: tuple[Weir, Hold]) -> None:
    """Without `If-Match` the last edit wins, as documented, but the audit log still says what each
    edit replaced: the second edit's `before` is the first edit's `after`. On SQLite both edits read
    the route before either wrote, and the second's `before` was the route as created: the audit
    log hid the first edit being undone."""
    weir, hold = admin_db
    read = _created(weir)
    answers = _race(
        weir, hold, read["id"], [_put(read, 0.2, if_match=False), _put(read, 0.8, if_match=False)]
    )
    assert [a.status_code for a in answers] == [200, 200], [a.text[:200] for a in answers]
    # In the order they were written: each edit is stamped later than every route before it.
    first, second = sorted(answers, key=lambda a: a.json()["updated_at"])
    entries = _audited(weir, read["id"])
    assert [(e["action"], e["before"], e["after"]) for e in entries] == [
        ("create", None, read),
        ("update", read, first.json()),
        ("update", first.json(), second.json()),
    ]
    assert weir.admin.get(f"/routes/{read['id']}").json() == second.json()


@contextmanager
def _pg_audit_locked(url: str) -> Iterator[Callable[[], int]]:
    """`audit_log` locked against writes in another PostgreSQL transaction (a DELETE of a route writes
    it after its checks, as it commits), and how many of the database's sessions wait on a lock."""
    waiting = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    )
    with _pg_transaction(url) as (run, conn):
        run(conn.execute("LOCK TABLE audit_log IN EXCLUSIVE MODE"))

        def count() -> int:
            run(conn.execute("SELECT pg_stat_clear_snapshot()"))  # else read once per transaction
            return int(run(conn.fetchval(waiting)))

        yield count


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_deletes_of_the_last_two_routes_a_key_uses_cannot_both_pass(
    database: str, vendor_env: dict[str, str], tmp_path: Path
) -> None:
    """A key's `models` names `held`, served by two routes; two admins delete one each at once. Each
    DELETE counted the other route as still there (neither had committed), both passed the 409
    `route_in_use` check, and the key was left with a name that answers 404. One must be refused.

    Both DELETEs are held where they would race: on PostgreSQL by a lock on `audit_log`, which each
    writes after its check, as it commits (the check takes the name's lock first, held until the
    transaction ends, so the second waits there and counts after the first committed); on SQLite by
    its write lock, before either claims its row."""
    with contextlib.ExitStack() as stack:
        if database == "sqlite":
            db = tmp_path / "weir.db"
            url = f"sqlite+aiosqlite:///{db}"
        else:
            url = stack.enter_context(fresh_pg_database("weir_route_races"))
        weir = stack.enter_context(serving(vendor_env, url, tmp_path / "spool", ROUTES))
        first = weir.admin.post("/routes", json={**GOOD, "name": "held"})
        assert first.status_code == 201, first.text
        tenant = weir.admin.post("/tenants", json={"name": "holder"}).json()
        issued = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "app", "models": ["held"]})
        assert issued.status_code == 201, issued.text
        second = weir.admin.post("/routes", json={**GOOD, "name": "held"})
        assert second.status_code == 201, second.text
        ids = [first.json()["id"], second.json()["id"]]
        results: dict[int, httpx.Response] = {}

        def send(route_id: int) -> None:
            with httpx.Client(
                base_url=str(weir.admin.base_url), headers=weir.admin.headers, timeout=60
            ) as admin:
                results[route_id] = admin.delete(f"/routes/{route_id}")

        threads = [threading.Thread(target=send, args=(route_id,)) for route_id in ids]
        if database == "sqlite":
            with _sqlite_write_lock(db):
                idle = _checked_out(weir)
                for thread in threads:
                    thread.start()
                wait_for(lambda: _checked_out(weir) >= idle + 2, timeout=10)
        else:
            with _pg_audit_locked(url) as waiting:
                for thread in threads:
                    thread.start()
                wait_for(lambda: waiting() >= 2, timeout=10)
        for thread in threads:
            thread.join(timeout=60)
        answers = [results[route_id] for route_id in ids]
        assert sorted(a.status_code for a in answers) == [204, 409], [
            (a.status_code, a.text[:200]) for a in answers
        ]
        refused = next(a for a in answers if a.status_code == 409)
        assert refused.json()["error"]["code"] == "route_in_use"
        assert [r["name"] for r in weir.admin.get("/routes").json()["data"]].count("held") == 1
        hi: Any = [{"role": "user", "content": "hi"}]
        answer = weir.openai(issued.json()["key"]).chat.completions.create(model="held", messages=hi)
        assert answer.choices[0].message.content


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_route_written_while_its_tenant_is_deleted_is_not_left_naming_it(
    database: str, vendor_env: dict[str, str], tmp_path: Path
) -> None:
    """One admin creates a route for tenant `doomed` (`when.tenants`) while another deletes it. The
    route's check found the tenant (its delete had not committed) and the delete's rewrite of the
    routes naming it did not see the route (not committed either): both went through, and the route
    was stored naming a tenant that was gone, for a later tenant of that name to get. Both requests
    are held where they would race: on PostgreSQL as they commit (a lock on `audit_log`, which each
    writes), on SQLite at their first write (its write lock: their reads went on without it).
    Whichever order they end in, no stored route names the deleted tenant."""
    with contextlib.ExitStack() as stack:
        if database == "sqlite":
            db = tmp_path / "weir.db"
            url = f"sqlite+aiosqlite:///{db}"
        else:
            url = stack.enter_context(fresh_pg_database("weir_route_races"))
        weir = stack.enter_context(serving(vendor_env, url, tmp_path / "spool", ROUTES))
        tenant = weir.admin.post("/tenants", json={"name": "doomed"}).json()
        route = {**GOOD, "name": "doomed-only", "when": {"tenants": ["doomed"]}}
        results: dict[str, httpx.Response] = {}

        def send(what: str, method: str, path: str, kwargs: dict[str, Any]) -> None:
            with httpx.Client(
                base_url=str(weir.admin.base_url), headers=weir.admin.headers, timeout=60
            ) as admin:
                results[what] = admin.request(method, path, **kwargs)

        threads = [
            threading.Thread(target=send, args=("route", "POST", "/routes", {"json": route})),
            threading.Thread(target=send, args=("tenant", "DELETE", f"/tenants/{tenant['id']}", {})),
        ]
        if database == "sqlite":
            # Both held at their first write, each having read what it read before it.
            engine = weir.router.sessions.kw["bind"]  # type: ignore[attr-defined]
            writers: set[int] = set()

            def note(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
                if statement.split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE"):
                    writers.add(id(conn))

            sqlalchemy.event.listen(engine.sync_engine, "before_cursor_execute", note)
            try:
                with _sqlite_write_lock(db):
                    for thread in threads:
                        thread.start()
                    wait_for(lambda: len(writers) >= 2, timeout=10)
            finally:
                sqlalchemy.event.remove(engine.sync_engine, "before_cursor_execute", note)
        else:
            with _pg_audit_locked(url) as waiting:
                for thread in threads:
                    thread.start()
                wait_for(lambda: waiting() >= 2, timeout=10)
        for thread in threads:
            thread.join(timeout=60)
        assert results["tenant"].status_code == 204, results["tenant"].text
        assert results["route"].status_code in (201, 400), results["route"].text
        stored = weir.admin.get("/routes").json()["data"]
        assert [r for r in stored if "doomed" in ((r.get("when") or {}).get("tenants") or [])] == []
