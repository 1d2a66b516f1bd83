"""Routes, route conditions, the routes admin API, feedback and `weir router score`, pushed with input the
other tests do not send: out-of-range route settings, names the admin DB cannot hold, request ids with
NUL, score input that is not UTF-8 or not the documented shape, a stored route that no longer decodes.
Bad input gets a 4xx in the OpenAI error shape (or an error line) and changes nothing."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
import structlog
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from structlog.testing import capture_logs

from gateway.config import parse_config
from gateway.db.models import Base, RouteRow, utcnow
from routing.cli import router as router_cli
from routing.difficulty import DifficultyClassifier
from routing.router import validate
from routing.routes import Candidate, Route
from routing.store import RouteStore, route_spec, stamp
from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fixtures.db import fresh_pg_database
from tests.fixtures.vendor_gateway import DEMO_KEY, full_config_text
from tests.routing.routed import route_header
from tests.routing.routes_admin import GOOD, ROUTES, Weir, serving

HI = [{"role": "user", "content": "hello audit"}]
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


@pytest.fixture(scope="module")
def _weir(vendor_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weir]:
    """One gateway on a fresh PostgreSQL database."""
    spool = tmp_path_factory.mktemp("spool")
    with fresh_pg_database("weir_routes_audit") as url, serving(vendor_env, url, spool, ROUTES) as weir:
        yield weir


@pytest.fixture
def weir(_weir: Weir, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic) -> Weir:
    return _weir


def _listed(weir: Weir) -> Any:
    response = weir.admin.get("/routes")
    assert response.status_code == 200
    return response.json()


def _openai_error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return dict(error)


def _candidate(**fields: object) -> dict[str, Any]:
    return {**GOOD, "candidates": [{"model": "gpt-4o-mini", **fields}]}


# Each stored as it was before: a negative weight, a hit share above 1, a window of 0, a threshold no
# score reaches, a negative probe interval (probes in a busy loop), a condition no request can meet,
# names and positions the admin DB cannot hold (a 500 before).
REFUSED: list[tuple[dict[str, Any], str]] = [
    (
        {**GOOD, "policy": "weighted", "candidates": [{"model": "gpt-4o-mini", "weight": -1}]},
        "candidates[0].weight",
    ),
    (_candidate(weight=0), "candidates[0].weight"),  # the admin UI asks for a positive weight too
    (_candidate(cache_hit_rate=1.5), "candidates[0].cache_hit_rate"),
    (_candidate(context_window=0), "candidates[0].context_window"),
    # Every attempt on it would have been sent with an output limit of 0 (or less): a vendor's 400.
    (_candidate(max_output_tokens=0), "candidates[0].max_output_tokens"),
    (_candidate(max_output_tokens=-16384), "candidates[0].max_output_tokens"),
    ({**GOOD, "threshold": 2}, "threshold"),
    ({**GOOD, "probe_interval": -1}, "probe_interval"),
    ({**GOOD, "ttft_timeout": 0}, "ttft_timeout"),
    ({**GOOD, "retry": {"jitter": 2}}, "retry.jitter"),
    ({**GOOD, "breaker": {"failures": 0}}, "breaker.failures"),
    ({**GOOD, "hedge": {"delay": -0.5}}, "hedge.delay"),
    ({**GOOD, "failover_on": [200]}, "failover_on[0]"),
    ({**GOOD, "when": {"min_prompt_tokens": 100, "max_prompt_tokens": 10}}, "when"),
    ({**GOOD, "when": {"tags": ["a,b"]}}, "when.tags[0]"),
    ({**GOOD, "when": {"tenants": []}}, "when.tenants"),
    ({**GOOD, "name": ""}, "name"),
    ({**GOOD, "name": "x" * 201}, "name"),
    ({**GOOD, "name": "a\u0000b"}, "name"),
    ({**GOOD, "name": "auto\r\nx-injected: 1"}, "name"),
    ({**GOOD, "position": 2**40}, "position"),
    # Each taken before and then broken at request time or against a backend: 2,000 tries per
    # candidate (the doubling backoff overflowed a float: an OverflowError in the request), probes
    # every microsecond (each backend asked without pause), a cooldown below the shared state's
    # millisecond (Redis refused its TTL: read as Redis unreachable), a spend cap beyond what a
    # count of micro-dollars holds (an OverflowError in the request that would hedge or compare),
    # an output expectation whose price overflows a float.
    ({**GOOD, "retry": {"attempts": 2000}}, "retry.attempts"),
    ({**GOOD, "probe_interval": 1e-6}, "probe_interval"),
    ({**GOOD, "breaker": {"cooldown": 0.0005}}, "breaker.cooldown"),
    ({**GOOD, "hedge": {"max_spend_usd_per_hour": 1e303}}, "hedge.max_spend_usd_per_hour"),
    ({**GOOD, "hedge": {"max_spend_usd_per_hour": 1e7}}, "hedge.max_spend_usd_per_hour"),
    (
        {
            **GOOD,
            "policy": "difficulty",
            "candidates": [{"model": "gpt-4o-mini"}, {"model": "claude-sonnet"}],
            "compare": {"judge": "gpt-4o-mini", "max_spend_usd_per_hour": 1e303},
        },
        "compare.max_spend_usd_per_hour",
    ),
    ({**GOOD, "expected_output_tokens": 10**301}, "expected_output_tokens"),
]


@pytest.mark.postgres
def test_out_of_range_route_settings_are_refused_and_change_nothing(weir: Weir) -> None:
    before = _listed(weir)
    for body, param in REFUSED:
        error = _openai_error(weir.admin.post("/routes", json=body))
        assert (error["param"], error["code"]) == (param, "invalid_value"), (body, error)
    # A replacement with a bad body leaves the route as it was.
    first = before["data"][0]
    error = _openai_error(weir.admin.put(f"/routes/{first['id']}", json={**GOOD, "threshold": -0.1}))
    assert error["param"] == "threshold"
    assert _listed(weir) == before  # nothing stored, the version in force unchanged
    # The edges of the ranges are accepted (and removed again).
    edge = {
        **GOOD,
        "threshold": 1.0,
        # A window beyond a float's range was an OverflowError in the check itself (a 500).
        "candidates": [
            {
                "model": "gpt-4o-mini",
                "weight": 1e-300,
                "cache_hit_rate": 1,
                "context_window": 10**400,
                "max_output_tokens": 1,
            }
        ],
        "retry": {"attempts": 100, "backoff": 0, "max_backoff": 0},
        "probe_interval": 0.1,
        "breaker": {"cooldown": 0.001},
        "hedge": {"delay": 0, "min_delay": 0, "max_spend_usd_per_hour": 1e6},
        "expected_output_tokens": 2**31 - 1,
    }
    created = weir.admin.post("/routes", json={**edge, "position": 2**31 - 1})
    assert created.status_code == 201, created.text
    assert weir.admin.delete(f"/routes/{created.json()['id']}").status_code == 204


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_route_created_after_one_at_the_last_position(
    vendor_env: dict[str, str], database: str, tmp_path: Path
) -> None:
    """A route created without `position` went to the largest position + 1: after a route at the last
    position the column holds (2**31 - 1, which the API accepts) that was a 500 on PostgreSQL, and on
    SQLite a position PostgreSQL cannot hold. It takes the last position too, and still comes after
    that route: routes of one position are tried in the order they were created."""
    with ExitStack() as stack:
        if database == "postgres":
            url = stack.enter_context(fresh_pg_database("weir_routes_position"))
        else:
            url = f"sqlite+aiosqlite:///{tmp_path}/weir.db"
        weir = stack.enter_context(serving(vendor_env, url, tmp_path))
        last = weir.admin.post("/routes", json={**GOOD, "position": 2**31 - 1})
        assert last.status_code == 201, last.text
        after = weir.admin.post("/routes", json={**GOOD, "candidates": [{"model": "claude-sonnet"}]})
        assert after.status_code == 201, after.text
        assert after.json()["position"] == 2**31 - 1
        assert [r["id"] for r in _listed(weir)["data"]][-2:] == [last.json()["id"], after.json()["id"]]
        served = weir.admin.get("/routes/status").json()["routes"][GOOD["name"]]
        assert [c["model"] for r in served for c in r["candidates"]] == ["gpt-4o-mini", "claude-sonnet"]


@pytest.mark.postgres
def test_a_route_read_edited_and_sent_back_is_accepted(weir: Weir) -> None:
    created = weir.admin.post("/routes", json={**GOOD, "name": "round-trip"})
    assert created.status_code == 201, created.text
    read = weir.admin.get(f"/routes/{created.json()['id']}").json()
    try:
        replaced = weir.admin.put(f"/routes/{read['id']}", json={**read, "threshold": 0.7})
        assert replaced.status_code == 200, replaced.text
        assert replaced.json()["threshold"] == 0.7 and replaced.json()["updated_at"] >= read["updated_at"]
        # A body that is another route's is refused, and changes nothing.
        other = _listed(weir)["data"][0]
        error = _openai_error(weir.admin.put(f"/routes/{other['id']}", json={**read, "threshold": 0.9}))
        assert error["param"] == "id"
        assert weir.admin.get(f"/routes/{other['id']}").json() == other
    finally:
        assert weir.admin.delete(f"/routes/{read['id']}").status_code == 204


def test_bad_route_settings_in_the_config_name_the_key() -> None:
    from gateway.config import ConfigError

    names = ("OPENAI", "ANTHROPIC", "GEMINI", "DEEPSEEK")
    env = {f"{n}_BASE_URL": "http://127.0.0.1:9" for n in names} | {f"{n}_API_KEY": "k" for n in names}
    env |= {"DEAD_PORT": "9", "WEIR_DEMO_KEY": "a", "WEIR_LIMITED_KEY": "b"}
    routes = "routes:\n  - {name: r, probe_interval: -5, candidates: [{model: gpt-5}]}\n"
    with pytest.raises(
        ConfigError, match=r"routes\[0\] \(r\)\.probe_interval: must be a number at least 0\.1"
    ):
        parse_config(full_config_text() + routes, env)
    routes = "routes:\n  - {name: r, candidates: [{model: gpt-5, weight: .nan}]}\n"
    with pytest.raises(ConfigError, match=r"candidates\[0\]\.weight"):
        parse_config(full_config_text() + routes, env)
    routes = "routes:\n  - {name: r, candidates: [{model: gpt-5, max_output_tokens: 0}]}\n"
    with pytest.raises(
        ConfigError,
        match=r"routes\[0\] \(r\)\.candidates\[0\]\.max_output_tokens: must be a number at least 1",
    ):
        parse_config(full_config_text() + routes, env)
    routes = "routes:\n  - {name: r, retry: {attempts: 2000}, candidates: [{model: gpt-5}]}\n"
    with pytest.raises(
        ConfigError, match=r"routes\[0\] \(r\)\.retry\.attempts: must be a number from 1 to 100"
    ):
        parse_config(full_config_text() + routes, env)
    # A whole number is finite however large: checked, it was an OverflowError (a traceback at start).
    routes = f"routes:\n  - {{name: r, candidates: [{{model: gpt-5, context_window: {10**400}}}]}}\n"
    assert parse_config(full_config_text() + routes, env).routes[0].candidates[0].context_window == 10**400


@pytest.mark.postgres
def test_feedback_with_a_request_id_the_db_cannot_hold_is_a_400_not_a_500(weir: Weir) -> None:
    key = weir.key("acme")
    auth = {"authorization": f"Bearer {key}"}
    posted = httpx.post(
        f"{weir.url}/v1/feedback", json={"request_id": "a\u0000b", "score": 0.5}, headers=auth
    )
    assert _openai_error(posted)["param"] == "request_id"
    read = httpx.get(f"{weir.url}/v1/feedback/a%00b", headers=auth)
    assert _openai_error(read, 404)["code"] == "not_found"
    # Feedback on an id the caller never got, or on another tenant's request, is the caller's own row:
    # the other tenant reads none of it.
    raw = weir.openai(key).chat.completions.with_raw_response.create(model="auto", messages=HI)  # type: ignore[arg-type]
    request_id = raw.headers["x-request-id"]
    other = {"authorization": f"Bearer {weir.key('globex')}"}
    assert httpx.post(
        f"{weir.url}/v1/feedback", json={"request_id": request_id, "score": 0.0}, headers=other
    ).is_success
    assert _openai_error(httpx.get(f"{weir.url}/v1/feedback/{request_id}", headers=auth), 404)


@pytest.mark.postgres
def test_feedback_under_an_id_no_request_carries_is_a_400_not_stored(weir: Weir) -> None:
    """Request ids are letters, digits and `._:-` (gateway.ids.is_request_id). Feedback under any
    other id (`run/42`) was stored with a 200, and then could be neither read back (`GET
    /v1/feedback/run%2F42` is a 404) nor joined with a request: lost while the client was told it was
    kept. It is refused like an id too long for the column."""
    auth = {"authorization": f"Bearer {weir.key('acme')}"}
    for request_id in ("run/42", "a b", "café", "x" * 129):
        posted = httpx.post(
            f"{weir.url}/v1/feedback", json={"request_id": request_id, "score": 0.5}, headers=auth
        )
        assert _openai_error(posted)["param"] == "request_id", request_id
    # Every character a request id may hold is taken, and read back.
    request_id = "Run-42_a.b:c"
    assert httpx.post(
        f"{weir.url}/v1/feedback", json={"request_id": request_id, "score": 0.5}, headers=auth
    ).is_success
    assert httpx.get(f"{weir.url}/v1/feedback/{request_id}", headers=auth).json()["score"] == 0.5


@pytest.mark.postgres
def test_the_route_header_on_errors_and_on_anthropic_requests_with_images(weir: Weir) -> None:
    key = weir.key("acme")
    with pytest.raises(openai.APIStatusError) as caught:
        weir.openai(key).chat.completions.create(model="down", messages=HI)  # type: ignore[arg-type]
    header = route_header(caught.value.response)
    assert (header["route"], header["candidate"], header["attempts"]) == ("down", "dead-model", "1")

    client = anthropic.Anthropic(base_url=weir.url, api_key=key, max_retries=0, timeout=20)
    image: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    text: Any = {"type": "text", "text": "what is this?"}
    raw = client.messages.with_raw_response.create(
        model="vis", max_tokens=16, messages=[{"role": "user", "content": [text, image]}]
    )
    assert route_header(raw)["candidate"] == "claude-sonnet"  # `images: true` matched
    raw = client.messages.with_raw_response.create(
        model="vis", max_tokens=16, messages=[{"role": "user", "content": [text]}]
    )
    assert route_header(raw)["candidate"] == "gpt-4o-mini"
    with pytest.raises(anthropic.APIStatusError) as failed:
        client.messages.create(model="down", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert route_header(failed.value.response)["candidate"] == "dead-model"


@pytest.mark.postgres
def test_a_tenant_scoped_route_ahead_of_a_global_one_of_the_same_name(weir: Weir) -> None:
    """Conditions name tenants by name (DB tenants too); the first matching route by position wins."""
    tenant = f"scoped-{uuid.uuid4().hex[:6]}"
    created = weir.admin.post("/tenants", json={"name": tenant})
    scoped_key = weir.admin.post(f"/tenants/{created.json()['id']}/keys", json={"name": "app"}).json()["key"]
    other_key = weir.key("other")
    general = weir.admin.post("/routes", json={**GOOD, "name": "mixed"})
    scoped = weir.admin.post(
        "/routes",
        json={
            **GOOD,
            "name": "mixed",
            "when": {"tenants": [tenant]},
            "candidates": [{"model": "claude-sonnet"}],
        },
    )
    assert general.status_code == scoped.status_code == 201

    def candidate(key: str) -> str:
        raw = weir.openai(key).chat.completions.with_raw_response.create(model="mixed", messages=HI)  # type: ignore[arg-type]
        return route_header(raw)["candidate"]

    try:
        assert candidate(scoped_key) == candidate(other_key) == "gpt-4o-mini"  # the global one is first
        spec = {k: v for k, v in scoped.json().items() if k not in ("id", "updated_at")}
        moved = weir.admin.put(f"/routes/{scoped.json()['id']}", json={**spec, "position": -1})
        assert moved.status_code == 200, moved.text
        assert (candidate(scoped_key), candidate(other_key)) == ("claude-sonnet", "gpt-4o-mini")
    finally:
        for route in (general, scoped):
            weir.admin.delete(f"/routes/{route.json()['id']}")


async def _route_table(tmp_path: Path) -> tuple[AsyncEngine, async_sessionmaker[AsyncSession]]:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/routes.db")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    return engine, async_sessionmaker(engine, expire_on_commit=False)


def _models(routes: Sequence[Route]) -> list[list[str]]:
    return [[c.model for c in r.candidates] for r in routes]


async def test_a_stored_route_that_no_longer_decodes_is_left_out(tmp_path: Path) -> None:
    """A row written by another version (an unknown field) is logged and left out like any route this
    replica cannot serve, not raised out of the poll (at start that was a gateway that would not start);
    the other rows are served."""
    engine, sessions = await _route_table(tmp_path)
    applied: list[list[Route]] = []
    good = Route(name="auto", candidates=[])
    store = RouteStore(sessions, applied.append, seed=[good])
    try:
        await store.start()
        await store.stop()
        assert [[r.name for r in routes] for routes in applied] == [["auto"]]
        async with sessions() as session, session.begin():
            newer = RouteRow(name="newer", position=5, spec={**msgspec.to_builtins(good), "later": 1})
            session.add(newer)
        with capture_logs() as logs:
            assert await store.refresh() is True
        assert [r.name for r in applied[-1]] == ["auto"]
        assert [(r.id, r.name) for r in store.left_out] == [(newer.id, "newer")]
        assert "later" in store.left_out[0].error and store.rejected is None
        assert any(e["event"] == "route_left_out" and "later" in e["error"] for e in logs)
    finally:
        await engine.dispose()


async def test_an_edit_after_a_left_out_route_reaches_the_replica(tmp_path: Path) -> None:
    """A replica that left a route out (its model removed from this replica's config) applied no later
    edit: every refresh checked the whole table again, the row left out failed it, and the first load's
    routes stayed in force for as long as that row was in the table. Every load now serves what
    validates, so the edit is in force, and the row left out is still named."""
    engine, sessions = await _route_table(tmp_path)
    models = {"gpt-4o-mini", "claude-sonnet"}  # `retired` was removed from this replica's config
    auto = Route(name="auto", candidates=[Candidate(model="gpt-4o-mini")])
    old = Route(name="old", candidates=[Candidate(model="retired")])  # valid where it was written
    async with sessions() as session, session.begin():
        session.add(RouteRow(name="auto", position=0, spec=route_spec(auto)))
        session.add(stale := RouteRow(name="old", position=1, spec=route_spec(old)))
    applied: list[list[Route]] = []

    def apply(routes: Sequence[Route]) -> None:  # what Router.set_routes does first
        validate(routes, models)
        applied.append(list(routes))

    store = RouteStore(sessions, apply, seed=[], check=lambda r: validate([r], models))
    try:
        await store._seed()
        assert await store.refresh() is True
        assert _models(applied[-1]) == [["gpt-4o-mini"]]
        async with sessions() as session, session.begin():  # an admin edits `auto` (valid here too)
            row = (await session.scalars(select(RouteRow).where(RouteRow.name == "auto"))).one()
            edited = Route(name="auto", candidates=[Candidate(model="claude-sonnet")])
            row.spec, row.updated_at = route_spec(edited), utcnow()
        assert await store.refresh() is True
        assert _models(applied[-1]) == [["claude-sonnet"]]
        assert [(r.id, r.name) for r in store.left_out] == [(stale.id, "old")]
        assert "retired" in store.left_out[0].error and store.rejected is None
    finally:
        await engine.dispose()


async def test_a_table_refused_as_a_whole_keeps_the_routes_in_force(tmp_path: Path) -> None:
    """What only the table as a whole can break (rows that depend on each other; here a stand-in rule
    against two routes of one name) is still all or nothing: the routes in force stay, and why the
    newer table was refused is kept until a table is applied."""
    engine, sessions = await _route_table(tmp_path)
    applied: list[list[str]] = []

    def apply(routes: Sequence[Route]) -> None:
        names = [r.name for r in routes]
        if len(set(names)) < len(names):
            raise ValueError("two routes named dup")
        applied.append(names)

    def row(name: str) -> RouteRow:
        return RouteRow(name=name, position=0, spec=route_spec(Route(name=name, candidates=[])))

    store = RouteStore(sessions, apply, seed=[Route(name="a", candidates=[])])
    try:
        await store.start()
        await store.stop()
        async with sessions() as session, session.begin():
            session.add_all([row("dup"), second := row("dup")])
        with capture_logs() as logs:
            assert await store.refresh() is False
        assert applied == [["a"]] and store.rejected == "two routes named dup" and store.left_out == []
        assert any(e["event"] == "routes_rejected" for e in logs)
        async with sessions() as session, session.begin():
            await session.delete(await session.get(RouteRow, second.id))
        assert await store.refresh() is True
        assert applied[-1] == ["a", "dup"] and store.rejected is None
    finally:
        await engine.dispose()


def _events(logs: Sequence[dict[str, Any]], *events: str) -> list[tuple[str, str, Any]]:
    """(event, level, what it names) of the log lines about routes left out or refused."""
    return [(e["event"], e["log_level"], e.get("name", e.get("error"))) for e in logs if e["event"] in events]


async def test_a_route_left_out_is_logged_when_that_changes_not_on_every_load(tmp_path: Path) -> None:
    """Every edit to any route reloads the table on every replica, and every load logged each row it
    left out again, at error level: a row whose model one replica's config dropped repeated the same
    error once per edit per replica for as long as it stayed, burying new errors. It is now logged when
    first left out and when its reason changes, and once (info) when it loads again or is gone; what
    each load leaves out (`left_out`, which the gauge counts) is still that load's."""
    engine, sessions = await _route_table(tmp_path)
    models = {"gpt-4o-mini", "claude-sonnet"}  # `retired` and `gone` are not in this replica's config
    auto = Route(name="auto", candidates=[Candidate(model="gpt-4o-mini")])
    old = Route(name="old", candidates=[Candidate(model="retired")])
    async with sessions() as session, session.begin():
        session.add(first := RouteRow(name="auto", position=0, spec=route_spec(auto)))
        session.add(stale := RouteRow(name="old", position=1, spec=route_spec(old)))
    store = RouteStore(
        sessions, lambda routes: validate(routes, models), seed=[], check=lambda r: validate([r], models)
    )
    left_out = ("route_left_out", "route_left_out_cleared")

    async def edit(row_id: int, model: str) -> list[dict[str, Any]]:
        """Point the row at `model` and reload as a replica's poll does: that load's log lines."""
        async with sessions() as session, session.begin():
            row = await session.get(RouteRow, row_id)
            assert row is not None
            spec = route_spec(Route(name=row.name, candidates=[Candidate(model=model)]))
            row.spec, row.updated_at = spec, await stamp(session, utcnow())
        with capture_logs() as logs:
            assert await store.refresh() is True
        return logs

    try:
        await store._seed()
        with capture_logs() as logs:
            assert await store.refresh() is True
        assert _events(logs, *left_out) == [("route_left_out", "error", "old")]
        for model in ("claude-sonnet", "gpt-4o-mini", "claude-sonnet"):  # edits to another route
            assert _events(await edit(first.id, model), *left_out) == []
            assert [(r.id, r.name) for r in store.left_out] == [(stale.id, "old")]
        logs = await edit(stale.id, "gone")  # still left out, for another reason
        assert _events(logs, *left_out) == [("route_left_out", "error", "old")]
        assert "'gone'" in logs[0]["error"] and "'gone'" in store.left_out[0].error
        assert _events(await edit(stale.id, "gpt-4o-mini"), *left_out) == [
            ("route_left_out_cleared", "info", "old")
        ]
        assert store.left_out == []
        assert _events(await edit(first.id, "gpt-4o-mini"), *left_out) == []
    finally:
        await engine.dispose()


async def test_a_refused_table_is_logged_when_the_refusal_changes_not_on_every_load(tmp_path: Path) -> None:
    """Each load of a table refused as a whole logged `routes_rejected` again, for every edit until it
    was fixed. It is now logged when the table is first refused and when the reason changes, and once
    (info) when a table loads again; `rejected` (what the gauge reads) is still each load's."""
    engine, sessions = await _route_table(tmp_path)

    def apply(routes: Sequence[Route]) -> None:  # stand-in rules across rows
        names = [r.name for r in routes]
        for name in sorted(set(names)):
            if names.count(name) > 1:
                raise ValueError(f"two routes named {name}")

    def row(name: str) -> RouteRow:
        return RouteRow(name=name, position=0, spec=route_spec(Route(name=name, candidates=[])))

    async def change(*, add: Sequence[str] = (), remove: Sequence[int] = ()) -> list[dict[str, Any]]:
        async with sessions() as session, session.begin():
            session.add_all([row(name) for name in add])
            for row_id in remove:
                await session.delete(await session.get(RouteRow, row_id))
        with capture_logs() as logs:
            await store.refresh()
        return logs

    store = RouteStore(sessions, apply, seed=[Route(name="a", candidates=[])])
    rejected = ("routes_rejected", "routes_rejected_cleared")
    try:
        await store._seed()
        await store.refresh()
        async with sessions() as session, session.begin():
            session.add(second := row("dup"))
        assert _events(await change(add=["dup"]), *rejected) == [
            ("routes_rejected", "error", "two routes named dup")
        ]
        assert _events(await change(add=["b"]), *rejected) == []  # still refused, for the same reason
        assert store.rejected == "two routes named dup"
        async with sessions() as session, session.begin():
            session.add(third := row("b"))
        assert _events(await change(remove=[second.id]), *rejected) == [
            ("routes_rejected", "error", "two routes named b")
        ]
        assert _events(await change(remove=[third.id]), *rejected) == [
            ("routes_rejected_cleared", "info", None)
        ]
        assert store.rejected is None
        assert _events(await change(add=["c"]), *rejected) == []
    finally:
        await engine.dispose()


def _gauge(weir: Weir, name: str) -> float | None:
    """The value of a gauge without labels on the gateway's /metrics, None when it is not exported."""
    families = text_string_to_metric_families(httpx.get(f"{weir.url}/metrics").text)
    found = [s.value for f in families for s in f.samples if s.name == name]
    return found[0] if found else None


def _leave_out(weir: Weir, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this replica's route load leave out routes named `name` ("not served here")."""
    store = weir.router.store
    assert store is not None
    checked = store.check

    def stricter(route: Route) -> None:
        if route.name == name:
            raise ValueError("not served here")
        if checked is not None:
            checked(route)

    monkeypatch.setattr(store, "check", stricter)


@pytest.mark.postgres
def test_a_write_this_replica_leaves_out_is_not_answered_as_in_force(
    weir: Weir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admin API checks a route as this replica's load does, so a route it stores is served. Should
    the load leave it out all the same (here the store's check is made stricter), the write is not
    answered as done: a 409 that says it is stored and why this replica does not serve it, and
    routes/status lists it."""
    _leave_out(weir, "left-out", monkeypatch)
    error = _openai_error(weir.admin.post("/routes", json={**GOOD, "name": "left-out"}), 409)
    stored = {r["name"]: r["id"] for r in _listed(weir)["data"]}["left-out"]
    try:
        assert error["code"] == "route_left_out"
        assert f"route {stored} (left-out) is stored" in error["message"]
        assert "not served here" in error["message"]
        status = weir.admin.get("/routes/status").json()
        assert status["left_out"] == [{"id": stored, "name": "left-out", "error": "not served here"}]
        assert "left-out" not in status["routes"] and status["routes_rejected"] is None
    finally:
        assert weir.admin.delete(f"/routes/{stored}").status_code == 204
    assert weir.admin.get("/routes/status").json()["left_out"] == []


@pytest.mark.postgres
def test_metrics_count_the_stored_routes_this_replica_leaves_out(
    weir: Weir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routes stored but left out by this replica showed only in routes/status and a log line: nothing
    to alert on. `weir_routes_left_out` counts them, and is back to 0 once they are fixed or gone."""
    assert _gauge(weir, "weir_routes_left_out") == 0
    _leave_out(weir, "left-out", monkeypatch)
    assert weir.admin.post("/routes", json={**GOOD, "name": "left-out"}).status_code == 409
    stored = {r["name"]: r["id"] for r in _listed(weir)["data"]}["left-out"]
    try:
        assert _gauge(weir, "weir_routes_left_out") == 1
    finally:
        assert weir.admin.delete(f"/routes/{stored}").status_code == 204
    assert _gauge(weir, "weir_routes_left_out") == 0


@pytest.mark.postgres
def test_the_routes_list_names_the_stored_routes_this_replica_leaves_out(
    weir: Weir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admin who must fix a route left out reads the routes list (the admin UI's routes page is
    built from it), which listed every stored row alike: only routes/status, a log line and a gauge
    said which one this replica did not serve, and why. The list now carries `left_out` beside
    `version` and `data`, as routes/status does; `data` still lists every stored row, to fix or delete."""
    listed = _listed(weir)
    assert listed["left_out"] == [] and listed["routes_rejected"] is None
    _leave_out(weir, "left-out", monkeypatch)
    assert weir.admin.post("/routes", json={**GOOD, "name": "left-out"}).status_code == 409
    listed = _listed(weir)
    stored = {r["name"]: r["id"] for r in listed["data"]}["left-out"]
    try:
        assert set(listed) == {"version", "data", "left_out", "routes_rejected", "model_max_output_tokens"}
        assert listed["left_out"] == [{"id": stored, "name": "left-out", "error": "not served here"}]
        assert listed["routes_rejected"] is None
        assert weir.admin.get("/routes/status").json()["left_out"] == listed["left_out"]
    finally:
        assert weir.admin.delete(f"/routes/{stored}").status_code == 204
    assert _listed(weir)["left_out"] == []


@pytest.mark.postgres
def test_the_routes_list_and_metrics_say_when_this_replica_refuses_the_table(
    weir: Weir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table refused as a whole (the routes in force stay, no edit reaches this replica) had no
    metric and showed only in routes/status: `weir_routes_rejected` is 1 while it lasts (the shipped
    alert WeirRoutesRejected), and the routes list says why in `routes_rejected`."""
    store = weir.router.store
    assert store is not None
    apply = store.apply

    def refusing(routes: Sequence[Route]) -> None:  # a stand-in rule across rows: the router has none
        if any(r.name == "refused" for r in routes):
            raise ValueError("a stand-in rule refused the table")
        apply(routes)

    assert _gauge(weir, "weir_routes_rejected") == 0
    monkeypatch.setattr(store, "apply", refusing)
    error = _openai_error(weir.admin.post("/routes", json={**GOOD, "name": "refused"}), 409)
    listed = _listed(weir)
    stored = {r["name"]: r["id"] for r in listed["data"]}["refused"]
    try:
        assert "a stand-in rule refused the table" in error["message"]
        assert listed["routes_rejected"] == "a stand-in rule refused the table" and listed["left_out"] == []
        assert _gauge(weir, "weir_routes_rejected") == 1
    finally:
        assert weir.admin.delete(f"/routes/{stored}").status_code == 204
    assert _listed(weir)["routes_rejected"] is None
    assert _gauge(weir, "weir_routes_rejected") == 0


def test_score_answers_every_bad_line_in_place_without_a_traceback(classifier: DifficultyClassifier) -> None:
    lines = [
        b'{"prompt": "What is 2 + 2?"}',
        b'{"prompt": "caf\xe9"}',  # Latin-1, not UTF-8
        b'{"prompt": "\\ud800 lone surrogate"}',
        b'{"messages": ["hello"]}',
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        b"[" * 50_000,
        b"",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "Prove it."}]}]}',
        # No chat the chat API takes, and no user text to read: each was scored as the empty prompt.
        b'{"messages": [{"role": "user", "content": 5}]}',
        b'{"messages": [{"role": "user", "content": {"text": "Prove it."}}]}',  # an object, not parts
        b'{"messages": [{"role": "User", "content": "Prove it."}]}',  # a role typo
        b'{"messages": [{"role": "system", "content": "Be brief."}]}',  # no user turn
    ]
    saved = structlog.get_config()  # the command points structlog at its stderr
    try:
        result = CliRunner().invoke(
            router_cli, ["score", "--shipped", "encoder"], input=b"\n".join(lines) + b"\n"
        )
    finally:
        structlog.configure(**saved)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    # Every line answers, in order; the blank one with a blank line.
    answers = result.stdout.splitlines()
    assert len(answers) == len(lines) and answers[6] == ""
    out = [json.loads(line) if line else None for line in answers]
    assert out[0]["p_strong"] == pytest.approx(classifier.score("What is 2 + 2?"), abs=1e-6)
    assert out[7]["p_strong"] == pytest.approx(classifier.score("Prove it."), abs=1e-6)
    errors = [o["error"] for o in out[1:6] + out[8:]]
    assert [e.split(":", 1)[0] for e in errors] == [f"line {n}" for n in [*range(2, 7), *range(9, 13)]]
    assert "UTF-8" in errors[0] and "surrogate" in errors[1] and "messages[0]" in errors[2]
    assert "messages[0].content[0].text" in errors[3] and "nested" in errors[4]
    assert "messages[0].content" in errors[5] and "messages[0].content" in errors[6]
    assert "'User'" in errors[7] and "messages[0].role" in errors[7]
    assert 'no "user" turn' in errors[8]
    assert "9 line(s) could not be scored" in result.stderr


@pytest.mark.postgres
def test_the_last_route_of_a_name_a_key_may_use_is_not_deleted_or_renamed_away(weir: Weir) -> None:
    """A key's `models` naming no route or model is refused when the key is issued (it could never use
    it); deleting, or renaming, the last route of a name such a key holds made the same key after the
    fact: every request of it for that name a 404, and nothing said. A 409 names the keys, nothing
    changes; with another route of the name, or once the keys are revoked, the route goes."""
    name = f"held-{uuid.uuid4().hex[:6]}"
    created = weir.admin.post("/routes", json={**GOOD, "name": name})
    assert created.status_code == 201, created.text
    route_id = created.json()["id"]
    tenant = weir.admin.post("/tenants", json={"name": f"holder-{uuid.uuid4().hex[:6]}"}).json()
    issued = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "app", "models": [name]})
    assert issued.status_code == 201, issued.text
    before = _listed(weir)["data"]
    error = _openai_error(weir.admin.delete(f"/routes/{route_id}"), 409)
    assert error["code"] == "route_in_use" and issued.json()["id"] in error["message"]
    error = _openai_error(weir.admin.put(f"/routes/{route_id}", json={**GOOD, "name": f"{name}-2"}), 409)
    assert error["code"] == "route_in_use"
    assert _listed(weir)["data"] == before
    answer = weir.openai(issued.json()["key"]).chat.completions.with_raw_response.create(
        model=name, messages=HI
    )
    assert route_header(answer)["route"] == name
    # Edits that keep the name are not in its way, nor is a second route of the name.
    assert (
        weir.admin.put(f"/routes/{route_id}", json={**GOOD, "name": name, "threshold": 0.6}).status_code
        == 200
    )
    second = weir.admin.post("/routes", json={**GOOD, "name": name})
    assert weir.admin.delete(f"/routes/{route_id}").status_code == 204
    # Revoked, the key names nothing that matters: the last route goes.
    assert weir.admin.delete(f"/keys/{issued.json()['id']}").status_code == 204
    assert weir.admin.delete(f"/routes/{second.json()['id']}").status_code == 204


@pytest.mark.postgres
def test_a_tenant_renamed_keeps_the_routes_whose_conditions_name_it(weir: Weir) -> None:
    """Routes know tenants by name (`when.tenants`): renaming a tenant through the admin API left its
    routes naming the old name, so its requests silently went to the route for everyone else. The
    rename carries over to the stored routes (audited), on this replica at once."""
    name = f"ren-{uuid.uuid4().hex[:6]}"
    tenant = weir.admin.post("/tenants", json={"name": f"{name}-old"}).json()
    key = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "app"}).json()["key"]
    scoped = weir.admin.post(
        "/routes",
        json={
            **GOOD,
            "name": name,
            "when": {"tenants": [f"{name}-old", "demo"]},
            "candidates": [{"model": "claude-sonnet"}],
        },
    )
    everyone = weir.admin.post("/routes", json={**GOOD, "name": name})
    assert scoped.status_code == everyone.status_code == 201

    def candidate() -> str:
        answer = weir.openai(key).chat.completions.with_raw_response.create(model=name, messages=HI)
        return route_header(answer)["candidate"]

    try:
        assert candidate() == "claude-sonnet"
        renamed = weir.admin.patch(f"/tenants/{tenant['id']}", json={"name": f"{name}-new"})
        assert renamed.status_code == 200, renamed.text
        assert candidate() == "claude-sonnet"
        assert weir.admin.get(f"/routes/{scoped.json()['id']}").json()["when"]["tenants"] == [
            f"{name}-new",
            "demo",
        ]
        assert weir.admin.get(f"/routes/{everyone.json()['id']}").json().get("when") is None
        # A rename refused (the name is another tenant's) renames nothing in the routes either.
        taken = weir.admin.post("/tenants", json={"name": f"{name}-taken"}).json()["name"]
        assert weir.admin.patch(f"/tenants/{tenant['id']}", json={"name": taken}).status_code == 409
        assert weir.admin.get(f"/routes/{scoped.json()['id']}").json()["when"]["tenants"][0] == f"{name}-new"
    finally:
        for created in (scoped, everyone):
            weir.admin.delete(f"/routes/{created.json()['id']}")


@pytest.mark.postgres
def test_a_tenant_deleted_leaves_no_route_to_a_later_tenant_of_its_name(weir: Weir) -> None:
    """Routes know tenants by name (`when.tenants`): deleting a tenant left its routes naming it, so a
    tenant created later with the same name silently got them (another customer's dedicated models).
    The delete takes the name out of the stored routes (audited); a route that named only it is
    deleted, never left open to every tenant."""
    name = f"del-{uuid.uuid4().hex[:6]}"
    tenant = weir.admin.post("/tenants", json={"name": name}).json()
    shared = weir.admin.post(
        "/routes",
        json={
            **GOOD,
            "name": name,
            "when": {"tenants": [name, "demo"]},
            "candidates": [{"model": "claude-sonnet"}],
        },
    )
    own = weir.admin.post(
        "/routes",
        json={
            **GOOD,
            "name": f"{name}-own",
            "when": {"tenants": [name]},
            "candidates": [{"model": "claude-sonnet"}],
        },
    )
    everyone = weir.admin.post("/routes", json={**GOOD, "name": name})
    assert shared.status_code == own.status_code == everyone.status_code == 201
    try:
        assert weir.admin.delete(f"/tenants/{tenant['id']}").status_code == 204
        assert weir.admin.get(f"/routes/{shared.json()['id']}").json()["when"]["tenants"] == ["demo"]
        assert weir.admin.get(f"/routes/{own.json()['id']}").status_code == 404
        audited = {
            (e["action"], e["entity_id"])
            for e in weir.admin.get("/audit", params={"entity": "route"}).json()["data"]
        }
        assert {("update", str(shared.json()["id"])), ("delete", str(own.json()["id"]))} <= audited

        # A new tenant of the same name gets what everyone gets, not the deleted tenant's routes.
        later = weir.admin.post("/tenants", json={"name": name}).json()
        key = weir.admin.post(f"/tenants/{later['id']}/keys", json={"name": "app"}).json()["key"]
        answer = weir.openai(key).chat.completions.with_raw_response.create(model=name, messages=HI)
        assert route_header(answer)["candidate"] == "gpt-4o-mini"
        with pytest.raises(openai.NotFoundError):
            weir.openai(key).chat.completions.create(model=f"{name}-own", messages=HI)
    finally:
        for created in (shared, own, everyone):
            weir.admin.delete(f"/routes/{created.json()['id']}")


@pytest.mark.postgres
def test_route_conditions_naming_no_tenant_or_key_are_refused_on_create_and_replace(weir: Weir) -> None:
    """`when.tenants` and `when.keys` name tenants and keys that exist: a typo made a route that never
    matched, and the tenant it was for silently got what everyone gets. A 400 names each unknown one
    in `param` `when.tenants`/`when.keys` and nothing is stored; admin-DB and config tenants and keys
    (revoked ones too) are taken."""
    name = f"who-{uuid.uuid4().hex[:6]}"
    tenant = weir.admin.post("/tenants", json={"name": name}).json()
    key = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "app"}).json()
    assert weir.admin.delete(f"/keys/{key['id']}").status_code == 204
    before = _listed(weir)["data"]
    typo = {**GOOD, "name": name, "when": {"tenants": [name, f"{name}x", "demo", f"{name}x"]}}
    error = _openai_error(weir.admin.post("/routes", json=typo))
    assert (error["code"], error["param"]) == ("invalid_value", "when.tenants")
    assert f"'{name}x'" in error["message"] and f"'{name}'" not in error["message"]
    error = _openai_error(weir.admin.post("/routes", json={**GOOD, "when": {"keys": [key["id"], "k-typo"]}}))
    assert error["param"] == "when.keys" and "'k-typo'" in error["message"]
    assert key["id"] not in error["message"]
    assert _listed(weir)["data"] == before

    config_key = "key_" + hashlib.sha256(DEMO_KEY.encode()).hexdigest()[:12]
    good = {**GOOD, "name": name, "when": {"tenants": [name, "demo"], "keys": [key["id"], config_key]}}
    created = weir.admin.post("/routes", json=good)
    assert created.status_code == 201, created.text
    route_id = created.json()["id"]
    try:
        stored = weir.admin.get(f"/routes/{route_id}").json()
        error = _openai_error(weir.admin.put(f"/routes/{route_id}", json=typo))
        assert error["param"] == "when.tenants"
        error = _openai_error(
            weir.admin.put(f"/routes/{route_id}", json={**good, "when": {"keys": ["k-typo"]}})
        )
        assert error["param"] == "when.keys"
        assert weir.admin.get(f"/routes/{route_id}").json() == stored
    finally:
        weir.admin.delete(f"/routes/{route_id}")


def test_routes_seeded_from_the_config_follow_a_tenant_renamed_or_deleted(
    vendor_env: dict[str, str], tmp_path: Path
) -> None:
    """The config's `routes:` are stored in the admin DB once (the first start on it) and never read
    from the file again: a route of the file naming a tenant is a stored route like any other, which a
    rename or delete of the tenant rewrites, and a restart with the same file brings back neither the
    old name nor a route deleted with its tenant. So a rename or delete needs no refusal for them."""
    seeded = (
        ROUTES
        + "  - {name: seeded, when: {tenants: [sd-acme]}, candidates: [{model: claude-sonnet}], "
        + "probe_interval: null}\n  - {name: seeded, candidates: [{model: gpt-4o-mini}], probe_interval: null}\n"
    )
    url = f"sqlite+aiosqlite:///{tmp_path}/weir.db"

    def served(weir: Weir) -> list[dict[str, Any]]:
        return [r for r in _listed(weir)["data"] if r["name"] == "seeded"]

    with serving(vendor_env, url, tmp_path / "one", seeded) as weir:
        tenant = weir.admin.post("/tenants", json={"name": "sd-acme"}).json()
        key = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "app"}).json()["key"]
        assert weir.admin.patch(f"/tenants/{tenant['id']}", json={"name": "sd-acme2"}).status_code == 200
        assert served(weir)[0]["when"]["tenants"] == ["sd-acme2"]
        answer = weir.openai(key).chat.completions.with_raw_response.create(model="seeded", messages=HI)
        assert route_header(answer)["candidate"] == "claude-sonnet"
        assert weir.admin.delete(f"/tenants/{tenant['id']}").status_code == 204
        assert [r.get("when") for r in served(weir)] == [None]
    with serving(vendor_env, url, tmp_path / "two", seeded) as weir:
        assert [r.get("when") for r in served(weir)] == [None]


@pytest.mark.postgres
def test_a_tenant_deleted_takes_its_keys_out_of_the_routes_conditions(weir: Weir) -> None:
    """`when.keys` names keys by id, and a tenant's keys go with it: left in a route's `when.keys`,
    such an id named no key, so every later write of that route was refused (`when.keys` takes only
    keys that exist) until an admin found and removed it. The delete takes them out (audited); a
    route that named only its keys is deleted, never left open to every key."""
    name = f"dk-{uuid.uuid4().hex[:6]}"
    tenant = weir.admin.post("/tenants", json={"name": name}).json()
    key = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "app"}).json()["id"]
    config_key = "key_" + hashlib.sha256(DEMO_KEY.encode()).hexdigest()[:12]
    shared = weir.admin.post("/routes", json={**GOOD, "name": name, "when": {"keys": [key, config_key]}})
    own = weir.admin.post("/routes", json={**GOOD, "name": f"{name}-own", "when": {"keys": [key]}})
    assert shared.status_code == own.status_code == 201, (shared.text, own.text)
    try:
        assert weir.admin.delete(f"/tenants/{tenant['id']}").status_code == 204
        read = weir.admin.get(f"/routes/{shared.json()['id']}").json()
        assert read["when"]["keys"] == [config_key]
        assert weir.admin.get(f"/routes/{own.json()['id']}").status_code == 404
        edited = weir.admin.put(f"/routes/{read['id']}", json={**read, "threshold": 0.6})
        assert edited.status_code == 200, edited.text
        audited = {
            (e["action"], e["entity_id"])
            for e in weir.admin.get("/audit", params={"entity": "route"}).json()["data"]
        }
        assert {("update", str(shared.json()["id"])), ("delete", str(own.json()["id"]))} <= audited
    finally:
        for created in (shared, own):
            weir.admin.delete(f"/routes/{created.json()['id']}")


def test_a_route_sent_back_unchanged_is_no_change_to_audit(weir: Weir) -> None:
    """A PUT of a route as it is (a form saved without an edit) stamped it anew and wrote an `update`
    entry whose before and after were the same: the audit log filled with changes that changed
    nothing, and replicas reloaded for none."""
    created = weir.admin.post("/routes", json={**GOOD, "name": f"same-{uuid.uuid4().hex[:6]}"})
    assert created.status_code == 201, created.text
    read = created.json()
    try:
        for body in (read, {k: v for k, v in read.items() if k != "position"}):
            again = weir.admin.put(
                f"/routes/{read['id']}", json=body, headers={"if-match": read["updated_at"]}
            )
            assert again.status_code == 200 and again.json() == read, again.text
        entries = weir.admin.get("/audit", params={"entity_id": str(read["id"])}).json()["data"]
        assert [e["action"] for e in entries if e["entity"] == "route"] == ["create"]
    finally:
        assert weir.admin.delete(f"/routes/{read['id']}").status_code == 204
