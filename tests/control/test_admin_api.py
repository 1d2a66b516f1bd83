"""The admin API, as an operator uses it: a Litestar app with the admin router on the real DB."""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import logging
import random
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import httpx
import pytest
from litestar import Litestar
from sqlalchemy import event as sa_event
from sqlalchemy import select, text
from sqlalchemy.util import await_only

from gateway.accounting.catalog import load_catalog
from gateway.accounting.events import UsageEvent
from gateway.accounting.money import format_usd, pico_to_usd
from gateway.accounting.pricing import TokenClass
from gateway.accounting.queue import SpoolQueue
from gateway.accounting.writer import BatchWriter
from gateway.admin.control_plane import ControlPlane, ControlPlaneSettings
from gateway.admin.keys import DbAuthenticator
from gateway.admin.router import AdminContext, admin_router
from gateway.admin.token import ensure_admin_token
from gateway.config import Tenant as ConfigTenant
from gateway.db import migrate
from gateway.db.models import ApiKey, Price, RouteRow, UptimeSample, UsageEventRow, UsageRollup
from gateway.db.models import Tenant as DbTenant
from gateway.db.session import create_engine, sessionmaker
from gateway.state import MemoryState
from gateway.usage import Usage
from tests.control.events import usage_event
from tests.control.helpers import priced_event, random_usage
from tests.fixtures.db import premigrated

TOKEN = "test-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class Env:
    def __init__(self, client: httpx.AsyncClient, ctx: AdminContext, engine: Any, tmp_path: Any) -> None:
        self.client, self.ctx, self.engine, self.tmp_path = client, ctx, engine, tmp_path


@pytest.fixture
async def env(db_url: str, tmp_path: Any) -> AsyncIterator[Env]:
    await migrate.upgrade_async(premigrated(db_url))
    engine = create_engine(db_url)
    sessions = sessionmaker(engine)
    digest, generated = await ensure_admin_token(sessions, env_token=TOKEN)
    assert generated is None
    ctx = AdminContext(sessions=sessions, state=MemoryState(), token_digest=digest)
    app = Litestar(route_handlers=[admin_router(ctx)])
    # In this event loop (not a portal thread), so the test and the app share the DB connections.
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://weir") as client:
        yield Env(client, ctx, engine, tmp_path)
    await engine.dispose()


def assert_openai_error(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


async def test_admin_token_is_required(env: Env) -> None:
    assert_openai_error(await env.client.get("/admin/api/v1/tenants"), 401)
    assert_openai_error(
        await env.client.get("/admin/api/v1/tenants", headers={"authorization": "Bearer nope"}), 401
    )
    assert (await env.client.get("/admin/api/v1/tenants", headers=AUTH)).status_code == 200


async def test_generated_admin_token_is_printed_once(sqlite_url: str) -> None:
    await migrate.upgrade_async(sqlite_url)
    engine = create_engine(sqlite_url)
    sessions = sessionmaker(engine)
    digest, token = await ensure_admin_token(sessions, env_token="")
    assert token and digest == hashlib.sha256(token.encode()).hexdigest()
    again, shown = await ensure_admin_token(sessions, env_token="")
    assert again == digest and shown is None  # the next start finds it and shows nothing
    await engine.dispose()


async def test_tenants_crud_with_audit(env: Env) -> None:
    c = env.client
    r = await c.post(
        "/admin/api/v1/tenants",
        json={"name": "acme", "budget_usd_monthly": "100.50", "rpm": 60},
        headers=AUTH,
    )
    assert r.status_code == 201, r.text
    tenant = r.json()
    assert tenant["budget_usd_monthly"] == "100.5" and tenant["rpm"] == 60 and tenant["tpm"] is None
    # Bad input: a clear 400 naming the field, and nothing changes.
    assert_openai_error(
        await c.post("/admin/api/v1/tenants", json={"name": "x", "rpm": -1}, headers=AUTH), 400, "rpm"
    )
    assert_openai_error(
        await c.post("/admin/api/v1/tenants", json={"name": "x", "tpm": 10**12}, headers=AUTH), 400, "tpm"
    )
    assert_openai_error(await c.post("/admin/api/v1/tenants", json={"nme": "x"}, headers=AUTH), 400)
    assert_openai_error(await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH), 409)
    assert [t["name"] for t in (await c.get("/admin/api/v1/tenants", headers=AUTH)).json()["data"]] == [
        "acme"
    ]

    r = await c.patch(f"/admin/api/v1/tenants/{tenant['id']}", json={"rpm": None, "tpm": 10000}, headers=AUTH)
    assert r.status_code == 200 and r.json()["rpm"] is None and r.json()["tpm"] == 10000
    assert (await c.get(f"/admin/api/v1/tenants/{tenant['id']}", headers=AUTH)).json()["tpm"] == 10000
    assert_openai_error(await c.get("/admin/api/v1/tenants/nope", headers=AUTH), 404)
    assert (await c.delete(f"/admin/api/v1/tenants/{tenant['id']}", headers=AUTH)).status_code == 204
    assert_openai_error(await c.get(f"/admin/api/v1/tenants/{tenant['id']}", headers=AUTH), 404)

    audit = (await c.get("/admin/api/v1/audit", params={"entity": "tenant"}, headers=AUTH)).json()["data"]
    assert [(a["action"], a["entity_id"]) for a in audit] == [
        ("delete", tenant["id"]),
        ("update", tenant["id"]),
        ("create", tenant["id"]),
    ]
    update = audit[1]
    assert update["actor"] == "admin"
    assert (
        update["before"]["rpm"] == 60 and update["after"]["rpm"] is None and update["after"]["tpm"] == 10000
    )
    assert audit[0]["after"] is None and audit[2]["before"] is None


async def test_the_audit_log_pages_back_to_its_first_entry_and_filters_by_entity_id(env: Env) -> None:
    """Only the newest 1,000 entries could be read, and one tenant's history only among them: an
    older change was out of reach of the API. `before` pages back (`next_before` says where the next
    page starts, null at the oldest) and `entity_id` picks one entity's entries."""
    c = env.client
    ids = [
        (await c.post("/admin/api/v1/tenants", json={"name": f"t{i}"}, headers=AUTH)).json()["id"]
        for i in range(3)
    ]
    await c.patch(f"/admin/api/v1/tenants/{ids[0]}", json={"rpm": 5}, headers=AUTH)

    async def page(**params: Any) -> dict[str, Any]:
        response = await c.get("/admin/api/v1/audit", params={"entity": "tenant", **params}, headers=AUTH)
        assert response.status_code == 200, response.text
        return dict(response.json())

    first = await page(limit=3)
    assert [e["entity_id"] for e in first["data"]] == [ids[0], ids[2], ids[1]]
    rest = await page(limit=3, before=first["next_before"])
    assert [(e["action"], e["entity_id"]) for e in rest["data"]] == [("create", ids[0])]
    assert rest["next_before"] is None
    history = await page(entity_id=ids[0])
    assert [e["action"] for e in history["data"]] == ["update", "create"]
    assert history["next_before"] is None
    assert len((await page(before=2**63))["data"]) == 4  # past the 32-bit ids: every entry
    assert (await page(before=-(2**63)))["data"] == []


async def test_budgets_above_the_bound_are_refused_and_change_nothing(env: Env) -> None:
    """Budgets are counted in pico-dollars in 64-bit counters (USD 9.22M at most): one of USD 10M was
    accepted, and then overflowed the counter. Above USD 1M a month is now a 400 naming the field,
    on a tenant or a key, created or changed, and nothing is written."""
    c = env.client
    too_much = {"name": "big", "budget_usd_monthly": "1000000.000001"}
    error = assert_openai_error(
        await c.post("/admin/api/v1/tenants", json=too_much, headers=AUTH), 400, "budget_usd_monthly"
    )
    assert error["code"] == "invalid_value" and "1000000" in error["message"]
    assert (await c.get("/admin/api/v1/tenants", headers=AUTH)).json()["data"] == []

    r = await c.post(
        "/admin/api/v1/tenants", json={"name": "acme", "budget_usd_monthly": 10**6}, headers=AUTH
    )
    assert r.status_code == 201 and r.json()["budget_usd_monthly"] == "1000000"  # the bound itself
    tenant = r.json()["id"]
    assert_openai_error(
        await c.patch(f"/admin/api/v1/tenants/{tenant}", json={"budget_usd_monthly": 10**7}, headers=AUTH),
        400,
        "budget_usd_monthly",
    )
    assert (await c.get(f"/admin/api/v1/tenants/{tenant}", headers=AUTH)).json()[
        "budget_usd_monthly"
    ] == "1000000"
    assert_openai_error(
        await c.post(
            f"/admin/api/v1/tenants/{tenant}/keys", json={"budget_usd_monthly": "9223372"}, headers=AUTH
        ),
        400,
        "budget_usd_monthly",
    )
    # Beyond what a Decimal holds (decimal.Overflow was a 500), on a tenant and a key.
    for method, url, body in [
        ("POST", "/admin/api/v1/tenants", {"name": "huge", "budget_usd_monthly": "1E+1000000"}),
        ("PATCH", f"/admin/api/v1/tenants/{tenant}", {"budget_usd_monthly": "1E+1000000"}),
        ("POST", f"/admin/api/v1/tenants/{tenant}/keys", {"budget_usd_monthly": "1E+1000000"}),
    ]:
        error = assert_openai_error(
            await c.request(method, url, json=body, headers=AUTH), 400, "budget_usd_monthly"
        )
        assert error["message"].startswith("A monthly budget is at most 1000000 USD"), error
    assert (await c.get(f"/admin/api/v1/tenants/{tenant}/keys", headers=AUTH)).json()["data"] == []
    audit = (await c.get("/admin/api/v1/audit", headers=AUTH)).json()["data"]
    assert [(a["action"], a["entity"]) for a in audit] == [("create", "tenant")]


async def test_config_tenants_are_listed_read_only_and_keep_their_names(env: Env) -> None:
    """The config file's tenants were missing from GET /tenants (so from the Tenants page), and an
    admin-DB tenant could take one's name: to routes' `when.tenants`, previews and the pages they
    were one tenant with two sets of keys and limits. Config tenants are listed with `source:
    "config"` (id = name, as the ledger has them); their names are a 409 for admin-DB tenants."""
    env.ctx.config_tenants = [
        ConfigTenant(name="team-a", api_keys=["k1", "k2"], models=["gpt-4o-mini"], max_messages=50)
    ]
    c = env.client
    created = await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)
    assert created.status_code == 201 and created.json()["source"] == "db"
    listed = (await c.get("/admin/api/v1/tenants", headers=AUTH)).json()["data"]
    assert [(t["id"] == created.json()["id"], t["name"], t["source"]) for t in listed] == [
        (True, "acme", "db"),
        (False, "team-a", "config"),
    ]
    config = listed[1]
    assert config["id"] == "team-a" and config["keys"] == 2 and config["models"] == ["gpt-4o-mini"]
    assert config["max_messages"] == 50 and config["budget_usd_monthly"] is None and config["rpm"] is None

    error = assert_openai_error(
        await c.post("/admin/api/v1/tenants", json={"name": "team-a", "rpm": 5}, headers=AUTH), 409, "name"
    )
    assert error["code"] == "conflict" and "config file" in error["message"]
    renamed = await c.patch(
        f"/admin/api/v1/tenants/{created.json()['id']}", json={"name": "team-a"}, headers=AUTH
    )
    assert assert_openai_error(renamed, 409, "name")["code"] == "conflict"
    names = [t["name"] for t in (await c.get("/admin/api/v1/tenants", headers=AUTH)).json()["data"]]
    assert names == ["acme", "team-a"]  # nothing written
    audit = (await c.get("/admin/api/v1/audit", headers=AUTH)).json()["data"]
    assert [(a["action"], a["entity"]) for a in audit] == [("create", "tenant")]


async def test_a_config_tenant_is_read_by_its_id_as_listed(env: Env) -> None:
    """GET /tenants/{id} with a config tenant's id (its name, as GET /tenants lists it) was a 404:
    the same read-only record now; an admin-DB tenant is still read by its own id."""
    env.ctx.config_tenants = [ConfigTenant(name="team-a", api_keys=["k1"], max_output_tokens=512)]
    c = env.client
    created = (await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    listed = {t["id"]: t for t in (await c.get("/admin/api/v1/tenants", headers=AUTH)).json()["data"]}
    for tenant_id in ("team-a", created["id"]):
        read = await c.get(f"/admin/api/v1/tenants/{tenant_id}", headers=AUTH)
        assert read.status_code == 200, read.text
        assert read.json() == listed[tenant_id]
    assert listed["team-a"]["source"] == "config" and listed["team-a"]["max_output_tokens"] == 512
    assert_openai_error(await c.get("/admin/api/v1/tenants/team-b", headers=AUTH), 404, "tenant_id")


async def test_changing_a_config_tenant_is_a_409_that_says_where_it_is_changed(env: Env) -> None:
    """PATCH or DELETE of a config tenant's id (as GET /tenants lists it), or of its keys, was a
    generic 404, as if it did not exist: a 409 now that names the config file, and nothing changes."""
    env.ctx.config_tenants = [ConfigTenant(name="team-a", api_keys=["k1"], max_messages=50)]
    c = env.client
    before = (await c.get("/admin/api/v1/tenants/team-a", headers=AUTH)).json()
    url = "/admin/api/v1/tenants/team-a"
    for response in [
        await c.patch(url, json={"rpm": 5}, headers=AUTH),
        await c.delete(url, headers=AUTH),
        await c.post(f"{url}/keys", json={"name": "app"}, headers=AUTH),
        await c.get(f"{url}/keys", headers=AUTH),
    ]:
        error = assert_openai_error(response, 409, "tenant_id")
        assert error["code"] == "conflict", error
        assert "'team-a' is defined in the config file" in error["message"], error
    assert (await c.get(url, headers=AUTH)).json() == before
    assert (await c.get("/admin/api/v1/audit", headers=AUTH)).json()["data"] == []
    async with env.ctx.sessions() as session:
        assert (await session.scalars(select(ApiKey))).all() == []
        assert (await session.scalars(select(DbTenant))).all() == []
    # An id that is neither is still a 404.
    assert_openai_error(await c.delete("/admin/api/v1/tenants/team-b", headers=AUTH), 404, "tenant_id")


async def test_a_db_tenant_named_as_a_config_tenant_is_warned_of_at_start(
    sqlite_url: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The API refuses a config tenant's name to admin-DB tenants, but a config tenant added to the
    file under a DB tenant's name was met silently: the start now warns, naming both, and starts."""
    await migrate.upgrade_async(premigrated(sqlite_url))
    engine = create_engine(sqlite_url)
    async with sessionmaker(engine)() as session, session.begin():
        session.add_all([DbTenant(id="t-acme", name="acme"), DbTenant(id="t-other", name="other")])
    await engine.dispose()
    control = ControlPlane(
        ControlPlaneSettings(
            database_url=sqlite_url,
            spool_dir=str(tmp_path / "spool"),
            admin_token=TOKEN,
            tenants=[ConfigTenant(name="acme", api_keys=["k1"]), ConfigTenant(name="team-a")],
        )
    )
    caplog.set_level(logging.WARNING, logger="gateway.admin.control_plane")
    try:
        await control.start()
    finally:
        await control.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "'acme' is both a config file tenant" in warnings[0] and "(id 't-acme')" in warnings[0]


@pytest.mark.parametrize(
    "budget",
    ["abc", "$500", "1,000", True, [5], "-5", "NaN", "0.0000001", "0.1000000000000000000000000000001"],
)
async def test_a_bad_budget_is_refused_in_words(env: Env, budget: Any) -> None:
    """A budget the Tenants page's form could not take came back as msgspec's "Invalid decimal string
    - at `$.budget_usd_monthly`" (or "Expected `decimal | null`, got `bool`"), or the price helpers'
    "price must be a non-negative number, got Decimal('-5')": the page shows the API's message as it
    is. Refused in words, on a tenant or a key, created or changed, naming the field."""
    c = env.client
    tenant = (await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    calls = [
        ("POST", "/admin/api/v1/tenants", {"name": "big", "budget_usd_monthly": budget}),
        ("PATCH", f"/admin/api/v1/tenants/{tenant['id']}", {"budget_usd_monthly": budget}),
        ("POST", f"/admin/api/v1/tenants/{tenant['id']}/keys", {"budget_usd_monthly": budget}),
    ]
    for method, url, body in calls:
        refused = await c.request(method, url, json=body, headers=AUTH)
        error = assert_openai_error(refused, 400, "budget_usd_monthly")
        assert error["code"] == "invalid_value"
        assert error["message"].startswith(("Enter a monthly budget in USD", "A monthly budget has")), error
        for raw in ("Expected `", "Invalid decimal", "$.", "price", "Decimal("):
            assert raw not in error["message"], error
    assert (await c.get(f"/admin/api/v1/tenants/{tenant['id']}", headers=AUTH)).json()[
        "budget_usd_monthly"
    ] is None
    assert (await c.get(f"/admin/api/v1/tenants/{tenant['id']}/keys", headers=AUTH)).json()["data"] == []


async def test_keys_shown_once_hashed_and_revoked_at_once(env: Env) -> None:
    c = env.client
    tenant = (await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    r = await c.post(
        f"/admin/api/v1/tenants/{tenant['id']}/keys",
        json={"name": "ci", "models": ["gpt-4o-mini"]},
        headers=AUTH,
    )
    assert r.status_code == 201, r.text
    created = r.json()
    key = created["key"]
    assert key.startswith(created["prefix"]) and len(key) > 40
    listed = (await c.get(f"/admin/api/v1/tenants/{tenant['id']}/keys", headers=AUTH)).json()["data"]
    assert len(listed) == 1 and "key" not in listed[0] and listed[0]["prefix"] == created["prefix"]
    async with env.ctx.sessions() as session:
        row = (await session.scalars(select(ApiKey))).one()
        dump = " ".join(str(v) for v in (await session.execute(text("SELECT * FROM api_keys"))).one())
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert key not in dump  # only the hash is stored

    auth = DbAuthenticator(env.ctx.sessions, env.ctx.state, ttl_s=3600)
    await auth.start()
    principal = await auth.authenticate(key)
    assert principal is not None and principal.tenant_id == tenant["id"] and principal.key_id == created["id"]
    assert principal.may_use("gpt-4o-mini") and not principal.may_use("gpt-4o")
    assert await auth.authenticate(key + "x") is None
    assert (await c.delete(f"/admin/api/v1/keys/{created['id']}", headers=AUTH)).status_code == 204
    # The cache held the key for an hour; the revocation broadcast emptied it.
    assert await auth.authenticate(key) is None
    assert_openai_error(await c.delete("/admin/api/v1/keys/nope", headers=AUTH), 404)
    # A key past its expires_at is refused; one without a time zone is bad input.
    soon = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).isoformat()
    expired = (
        await c.post(f"/admin/api/v1/tenants/{tenant['id']}/keys", json={"expires_at": soon}, headers=AUTH)
    ).json()
    async with env.ctx.sessions() as session, session.begin():
        row = await session.get(ApiKey, expired["id"])
        assert row is not None
        row.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)  # the day has come
    assert await auth.authenticate(expired["key"]) is None
    naive = {"expires_at": "2030-01-01T00:00:00"}
    assert_openai_error(
        await c.post(f"/admin/api/v1/tenants/{tenant['id']}/keys", json=naive, headers=AUTH),
        400,
        "expires_at",
    )
    actions = [
        a["action"]
        for a in (await c.get("/admin/api/v1/audit", params={"entity": "key"}, headers=AUTH)).json()["data"]
    ]
    assert actions == ["create", "revoke", "create"]


# Moments whose conversion to UTC falls outside the years a datetime holds (1 to 9999).
OFF_THE_CALENDAR = ["9999-12-31T23:59:59-10:00", "0001-01-01T00:00:00+10:00"]


async def test_a_key_that_could_never_be_used_is_not_issued(env: Env) -> None:
    """A key is shown once, when issued: one with `models: []` (no model allowed) or an `expires_at`
    already past was issued all the same, and every request of it refused from the first. Both are a
    400 naming the field, and no key is issued."""
    c = env.client
    tenant = (await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    keys = f"/admin/api/v1/tenants/{tenant['id']}/keys"
    assert_openai_error(await c.post(keys, json={"models": []}, headers=AUTH), 400, "models")
    for past in ("2020-01-01T00:00:00Z", (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)).isoformat()):
        error = assert_openai_error(
            await c.post(keys, json={"expires_at": past}, headers=AUTH), 400, "expires_at"
        )
        assert "not in the future" in error["message"]
    assert (await c.get(keys, headers=AUTH)).json()["data"] == []
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5)).isoformat()
    assert (await c.post(keys, json={"models": None, "expires_at": later}, headers=AUTH)).status_code == 201


async def test_a_key_limited_to_a_model_nothing_serves_is_refused(env: Env) -> None:
    """A key's `models` were stored unchecked: a typo ("gtp-4o") made a key whose every request was a
    404. A name that no route or model of the gateway serves, nor a route stored in the admin DB (one
    a replica has not loaded yet, or leaves out), is a 400 naming it, and no key is issued."""
    env.ctx.serves_model = {"gpt-4o-mini", "auto"}.__contains__
    async with env.ctx.sessions() as session, session.begin():
        session.add(
            RouteRow(name="stored", spec={"name": "stored", "candidates": [{"model": "gpt-4o-mini"}]})
        )
    c = env.client
    tenant = (await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    keys = f"/admin/api/v1/tenants/{tenant['id']}/keys"
    typo = {"models": ["gpt-4o-mini", "gtp-4o", "auto", "stored", "nope", "gtp-4o"]}
    error = assert_openai_error(await c.post(keys, json=typo, headers=AUTH), 400, "models")
    assert error["code"] == "invalid_value"
    assert "'gtp-4o', 'nope'" in error["message"] and "gpt-4o-mini" not in error["message"]
    assert (await c.get(keys, headers=AUTH)).json()["data"] == []  # nothing issued
    served = await c.post(keys, json={"models": ["gpt-4o-mini", "auto", "stored"]}, headers=AUTH)
    assert served.status_code == 201, served.text
    assert served.json()["models"] == ["gpt-4o-mini", "auto", "stored"]


@pytest.mark.parametrize("moment", OFF_THE_CALENDAR)
async def test_a_moment_off_the_calendar_in_utc_is_a_400_not_a_500(env: Env, moment: str) -> None:
    """A key's `expires_at`, a price's `effective_from` or a report's `at` that has no UTC equivalent
    raised OverflowError as it was converted for the DB (or the query), and the API answered 500;
    now it is a 400 naming the field, and nothing is written."""
    c = env.client
    tenant = (await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    keys = f"/admin/api/v1/tenants/{tenant['id']}/keys"
    error = assert_openai_error(
        await c.post(keys, json={"expires_at": moment}, headers=AUTH), 400, "expires_at"
    )
    assert error["code"] == "invalid_value" and "UTC" in error["message"]
    assert (await c.get(keys, headers=AUTH)).json()["data"] == []
    price = {"model": "m", "token_class": "input", "usd_per_1m_tokens": "1", "effective_from": moment}
    r = await c.put("/admin/api/v1/prices", json={"prices": [price]}, headers=AUTH)
    assert_openai_error(r, 400, "prices[0].effective_from")
    assert await _history(env) == []
    assert_openai_error(await c.get("/admin/api/v1/prices", params={"at": moment}, headers=AUTH), 400, "at")


async def test_text_with_a_nul_character_is_a_400_not_a_500(env: Env) -> None:
    """PostgreSQL cannot store U+0000 in text and refuses even to compare with it: a tenant or key
    named with one, or a tenant id with one in the path, was a 500 there. It is a 400 naming the
    problem: a name with one on every database (a control character), an id in a path on PostgreSQL
    (SQLite finds no such tenant or key: a 404)."""
    c = env.client
    postgres = env.engine.dialect.name == "postgresql"
    tenant = (await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    calls = [
        ("POST", "/admin/api/v1/tenants", {"name": "a\x00b"}),
        ("PATCH", f"/admin/api/v1/tenants/{tenant['id']}", {"name": "a\x00b"}),
        ("POST", f"/admin/api/v1/tenants/{tenant['id']}/keys", {"name": "a\x00b"}),
        ("GET", "/admin/api/v1/tenants/a%00b", None),
        ("GET", "/admin/api/v1/tenants/a%00b/keys", None),
        ("DELETE", "/admin/api/v1/keys/a%00b", None),
    ]
    for method, url, body in calls:
        r = await c.request(method, url, json=body, headers=AUTH)
        assert r.status_code < 500, (method, url, r.text)
        if body is not None:
            error = assert_openai_error(r, 400, "name")
            assert error["code"] == "invalid_value" and "control characters" in error["message"]
        elif postgres:
            error = assert_openai_error(r, 400)
            assert error["code"] == "invalid_value" and "NUL" in error["message"]
    if postgres:
        listed = (await c.get("/admin/api/v1/tenants", headers=AUTH)).json()["data"]
        assert [t["name"] for t in listed] == ["acme"]


async def test_prices_are_appended_never_rewritten(env: Env) -> None:
    c = env.client
    r = await c.put(
        "/admin/api/v1/prices",
        json={
            "prices": [
                {"model": "gpt-4o", "token_class": "input", "usd_per_1m_tokens": "2.50"},
                {"model": "gpt-4o", "token_class": "cached_input", "usd_per_1m_tokens": 1.25},
                {"model": "gpt-4o", "token_class": "output", "usd_per_1m_tokens": "10"},
            ]
        },
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(days=30)).isoformat()
    r = await c.put(
        "/admin/api/v1/prices",
        json={
            "prices": [
                {"model": "gpt-4o", "token_class": "input", "usd_per_1m_tokens": "2", "effective_from": later}
            ]
        },
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    now = {
        (p["token_class"], p["usd_per_1m_tokens"])
        for p in (await c.get("/admin/api/v1/prices", headers=AUTH)).json()["data"]
    }
    assert now == {("input", "2.5"), ("cached_input", "1.25"), ("output", "10")}
    future = (await c.get("/admin/api/v1/prices", params={"at": later}, headers=AUTH)).json()["data"]
    assert ("input", "2") in {(p["token_class"], p["usd_per_1m_tokens"]) for p in future}
    assert (
        len((await c.get("/admin/api/v1/prices", params={"history": "true"}, headers=AUTH)).json()["data"])
        == 4
    )
    # Back-dating would re-price the past: refused, as are inexact prices and unknown token classes.
    past = {
        "model": "gpt-4o",
        "token_class": "input",
        "usd_per_1m_tokens": "1",
        "effective_from": "2020-01-01T00:00:00Z",
    }
    assert_openai_error(
        await c.put("/admin/api/v1/prices", json={"prices": [past]}, headers=AUTH),
        400,
        "prices[0].effective_from",
    )
    bad = {"model": "gpt-4o", "token_class": "input", "usd_per_1m_tokens": "0.0000001"}
    assert_openai_error(
        await c.put("/admin/api/v1/prices", json={"prices": [bad]}, headers=AUTH),
        400,
        "prices[0].usd_per_1m_tokens",
    )
    # A price as a price sheet prints it: refused in words, not msgspec's "Invalid decimal string".
    bad = {"model": "gpt-4o", "token_class": "input", "usd_per_1m_tokens": "$2.50"}
    error = assert_openai_error(
        await c.put("/admin/api/v1/prices", json={"prices": [bad]}, headers=AUTH),
        400,
        "prices[0].usd_per_1m_tokens",
    )
    assert error["message"].startswith(
        "Enter a price in USD per 1M tokens as a plain number with up to 6 decimals"
    )
    bad = {"model": "gpt-4o", "token_class": "thinking", "usd_per_1m_tokens": "1"}
    assert_openai_error(await c.put("/admin/api/v1/prices", json={"prices": [bad]}, headers=AUTH), 400)
    assert (
        len((await c.get("/admin/api/v1/prices", params={"history": "true"}, headers=AUTH)).json()["data"])
        == 4
    )
    audit = (await c.get("/admin/api/v1/audit", params={"entity": "price"}, headers=AUTH)).json()["data"]
    assert len(audit) == 4 and all(a["action"] == "create" and a["after"]["model"] == "gpt-4o" for a in audit)


async def _history(env: Env) -> list[dict[str, Any]]:
    r = await env.client.get("/admin/api/v1/prices", params={"history": "true"}, headers=AUTH)
    return list(r.json()["data"])


async def test_a_search_price_is_written_and_read_per_1000_searches(env: Env) -> None:
    """Vendors quote web searches per 1,000 ($10): the API takes and shows that number in
    `usd_per_1k_requests`, and the catalog bills one search $0.01. (It took USD per 1M searches in
    `usd_per_1m_tokens`, where the 10 an admin copied from the price sheet billed $0.00001.)"""
    search = {"backend": "anthropic", "model": "claude-sonnet-4-5", "token_class": "web_search"}
    r = await env.client.put(
        "/admin/api/v1/prices",
        json={
            "prices": [
                search | {"usd_per_1k_requests": "10"},
                search | {"model": "claude-haiku-4-5", "usd_per_1k_requests": 0.000000001},
                {"model": "claude-haiku-4-5", "token_class": "input", "usd_per_1m_tokens": "0.80"},
            ]
        },
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    written = [(p["model"], p["usd_per_1k_requests"], p["usd_per_1m_tokens"]) for p in r.json()["data"]]
    assert written == [
        ("claude-sonnet-4-5", "10", None),
        ("claude-haiku-4-5", "0.000000001", None),
        ("claude-haiku-4-5", None, "0.8"),
    ]
    listed = (await env.client.get("/admin/api/v1/prices", headers=AUTH)).json()["data"]
    assert {(p["model"], p["usd_per_1k_requests"], p["usd_per_1m_tokens"]) for p in listed} == set(written)

    async with env.ctx.sessions() as session:
        catalog = await load_catalog(session)
    now = dt.datetime.now(dt.UTC)
    one_search = catalog.price(Usage(web_search_requests=1), "anthropic", "claude-sonnet-4-5", now)
    assert pico_to_usd(one_search.cost_pico_usd) == Decimal("0.01")
    cheapest = catalog.price(Usage(web_search_requests=1000), "anthropic", "claude-haiku-4-5", now)
    assert pico_to_usd(cheapest.cost_pico_usd) == Decimal("0.000000001")


@pytest.mark.parametrize(
    ("price", "param", "says"),
    [
        # The old unit for a search price: refused, naming the field to send instead.
        (
            {"token_class": "web_search", "usd_per_1m_tokens": "10000"},
            "usd_per_1m_tokens",
            "usd_per_1k_requests",
        ),
        ({"token_class": "web_search"}, "usd_per_1k_requests", "required"),
        (
            {"token_class": "web_search", "usd_per_1k_requests": "0.0000000001"},
            "usd_per_1k_requests",
            "9 decimals",
        ),
        (
            {"token_class": "web_search", "usd_per_1k_requests": "1000.001"},
            "usd_per_1k_requests",
            "too large",
        ),
        ({"token_class": "web_search", "usd_per_1k_requests": "-1"}, "usd_per_1k_requests", "non-negative"),
        # Beyond what a Decimal holds: decimal.Overflow was a 500.
        ({"token_class": "input", "usd_per_1m_tokens": "1E+1000000"}, "usd_per_1m_tokens", "too large"),
        (
            {"token_class": "web_search", "usd_per_1k_requests": "1E+1000000"},
            "usd_per_1k_requests",
            "too large",
        ),
        ({"token_class": "input", "usd_per_1k_requests": "10"}, "usd_per_1k_requests", "usd_per_1m_tokens"),
        ({"token_class": "output"}, "usd_per_1m_tokens", "required"),
    ],
)
async def test_a_price_in_the_wrong_unit_for_its_class_is_refused(
    env: Env, price: dict[str, Any], param: str, says: str
) -> None:
    before = await _history(env)
    good = {"model": "claude-sonnet-4-5", "token_class": "input", "usd_per_1m_tokens": "3"}
    r = await env.client.put(
        "/admin/api/v1/prices", json={"prices": [good, {"model": "claude-sonnet-4-5"} | price]}, headers=AUTH
    )
    error = assert_openai_error(r, 400, f"prices[1].{param}")
    assert says in error["message"]
    assert await _history(env) == before  # the whole batch, the good row too


async def test_the_catalog_skips_rows_of_a_token_class_it_does_not_know(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A newer release's price class (a row this code cannot bill) is skipped, with one warning however
    often the catalog reloads; the rest loads. It failed the whole load: during a rolling upgrade an
    old replica kept a stale catalog, or failed to start, once a new replica's class was priced."""
    future = f"future_{uuid.uuid4().hex[:8]}"  # never seen by this process, whatever ran before
    now = dt.datetime.now(dt.UTC)
    async with env.ctx.sessions() as session, session.begin():
        for model, token_class, micro in (("gpt-4o", "input", 2_500_000), ("gpt-4o", future, 10**10)):
            session.add(
                Price(
                    backend="*",
                    model=model,
                    token_class=token_class,
                    micro_usd_per_mtok=micro,
                    effective_from=now,
                )
            )
    caplog.set_level(logging.WARNING, logger="gateway.accounting.catalog")
    for _ in range(3):  # the first load and two periodic reloads
        async with env.ctx.sessions() as session:
            catalog = await load_catalog(session)
        assert catalog.prices_at("openai", "gpt-4o", now) == {TokenClass.INPUT: 2_500_000}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and future in warnings[0], warnings
    # The admin API still lists the row as it is.
    listed = (await env.client.get("/admin/api/v1/prices", headers=AUTH)).json()["data"]
    assert {p["token_class"] for p in listed} == {"input", future}


# Prices used by the reconciliation below, as an operator would type them (USD per 1M tokens).
SHEETS = {
    ("openai", "gpt-4o"): {"input": "2.50", "cached_input": "1.25", "output": "10"},
    ("anthropic", "claude-sonnet"): {
        "input": "3",
        "cached_input": "0.30",
        "cache_write_5m": "3.75",
        "cache_write_1h": "6",
        "output": "15",
    },
}
FIELDS = {
    "input": "input_tokens",
    "cached_input": "cached_input_tokens",
    "cache_write_5m": "cache_write_5m_tokens",
    "cache_write_1h": "cache_write_1h_tokens",
    "output": "output_tokens",
}


def independent_cost(backend: str, model: str, usage: Any) -> tuple[Decimal, Decimal]:
    """Cost and cache savings straight from the price sheet, in Decimal USD (no project code)."""
    sheet = {k: Decimal(v) for k, v in SHEETS[(backend, model)].items()}
    sheet.setdefault("cached_input", sheet["input"])
    sheet.setdefault("cache_write_5m", sheet["input"])
    sheet.setdefault("cache_write_1h", sheet["cache_write_5m"])
    cost = sum((getattr(usage, FIELDS[c]) * sheet[c] for c in FIELDS), Decimal(0)) / 1_000_000
    savings = usage.cached_input_tokens * (sheet["input"] - sheet["cached_input"]) / 1_000_000
    return cost, savings


async def test_usage_report_reconciles_to_the_micro_dollar(env: Env) -> None:
    c = env.client
    tenants = [
        (await c.post("/admin/api/v1/tenants", json={"name": n}, headers=AUTH)).json()
        for n in ("acme", "globex")
    ]
    await c.put(
        "/admin/api/v1/prices",
        json={
            "prices": [
                {"backend": b, "model": m, "token_class": tc, "usd_per_1m_tokens": p}
                for (b, m), sheet in SHEETS.items()
                for tc, p in sheet.items()
            ]
        },
        headers=AUTH,
    )
    async with env.ctx.sessions() as session:
        catalog = await load_catalog(session)
    rng = random.Random(42)
    today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    queue = SpoolQueue(env.tmp_path / "spool")
    expected: dict[tuple[str, str, str], list[Decimal]] = defaultdict(
        lambda: [Decimal(0), Decimal(0), Decimal(0)]
    )
    for _ in range(300):
        tenant = rng.choice(tenants)
        backend, model = rng.choice(list(SHEETS))
        usage = random_usage(rng)
        # Today only, after the prices became valid (just now), spread over the hour to come: late in
        # the UTC day the end of the day caps it (a fixed 23:00 cap priced events before the prices
        # existed when the test ran after 23:00).
        ts = min(
            dt.datetime.now(dt.UTC) + dt.timedelta(seconds=rng.randint(0, 3600)),
            today + dt.timedelta(days=1, seconds=-2),  # inside the raw-ledger range below too
        )
        queue.put(
            priced_event(catalog, tenant_id=tenant["id"], backend=backend, model=model, usage=usage, ts=ts)
        )
        cost, savings = independent_cost(backend, model, usage)
        row = expected[(tenant["id"], model, ts.date().isoformat())]
        row[0] += cost
        row[1] += savings
        row[2] += 1
    writer = BatchWriter(queue, env.engine)
    await writer.drain()
    await queue.close()

    params = {
        "start": today.date().isoformat(),
        "end": (today + dt.timedelta(days=1)).date().isoformat(),
        "group_by": "tenant,model,day",
    }
    report = (await c.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)).json()
    assert report["source"] == "rollups"
    got = {(r["tenant"], r["model"], r["day"]): r for r in report["rows"]}
    assert set(got) == set(expected)
    for group, (cost, savings, requests) in expected.items():
        assert Decimal(got[group]["cost_usd"]) == cost, group
        assert Decimal(got[group]["cache_savings_usd"]) == savings, group
        assert got[group]["requests"] == requests
    assert Decimal(report["totals"]["cost_usd"]) == sum(v[0] for v in expected.values())
    assert {r["tenant_name"] for r in report["rows"]} == {"acme", "globex"}

    # The same numbers from the raw ledger (a range that is not whole days) and as CSV.
    raw = (
        await c.get(
            "/admin/api/v1/reports/usage",
            params={**params, "end": (today + dt.timedelta(days=1, seconds=-1)).isoformat()},
            headers=AUTH,
        )
    ).json()
    assert raw["source"] == "events" and raw["totals"] == report["totals"]
    r = await c.get("/admin/api/v1/reports/usage", params={**params, "format": "csv"}, headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert "attachment" in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == len(expected)
    assert sum(Decimal(row["cost_usd"]) for row in rows) == sum(v[0] for v in expected.values())
    first = rows[0]
    tokens = sum(
        int(first[f]) for f in ("input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens")
    )
    assert int(first["total_tokens"]) == tokens
    assert Decimal(first["cost_per_1m_tokens"]) == (Decimal(first["cost_usd"]) * 1_000_000 / tokens).quantize(
        Decimal("0.000001")
    )
    prompt = tokens - int(first["output_tokens"])
    assert float(first["cache_hit_ratio"]) == pytest.approx(
        int(first["cached_input_tokens"]) / prompt, abs=1e-6
    )

    by_backend = (
        await c.get("/admin/api/v1/reports/usage", params={**params, "group_by": "backend"}, headers=AUTH)
    ).json()
    assert {r["backend"] for r in by_backend["rows"]} == {"openai", "anthropic"}
    assert by_backend["totals"] == report["totals"]
    assert_openai_error(
        await c.get("/admin/api/v1/reports/usage", params={"group_by": "colour"}, headers=AUTH),
        400,
        "group_by",
    )
    assert_openai_error(
        await c.get("/admin/api/v1/reports/usage", params={"start": "yesterday"}, headers=AUTH), 400, "start"
    )


async def test_usage_report_sums_costs_past_64_bits_exactly(env: Env) -> None:
    """Three days near $4.6M each (2^62 pico-dollars): the range's total passes 2^63, where SQLite's
    sum() of integers failed the report ("integer overflow", a 500) while PostgreSQL's sums as a
    numeric. Both report the exact total, from the rollups and from the raw ledger, negative savings
    (cache reads dearer than input) included."""
    first_day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0) - dt.timedelta(
        days=3
    )
    costs = [(2**62 + 1, -(2**62) + 5), (2**62 + 2, -3), (2**62 - 1, -(2**62) - 1)]
    async with env.ctx.sessions() as session, session.begin():
        for i, (cost, savings) in enumerate(costs):
            ts = first_day + dt.timedelta(days=i, hours=12)
            tokens = dict.fromkeys(
                ("input_tokens", "cached_input_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens"), 0
            )
            tokens |= {"output_tokens": 10**9, "reasoning_tokens": 0}
            money = {"cost_pico_usd": cost, "savings_pico_usd": savings}
            session.add(
                UsageRollup(
                    day=ts.date(),
                    tenant_id="t1",
                    key_id="k1",
                    backend="b",
                    model="m",
                    requests=1,
                    client_requests=1,
                    errors=0,
                    **tokens,
                    **money,
                )
            )
            session.add(
                UsageEventRow(
                    event_id=f"e{i}",
                    request_id=f"r{i}",
                    attempt=1,
                    ts=ts,
                    day=ts.date(),
                    tenant_id="t1",
                    key_id="k1",
                    route="m",
                    backend="b",
                    model="m",
                    **tokens,
                    prices={},
                    **money,
                    latency_ms=1.0,
                    ttft_ms=None,
                    status=200,
                    fallback=False,
                )
            )
    cost_usd = format_usd(pico_to_usd(sum(c for c, _ in costs)))
    savings_usd = format_usd(pico_to_usd(sum(s for _, s in costs)))
    assert Decimal(cost_usd) > Decimal(2**63) / 10**12
    end = first_day + dt.timedelta(days=3)
    for source, params in (
        ("rollups", {"start": first_day.date().isoformat(), "end": end.date().isoformat()}),
        ("events", {"start": first_day.isoformat(), "end": (end - dt.timedelta(seconds=1)).isoformat()}),
    ):
        response = await env.client.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)
        assert response.status_code == 200, response.text
        report = response.json()
        assert report["source"] == source
        [row] = report["rows"]
        assert (row["cost_usd"], row["cache_savings_usd"], row["requests"]) == (cost_usd, savings_usd, 3)
        assert report["totals"]["cost_usd"] == cost_usd


async def test_a_budgets_month_spend_is_read_from_the_ledger_past_64_bits_exactly(
    db_url: str, tmp_path: Any
) -> None:
    """Three rollups this month near $4.6M each (2^62 pico-dollars) and one of last month's: what a
    tenant's and a key's budget start from is this month's exact total, past 2^63, where SQLite's
    sum() of integers failed ("integer overflow") and the request that first met the budget with it.
    Asked about usage events (those a budget counted before its seed), it says which of them that
    total holds: the owner's, this month's, in the ledger."""
    control = ControlPlane(ControlPlaneSettings(database_url=db_url, spool_dir=str(tmp_path / "spool")))
    try:
        await migrate.upgrade_async(db_url)
        today = dt.datetime.now(dt.UTC).date()
        month_start = today.replace(day=1)
        costs = [2**62 + 1, 2**62 + 2, 2**62 - 1]
        tokens = dict.fromkeys(
            ("input_tokens", "cached_input_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens"), 0
        )
        tokens |= {"output_tokens": 10**9, "reasoning_tokens": 0}
        async with control.sessions() as session, session.begin():
            for i, (day, cost) in enumerate(
                [*((today, c) for c in costs), (month_start - dt.timedelta(days=1), 2**62)]
            ):
                session.add(
                    UsageRollup(
                        day=day,
                        tenant_id="t1",
                        key_id="k1",
                        backend="b",
                        model=f"m{i}",
                        requests=1,
                        errors=0,
                        **tokens,
                        cost_pico_usd=cost,
                        savings_pico_usd=0,
                    )
                )
            for event_id, day, owner in (
                ("e-now", today, "1"),
                ("e-before", month_start - dt.timedelta(days=1), "1"),
                ("e-other", today, "2"),
            ):
                session.add(
                    UsageEventRow(
                        event_id=event_id,
                        request_id=event_id,
                        attempt=1,
                        ts=dt.datetime.combine(day, dt.time(12), dt.UTC),
                        day=day,
                        tenant_id=f"t{owner}",
                        key_id=f"k{owner}",
                        route="m",
                        backend="b",
                        model="m",
                        **tokens,
                        prices={},
                        cost_pico_usd=1,
                        savings_pico_usd=0,
                        latency_ms=1.0,
                        ttft_ms=None,
                        status=200,
                        fallback=False,
                    )
                )
        assert sum(costs) > 2**63
        asked = ["e-now", "e-before", "e-other", "e-missing"]
        for scope, owner in (("tenant", "t1"), ("key", "k1")):
            assert await control._spend_this_month(scope, owner, month_start) == (sum(costs), [])
            assert await control._spend_this_month(scope, owner, month_start, asked) == (
                sum(costs),
                ["e-now"],
            )
            # And the owner's events of the month from an id on (ids begin with their creation
            # time: the recent ones, whose settlements may still be on their way), once each.
            for held in ([], asked):
                assert await control._spend_this_month(scope, owner, month_start, held, "e-a") == (
                    sum(costs),
                    ["e-now"],
                )
        assert await control._spend_this_month("tenant", "nobody", month_start, asked) == (0, [])
    finally:
        await control.stop()


async def _uptime_after(
    env: Env, attempts: dict[str, list[tuple[str, int]]], now: dt.datetime, seed: int
) -> dict[str, Any]:
    """The uptime report once each request's attempts, (backend, status) in order, are in the ledger
    (tenant t1, model m, random priced usage)."""
    async with env.ctx.sessions() as session:
        catalog = await load_catalog(session)
    queue = SpoolQueue(env.tmp_path / "spool")
    rng = random.Random(seed)
    for request_id, tried in attempts.items():
        for n, (backend, status) in enumerate(tried, start=1):
            queue.put(
                priced_event(
                    catalog,
                    tenant_id="t1",
                    backend=backend,
                    model="m",
                    usage=random_usage(rng),
                    ts=now,
                    status=status,
                    attempt=n,
                    request_id=request_id,
                )
            )
    await BatchWriter(queue, env.engine).drain()
    await queue.close()
    return (await env.client.get("/admin/api/v1/reports/uptime", headers=AUTH)).json()


async def test_uptime_report(env: Env) -> None:
    now = dt.datetime.now(dt.UTC)
    async with env.ctx.sessions() as session, session.begin():
        for i in range(10):
            session.add(UptimeSample(backend="openai", ts=now, ok=i != 0, latency_ms=5.0))
    # Request r1 failed on openai then succeeded on anthropic; r2 failed everywhere; r3 succeeded.
    attempts = {
        "r1": [("openai", 502), ("anthropic", 200)],
        "r2": [("openai", 503), ("anthropic", 500)],
        "r3": [("openai", 200)],
    }
    report = await _uptime_after(env, attempts, now, seed=7)
    backends = {b["backend"]: b for b in report["backends"]}
    assert backends["openai"]["probe_availability"] == 0.9
    assert (backends["openai"]["attempts"], backends["openai"]["attempts_ok"]) == (3, 1)
    assert backends["anthropic"]["request_availability"] == 0.5 and backends["anthropic"]["probes"] == 0
    assert report["tenants"] == [{"tenant": "t1", "requests": 3, "succeeded": 2, "success_ratio": 0.666667}]


async def test_cancelled_attempts_say_nothing_of_a_backends_availability(env: Env) -> None:
    """A hedge race's loser, cancelled by the gateway, and an attempt whose client left are 499s in the
    ledger: they counted as failures of their backend, so a healthy backend that lost hedge races
    (a little slower than its partner) read as down half the time. Like the breakers, the report now
    takes no verdict from them: counted apart (`attempts_cancelled`), out of the availability."""
    now = dt.datetime.now(dt.UTC)
    # h1 and h2: hedged, openai lost both races; c1: the client left; f1: openai failed, then answered.
    attempts = {
        "h1": [("openai", 499), ("anthropic", 200)],
        "h2": [("anthropic", 200), ("openai", 499)],
        "c1": [("openai", 499)],
        "f1": [("openai", 502), ("openai", 200)],
    }
    report = await _uptime_after(env, attempts, now, seed=11)
    backends = {b["backend"]: b for b in report["backends"]}
    openai = backends["openai"]
    assert openai["request_availability"] == 0.5  # one failure, one answer: the 499s are neither
    assert (openai["attempts"], openai["attempts_ok"], openai["attempts_cancelled"]) == (5, 1, 3)
    claude = backends["anthropic"]
    assert (claude["attempts"], claude["attempts_cancelled"], claude["request_availability"]) == (2, 0, 1.0)


async def _write(env: Env, events: list[UsageEvent]) -> None:
    queue = SpoolQueue(env.tmp_path / "spool")
    for event in events:
        queue.put(event)
    await BatchWriter(queue, env.engine).drain()
    await queue.close()


async def test_the_usage_report_counts_cancelled_attempts_apart_from_errors(env: Env) -> None:
    """A hedge that lost and an attempt whose client left are 499s in the ledger: the usage report
    (and the rollups it reads) counted them as errors, so a route that hedges showed an error rate
    however healthy its backends. They are `cancelled`, from the rollups and the raw ledger alike."""
    day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    noon = day + dt.timedelta(hours=12)
    statuses = {"h1": [200, 499], "h2": [499, 200], "c1": [499], "f1": [502, 200], "f2": [0]}
    await _write(
        env,
        [
            usage_event(request_id, attempt=n, ts=noon, status=status)
            for request_id, tried in statuses.items()
            for n, status in enumerate(tried, start=1)
        ],
    )
    whole_days = {"start": day.date().isoformat(), "end": (day + dt.timedelta(days=1)).date().isoformat()}
    part_of_a_day = {"start": day.isoformat(), "end": (noon + dt.timedelta(hours=1)).isoformat()}
    for params, source in ((whole_days, "rollups"), (part_of_a_day, "events")):
        report = (await env.client.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)).json()
        assert report["source"] == source
        row = report["rows"][0]
        assert [(r["attempts"], r["errors"], r["cancelled"]) for r in report["rows"]] == [(8, 2, 3)], source
        assert row["requests"] == 5, source  # client requests; the 8 attempts are their tries
        assert (report["totals"]["errors"], report["totals"]["cancelled"]) == (2, 3)
    csv_report = await env.client.get(
        "/admin/api/v1/reports/usage", params={**whole_days, "format": "csv"}, headers=AUTH
    )
    [row] = csv.DictReader(io.StringIO(csv_report.text))
    assert (row["requests"], row["attempts"], row["errors"], row["cancelled"]) == ("5", "8", "2", "3")


async def test_the_usage_report_counts_client_requests_apart_from_their_attempts(env: Env) -> None:
    """`requests` counted ledger rows, one per attempt, so a request that failed over counted twice
    on the Finance page. It is the client requests (a client's x-request-id reused is another
    request: its own exchange), each counted once, in the group of its first attempt (a failover's
    backend, a retry after midnight add attempts to theirs, no request), so the rows add up to the
    totals; `attempts` keeps the old count. Whole days read both from the rollups, never the ledger
    (a DISTINCT scan of a month's ledger per report defeated them); other ranges count the ledger's
    first attempts, alike. In the CSV too."""
    day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    noon = day + dt.timedelta(hours=12)
    tried = {  # request id -> (when, backend) of its attempts, in order
        "failed-over": [(noon, "openai"), (noon, "anthropic")],
        "retried": [(noon, "openai")] * 3,
        "first-try": [(noon, "anthropic")],
        "overnight": [
            (day - dt.timedelta(minutes=1), "anthropic"),
            (day + dt.timedelta(minutes=1), "anthropic"),
        ],
    }
    events = [
        usage_event(request_id, attempt=n, ts=ts, backend=backend, status=200 if n == len(steps) else 502)
        for request_id, steps in tried.items()
        for n, (ts, backend) in enumerate(steps, start=1)
    ]
    # A client's x-request-id reused by a second request: its own exchange, its own request.
    events += [usage_event("retried", exchange_id="x2", ts=noon, backend="openai")]
    await _write(env, events)
    yesterday, today, tomorrow = ((day + dt.timedelta(days=n)).date().isoformat() for n in (-1, 0, 1))
    an_hour_later = (noon + dt.timedelta(hours=1)).isoformat()
    ranges = {  # (start, end) of whole days, then of the same attempts in part of a day
        "both days": (
            (yesterday, tomorrow),
            ((day - dt.timedelta(hours=1)).isoformat(), an_hour_later),
            {
                "backend": {"anthropic": (2, 4), "openai": (3, 5)},
                "tenant": {"t": (5, 9)},
                "tenant,key,day": {("t", "k", yesterday): (1, 1), ("t", "k", today): (4, 8)},
            },
        ),
        # The overnight request started yesterday: today has its retry, not the request.
        "today": (
            (today, tomorrow),
            (day.isoformat(), an_hour_later),
            {
                "backend": {"anthropic": (1, 3), "openai": (3, 5)},
                "tenant": {"t": (4, 8)},
                "tenant,key,day": {("t", "k", today): (4, 8)},
            },
        ),
    }
    statements: list[str] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa_event.listen(env.engine.sync_engine, "before_cursor_execute", note)
    try:
        for name, (whole, part, expected) in ranges.items():
            for (start, end), source in ((whole, "rollups"), (part, "events")):
                for group_by, rows in expected.items():
                    statements.clear()
                    params = {"start": start, "end": end, "group_by": group_by}
                    report = (
                        await env.client.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)
                    ).json()
                    assert report["source"] == source
                    if source == "rollups":
                        assert statements and not [s for s in statements if "usage_events" in s], statements
                    keys = group_by.split(",")
                    got = {
                        (r[keys[0]] if len(keys) == 1 else tuple(r[k] for k in keys)): (
                            r["requests"],
                            r["attempts"],
                        )
                        for r in report["rows"]
                    }
                    assert got == rows, (name, source, group_by)
                    totals = tuple(map(sum, zip(*rows.values(), strict=True)))
                    assert (report["totals"]["requests"], report["totals"]["attempts"]) == totals, (
                        name,
                        source,
                    )
    finally:
        sa_event.remove(env.engine.sync_engine, "before_cursor_execute", note)
    csv_report = await env.client.get(
        "/admin/api/v1/reports/usage",
        params={"start": yesterday, "end": tomorrow, "group_by": "backend", "format": "csv"},
        headers=AUTH,
    )
    rows = list(csv.DictReader(io.StringIO(csv_report.text)))
    assert [(r["backend"], r["requests"], r["attempts"]) for r in rows] == [
        ("anthropic", "2", "4"),
        ("openai", "3", "5"),
    ]


async def test_the_rollups_and_the_ledger_give_the_same_rows_in_the_same_order(env: Env) -> None:
    """Traffic of no tenant or key (a config file's or the demo's) is "" in the rollups and NULL in the
    ledger. PostgreSQL sorts NULL last where "" sorts first, so a report over whole days and the same
    report over part of them listed those rows at opposite ends; SQLite sorts NULL first. Both paths
    and both databases list them first now."""
    noon = dt.datetime.now(dt.UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    await _write(
        env,
        [
            usage_event("anonymous", tokens=10, ts=noon, tenant_id=None, key_id=None, cost_pico_usd=7),
            usage_event("t1", tokens=20, ts=noon, tenant_id="t1", key_id="k1", cost_pico_usd=11),
            usage_event("t2", tokens=40, ts=noon, tenant_id="t2", key_id=None, cost_pico_usd=13),
        ],
    )
    day = noon.replace(hour=0)
    whole = {"start": day.date().isoformat(), "end": (day + dt.timedelta(days=1)).date().isoformat()}
    part = {"start": day.isoformat(), "end": (noon + dt.timedelta(hours=1)).isoformat()}
    for group_by in ("tenant,key", "key,tenant", "key"):
        reports = [
            (
                await env.client.get(
                    "/admin/api/v1/reports/usage", params={**p, "group_by": group_by}, headers=AUTH
                )
            ).json()
            for p in (whole, part)
        ]
        assert [r["source"] for r in reports] == ["rollups", "events"]
        assert reports[0]["rows"] == reports[1]["rows"], group_by
        assert reports[0]["totals"] == reports[1]["totals"]
        assert reports[0]["rows"][0]["key"] is None, group_by
    rows = (
        await env.client.get(
            "/admin/api/v1/reports/usage", params={**part, "group_by": "tenant,key"}, headers=AUTH
        )
    ).json()["rows"]
    assert [(r["tenant"], r["key"]) for r in rows] == [(None, None), ("t1", "k1"), ("t2", None)]


async def test_the_usage_csv_holds_no_formula_a_spreadsheet_would_run(env: Env) -> None:
    """Names typed by whoever creates tenants and keys (and model ids such as Cloudflare's `@cf/...`)
    went into the CSV as they were: a spreadsheet opening it runs a cell that starts with `=`, `+`,
    `-` or `@` as a formula (CSV injection). Such text cells start with `'` now, which spreadsheets
    show as text; numbers (a negative saving) are left as they are."""
    c = env.client
    tenant = (
        await c.post("/admin/api/v1/tenants", json={"name": '=HYPERLINK("http://x","y")'}, headers=AUTH)
    ).json()
    key = (
        await c.post(f"/admin/api/v1/tenants/{tenant['id']}/keys", json={"name": "+1-555"}, headers=AUTH)
    ).json()
    noon = dt.datetime.now(dt.UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    await _write(
        env,
        [
            usage_event(
                "r1",
                tokens=10,
                ts=noon,
                tenant_id=tenant["id"],
                key_id=key["id"],
                model="@cf/meta/llama-3-8b",
                cost_pico_usd=5,
                savings_pico_usd=-2,
            )
        ],
    )
    day = noon.replace(hour=0)
    params = {
        "start": day.date().isoformat(),
        "end": (day + dt.timedelta(days=1)).date().isoformat(),
        "group_by": "tenant,key,model",
        "format": "csv",
    }
    [row] = csv.DictReader(
        io.StringIO((await c.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)).text)
    )
    assert (row["tenant_name"], row["key_name"], row["model"]) == (
        '\'=HYPERLINK("http://x","y")',
        "'+1-555",
        "'@cf/meta/llama-3-8b",
    )
    assert (row["tenant"], row["cost_usd"], row["cache_savings_usd"]) == (
        tenant["id"],
        "0.000000000005",
        "-0.000000000002",
    )
    # The JSON report keeps the names as they are.
    report = (
        await c.get("/admin/api/v1/reports/usage", params={**params, "format": "json"}, headers=AUTH)
    ).json()
    assert report["rows"][0]["tenant_name"] == '=HYPERLINK("http://x","y")'


async def test_the_request_logs_latency_is_the_requests_wall_time_not_its_attempts_sum(env: Env) -> None:
    """A hedged request's attempts overlap: the primary ran 0 to 500 ms and answered, the hedge
    started at 150 ms and was cancelled at 510 ms. The request took 500 ms, not their sum (860 ms).
    One that failed over took from its first attempt's start to its last's end."""
    t0 = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    ms = dt.timedelta(milliseconds=1)
    await _write(
        env,
        [
            usage_event("hedged", attempt=1, ts=t0, latency_ms=500.0, status=200),
            usage_event("hedged", attempt=2, ts=t0 + 150 * ms, latency_ms=360.0, status=499),
            usage_event("failed-over", attempt=1, ts=t0, latency_ms=100.0, status=502),
            usage_event("failed-over", attempt=2, ts=t0 + 120 * ms, latency_ms=200.0, status=200),
            usage_event("unanswered", attempt=1, ts=t0, latency_ms=300.0, status=503),
            usage_event("unanswered", attempt=2, ts=t0 + 100 * ms, latency_ms=50.0, status=503),
        ],
    )
    log = (await env.client.get("/admin/api/v1/requests", headers=AUTH)).json()["data"]
    latency = {r["request_id"]: r["latency_ms"] for r in log}
    assert latency == {"hedged": 500.0, "failed-over": 320.0, "unanswered": 300.0}
    hedged = next(r for r in log if r["request_id"] == "hedged")
    assert [a["latency_ms"] for a in hedged["attempts"]] == [500.0, 360.0]  # each attempt's own


async def test_requests_that_share_a_clients_request_id_are_told_apart_by_their_exchange(env: Env) -> None:
    """A client may send one `x-request-id` on many requests; the gateway records each request's
    attempts with an `exchange_id` of its own. The request log and the uptime report's tenants
    grouped attempts by request id (and tenant) alone: three requests, one failed, read as one
    that succeeded after two retries."""
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    await _write(
        env,
        [
            usage_event("trace-1", exchange_id="x1", ts=now, status=200),
            usage_event("trace-1", exchange_id="x2", ts=now, status=502),
            usage_event("trace-1", exchange_id="x2", attempt=2, ts=now, status=200),
            usage_event("trace-1", exchange_id="x3", ts=now, status=503),
            usage_event("own-id", ts=now, status=200),  # the gateway's own id: no exchange_id
        ],
    )
    log = (await env.client.get("/admin/api/v1/requests", headers=AUTH)).json()["data"]
    shown = sorted((r["request_id"], r["exchange_id"], r["status"], len(r["attempts"])) for r in log)
    assert shown == [
        ("own-id", None, 200, 1),
        ("trace-1", "x1", 200, 1),
        ("trace-1", "x2", 200, 2),
        ("trace-1", "x3", 503, 1),
    ]
    uptime = (await env.client.get("/admin/api/v1/reports/uptime", headers=AUTH)).json()
    assert [(t["tenant"], t["requests"], t["succeeded"]) for t in uptime["tenants"]] == [("t", 4, 3)]


def _compared_day(day: dt.datetime) -> list[UsageEvent]:
    """A day of tenant t's traffic on a difficulty route that compares: `asked` answered at once, then
    compared (the other candidate's answer and a judge that failed: calls of Weir's own, each a
    request id of its own); `failed-over` answered on its second attempt; `unanswered` never; and
    `overnight`, which started the evening before, answered only after midnight."""
    noon = day + dt.timedelta(hours=12)
    return [
        usage_event("asked", ts=noon, backend="openai", status=200),
        usage_event("cmp", ts=noon, backend="anthropic", status=200, purpose="compare"),
        usage_event("jdg", ts=noon, backend="openai", status=500, purpose="judge"),
        usage_event("failed-over", ts=noon, backend="openai", status=502),
        usage_event("failed-over", attempt=2, ts=noon, backend="anthropic", status=200),
        usage_event("unanswered", ts=noon, backend="openai", status=502),
        usage_event("unanswered", attempt=2, ts=noon, backend="anthropic", status=503),
        usage_event("overnight", ts=day - dt.timedelta(minutes=1), backend="openai", status=502),
        usage_event("overnight", attempt=2, ts=day + dt.timedelta(minutes=1), backend="openai", status=200),
    ]


async def test_the_uptime_reports_tenants_are_their_own_requests_not_weirs_comparison_calls(env: Env) -> None:
    """A comparison's calls (the other candidate's answer, the judge) are Weir's own: the uptime
    report's `tenants` counted each as one of the tenant's requests, so a compared request read as
    three, and a judge that failed as a request of the tenant's that failed. A tenant's requests are
    now its client requests that started in the range, as the usage report counts them (from the
    rollups for the range's whole days, the ledger for the hours at its edges), each succeeded if any
    of its attempts answered, even after the range; the backends still count every call they
    answered."""
    day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    await _write(env, _compared_day(day))
    yesterday, today, tomorrow = ((day + dt.timedelta(days=n)).date().isoformat() for n in (-1, 0, 1))
    an_hour = dt.timedelta(hours=1)
    ranges = {  # (start, end) -> (requests, succeeded)
        # Whole days (the rollups), part of a day (the ledger), and a day with an hour before it (both).
        (today, tomorrow): (3, 2),
        (day.isoformat(), (day + 13 * an_hour).isoformat()): (3, 2),
        # The overnight request started yesterday and answered today: a request of yesterday's that
        # succeeded (its failed first attempt alone is in the range).
        (yesterday, today): (1, 1),
        ((day - an_hour).isoformat(), day.isoformat()): (1, 1),
        ((day - an_hour).isoformat(), tomorrow): (4, 3),
    }
    for (start, end), (requests, succeeded) in ranges.items():
        params = {"start": start, "end": end}
        report = (await env.client.get("/admin/api/v1/reports/uptime", params=params, headers=AUTH)).json()
        ratio = round(succeeded / requests, 6)
        assert report["tenants"] == [
            {"tenant": "t", "requests": requests, "succeeded": succeeded, "success_ratio": ratio}
        ], params
        usage = (await env.client.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)).json()
        assert [(r["tenant"], r["requests"]) for r in usage["rows"]] == [("t", requests)], params
    # Each backend's availability still counts every call it answered, Weir's own too.
    whole_today = {"start": today, "end": tomorrow}
    for params in (
        whole_today,
        {"start": day.isoformat(), "end": (day + dt.timedelta(hours=13)).isoformat()},
    ):
        report = (await env.client.get("/admin/api/v1/reports/uptime", params=params, headers=AUTH)).json()
        counts = {b["backend"]: (b["attempts"], b["attempts_ok"]) for b in report["backends"]}
        # openai: asked, the judge, the two failed first attempts, overnight's answer; anthropic: the
        # comparison's answer and the two second attempts.
        assert counts == {"openai": (5, 2), "anthropic": (3, 2)}, params


async def test_the_uptime_reports_edges_count_each_request_where_it_started(env: Env) -> None:
    """The rule at a range's edges: a tenant's request belongs to the range its first attempt started
    in, succeeded if any of its attempts answered (even after the range); each attempt counts for its
    backend in the range it started in. A request started at 23:59:59 and retried or answered after
    midnight is the earlier day's, and so on for a range that starts or ends inside one. Whatever
    mix of rollups (whole UTC days) and ledger (the hours at the edges) a range reads, the report is
    that rule computed from the events themselves, so ranges that tile a span add up to the span's."""
    day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    rng = random.Random(5)
    tick = dt.timedelta(microseconds=1)
    midnights = (day, day + dt.timedelta(days=1))
    # First attempts on, just before and just after each midnight and at noon; each later attempt a
    # microsecond or 30 s after the one before, some across the midnight.
    moments = [m + d for m in midnights for d in (-tick, dt.timedelta(0), tick, -dt.timedelta(seconds=1))]
    moments.append(day + dt.timedelta(hours=12))
    events: list[UsageEvent] = []
    for n in range(60):
        ts = rng.choice(moments)
        for attempt in range(1, rng.randint(1, 3) + 1):
            status = rng.choice([200, 200, 499, 502])
            backend = rng.choice(["openai", "anthropic"])
            events.append(usage_event(f"r{n}", attempt=attempt, ts=ts, backend=backend, status=status))
            if status == 200:
                break
            ts += rng.choice([tick, dt.timedelta(seconds=30)])
    await _write(env, events)

    def expected(lo: dt.datetime, hi: dt.datetime) -> tuple[dict[str, tuple[int, int, int]], list[Any]]:
        backends: dict[str, tuple[int, int, int]] = {}
        for e in events:
            if lo <= e.ts < hi:
                total, ok, cancelled = backends.get(e.backend, (0, 0, 0))
                backends[e.backend] = (total + 1, ok + (e.status == 200), cancelled + (e.status == 499))
        answered = {e.request_id for e in events if e.status == 200}
        started = [e.request_id for e in events if e.attempt == 1 and lo <= e.ts < hi]
        succeeded = sum(r in answered for r in started)
        tenants = [("t", len(started), succeeded)] if started else []
        return backends, tenants

    edges = sorted({day - dt.timedelta(days=1), *moments, day + dt.timedelta(days=2)})
    edges += [day + dt.timedelta(hours=6)]
    ranges = [(lo, hi) for lo in edges for hi in edges if lo < hi]
    for lo, hi in ranges:
        params = {"start": lo.isoformat(), "end": hi.isoformat()}
        report = (await env.client.get("/admin/api/v1/reports/uptime", params=params, headers=AUTH)).json()
        backends = {
            b["backend"]: (b["attempts"], b["attempts_ok"], b["attempts_cancelled"])
            for b in report["backends"]
        }
        tenants = [(t["tenant"], t["requests"], t["succeeded"]) for t in report["tenants"]]
        assert (backends, tenants) == expected(lo, hi), params
        # The usage report counts the same requests in the same range.
        usage = (await env.client.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)).json()
        assert [(r["tenant"], r["requests"]) for r in usage["rows"]] == [(t, n) for t, n, _ in tenants], (
            params
        )


async def test_the_uptime_report_reads_the_ledger_by_index_not_by_grouping_it(env: Env) -> None:
    """Over whole days the uptime report grouped the range's whole ledger by request to tell which
    requests any attempt answered: on 200,000 attempts about a second, for each of the 15 reports the
    Backends page asks (docs/benchmarks.md, "Uptime report"). It reads the rollups, and of the ledger
    only the first attempts that did not answer and the later attempts that did, through their partial
    indexes, whose predicates the query says word for word (else neither database would use them)."""
    day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    await _write(env, _compared_day(day))
    statements: list[tuple[str, Any]] = []

    def note(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if "usage_events" in statement:
            statements.append((statement, parameters))

    sa_event.listen(env.engine.sync_engine, "before_cursor_execute", note)
    try:
        params = {"start": day.date().isoformat(), "end": (day + dt.timedelta(days=1)).date().isoformat()}
        report = (await env.client.get("/admin/api/v1/reports/uptime", params=params, headers=AUTH)).json()
    finally:
        sa_event.remove(env.engine.sync_engine, "before_cursor_execute", note)
    assert report["tenants"][0]["requests"] == 3
    [(statement, parameters)] = statements  # the unanswered requests; the rest came from the rollups
    sqlite = env.engine.dialect.name == "sqlite"
    async with env.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        if sqlite:
            cursor = await driver.execute(f"EXPLAIN QUERY PLAN {statement}", parameters)
            plan = " | ".join(str(row[-1]) for row in await cursor.fetchall())
        else:
            # Refusing sequential scans leaves the planner any index it can use: the partial ones only
            # if the query's WHERE implies their predicates.
            await driver.execute("SET enable_seqscan = off")
            plan = " | ".join(r[0] for r in await driver.fetch(f"EXPLAIN {statement}", *parameters))
    assert "ix_usage_events_unanswered_starts" in plan, plan
    if sqlite:
        # Each of those first attempts' later attempts by its request id; no other read of the ledger.
        reads = [step for step in plan.split(" | ") if "usage_events" in step]
        assert all("USING INDEX ix_usage_events_" in step for step in reads), plan
        assert not any("ix_usage_events_ts_tenant" in step for step in reads), plan
    else:
        assert "ix_usage_events_answered_retries" in plan or "ix_usage_events_request_id" in plan, plan


async def test_the_request_log_says_which_requests_weir_made_itself(env: Env) -> None:
    """A comparison's calls are requests of their own in the log, beside the client's: each says why
    Weir made it (`purpose`), where a client's request says none."""
    day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    await _write(env, _compared_day(day))
    log = (await env.client.get("/admin/api/v1/requests", headers=AUTH)).json()["data"]
    assert {r["request_id"]: r["purpose"] for r in log} == {
        "asked": None,
        "cmp": "compare",
        "jdg": "judge",
        "failed-over": None,
        "unanswered": None,
        "overnight": None,
    }


async def test_the_usage_csv_writes_ratios_in_plain_decimals(env: Env) -> None:
    """A cache hit ratio of one read in a million prompt tokens went into the CSV as Python prints the
    float, `1e-06`, which finance tools and spreadsheets set to text read as a string: every number in
    the CSV is plain decimal now, as the JSON report's amounts are."""
    noon = dt.datetime.now(dt.UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    usage = Usage(input_tokens=999_999, cached_input_tokens=1, output_tokens=1)
    await _write(env, [usage_event("r1", ts=noon, usage=usage, cost_pico_usd=7)])
    day = noon.replace(hour=0)
    params = {
        "start": day.date().isoformat(),
        "end": (day + dt.timedelta(days=1)).date().isoformat(),
        "group_by": "model",
    }
    report = (await env.client.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)).json()
    assert report["rows"][0]["cache_hit_ratio"] == 0.000001
    text = (
        await env.client.get("/admin/api/v1/reports/usage", params={**params, "format": "csv"}, headers=AUTH)
    ).text
    [row] = csv.DictReader(io.StringIO(text))
    assert (row["cache_hit_ratio"], row["total_tokens"]) == ("0.000001", "1000001")
    assert "e-" not in text.lower()


async def test_the_usage_report_groups_by_route_from_rollups_and_ledger_alike(env: Env) -> None:
    """The ledger keeps each attempt's route (the public name asked for: `auto`, or a model by its
    name), but the report could not group by it. `group_by=route` reads the route rollups over whole
    days and the ledger otherwise, with the same rows, JSON and CSV."""
    day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    routes = {"auto": [("b", "m1", 200), ("b", "m2", 502), ("c", "m1", 200)], "m1": [("b", "m1", 499)]}
    events = [
        usage_event(
            f"{route}-{i}",
            tokens=10 * (i + 1),
            cost_pico_usd=1_000 * (i + 1),
            ts=day + dt.timedelta(hours=6 + i),
            route=route,
            backend=backend,
            model=model,
            status=status,
            tenant_id=None if route == "m1" else "t",
        )
        for route, attempts in routes.items()
        for i, (backend, model, status) in enumerate(attempts)
    ]
    await _write(env, events)
    whole = {"start": day.date().isoformat(), "end": (day + dt.timedelta(days=1)).date().isoformat()}
    hours = {"start": day.isoformat(), "end": (day + dt.timedelta(hours=23)).isoformat()}
    reports = {}
    for name, span in (("rollups", whole), ("events", hours)):
        for group_by in ("route", "tenant,route,model"):
            params = {**span, "group_by": group_by}
            report = (await env.client.get("/admin/api/v1/reports/usage", params=params, headers=AUTH)).json()
            assert report["source"] == name
            reports[name, group_by] = report
    for group_by in ("route", "tenant,route,model"):
        assert reports["rollups", group_by]["rows"] == reports["events", group_by]["rows"]
        assert reports["rollups", group_by]["totals"] == reports["events", group_by]["totals"]
    by_route = {r["route"]: r for r in reports["rollups", "route"]["rows"]}
    assert list(by_route) == ["auto", "m1"]
    assert [(r["attempts"], r["errors"], r["cancelled"], r["cost_usd"]) for r in by_route.values()] == [
        (3, 1, 0, "0.000000006"),
        (1, 0, 1, "0.000000001"),
    ]
    assert [
        (r["tenant"], r["route"], r["model"]) for r in reports["rollups", "tenant,route,model"]["rows"]
    ] == [
        (None, "m1", "m1"),
        ("t", "auto", "m1"),
        ("t", "auto", "m2"),
    ]
    text = (
        await env.client.get(
            "/admin/api/v1/reports/usage",
            params={**whole, "group_by": "route", "format": "csv"},
            headers=AUTH,
        )
    ).text
    assert [(r["route"], r["attempts"]) for r in csv.DictReader(io.StringIO(text))] == [
        ("auto", "3"),
        ("m1", "1"),
    ]
    assert text.startswith("route,requests,")


@pytest.mark.parametrize("name", ["   ", "ac\tme", "ac\nme", "acme\x7f", "ac\x85me"])
async def test_a_name_empty_once_trimmed_or_with_a_control_character_is_refused(env: Env, name: str) -> None:
    """The UI trims names; the API took them as sent, so a tenant or key named " acme" or "ac\\nme"
    read as another name (or none) on every page and report. Refused with a 400, nothing stored."""
    c = env.client
    assert_openai_error(await c.post("/admin/api/v1/tenants", json={"name": name}, headers=AUTH), 400, "name")
    tenant = (await c.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    path = f"/admin/api/v1/tenants/{tenant['id']}"
    assert_openai_error(await c.patch(path, json={"name": name}, headers=AUTH), 400, "name")
    assert_openai_error(await c.post(f"{path}/keys", json={"name": name}, headers=AUTH), 400, "name")
    assert (await c.get(path, headers=AUTH)).json()["name"] == "acme"
    assert (await c.get(f"{path}/keys", headers=AUTH)).json()["data"] == []
    assert [t["name"] for t in (await c.get("/admin/api/v1/tenants", headers=AUTH)).json()["data"]] == [
        "acme"
    ]


async def test_names_are_stored_trimmed_as_the_ui_sends_them(env: Env) -> None:
    c = env.client
    created = await c.post("/admin/api/v1/tenants", json={"name": "  acme \n"}, headers=AUTH)
    assert created.status_code == 201, created.text
    assert created.json()["name"] == "acme"
    path = f"/admin/api/v1/tenants/{created.json()['id']}"
    # Another tenant named as this one once trimmed is the same name: a conflict, not a second tenant.
    assert_openai_error(await c.post("/admin/api/v1/tenants", json={"name": "acme "}, headers=AUTH), 409)
    renamed = await c.patch(path, json={"name": " beta "}, headers=AUTH)
    assert renamed.status_code == 200 and renamed.json()["name"] == "beta"
    key = await c.post(f"{path}/keys", json={"name": " app "}, headers=AUTH)
    assert key.status_code == 201 and key.json()["name"] == "app"


@pytest.mark.parametrize(
    ("path", "most"),
    [
        ("/admin/api/v1/audit", 1000),
        ("/admin/api/v1/requests", 500),
        ("/admin/api/v1/tenants/{id}/prompts", 1000),
        ("/admin/api/v1/tenants/{id}/comparisons", 1000),
    ],
)
async def test_a_limit_out_of_range_is_refused_alike_on_every_list(env: Env, path: str, most: int) -> None:
    """`limit` was clamped on /audit, /requests and /prompts (a client asking for 5,000 got 1,000 and
    no word of it) but refused on /comparisons: refused on each, naming its range."""
    tenant = (await env.client.post("/admin/api/v1/tenants", json={"name": "acme"}, headers=AUTH)).json()
    url = path.replace("{id}", tenant["id"])
    for limit in (0, -1, most + 1):
        error = assert_openai_error(
            await env.client.get(url, params={"limit": limit}, headers=AUTH), 400, "limit"
        )
        assert f"between 1 and {most}" in error["message"] and error["code"] == "invalid_value"
    for limit in (1, most):
        assert (await env.client.get(url, params={"limit": limit}, headers=AUTH)).status_code == 200


async def test_the_request_log_misses_no_request_whose_attempts_share_a_timestamp(env: Env) -> None:
    """The log scans the ledger newest first in pages. 96 failed requests and 4 that succeeded, all
    at one moment: `status=ok` pages through them all and finds each once."""
    now = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(minutes=1)
    ok = {f"r{i:03d}" for i in range(0, 100, 25)}
    await _write(
        env, [usage_event(f"r{i:03d}", ts=now, status=200 if f"r{i:03d}" in ok else 502) for i in range(100)]
    )
    log = await env.client.get("/admin/api/v1/requests", params={"status": "ok", "limit": 4}, headers=AUTH)
    assert log.status_code == 200, log.text
    assert {r["request_id"] for r in log.json()["data"]} == ok
    everything = (await env.client.get("/admin/api/v1/requests", params={"limit": 100}, headers=AUTH)).json()
    assert len({r["request_id"] for r in everything["data"]}) == 100


async def test_the_request_log_pages_past_attempts_written_while_it_reads(env: Env) -> None:
    """A busy gateway writes attempts while the log is read. Paged with OFFSET, each page's attempts
    written since the last pushed the ledger down under it: the next page read again what the last
    had read, and the one request that succeeded, 20 failed attempts back, was never reached. Read
    from where the last page ended (a keyset on ts and event id), it is."""
    t0 = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    second = dt.timedelta(seconds=1)
    await _write(
        env,
        [
            usage_event("answered", ts=t0, status=200),
            *(usage_event(f"failed-{i}", ts=t0 + (i + 1) * second, status=502) for i in range(20)),
        ],
    )
    pages: list[str] = []

    def busy(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "ORDER BY usage_events.ts DESC" not in statement or "request_id IN" in statement:
            return  # not a page of the scan (the attempts of the requests found filter by request_id)
        if pages:  # 4 more failed attempts, newer than every other, before each page after the first
            newer = [
                usage_event(f"busy-{len(pages)}-{i}", ts=t0 + (100 + i) * second, status=502)
                for i in range(4)
            ]
            await_only(_write(env, newer))
        pages.append(statement)

    sa_event.listen(env.engine.sync_engine, "before_cursor_execute", busy)
    try:
        log = await env.client.get(
            "/admin/api/v1/requests", params={"status": "ok", "limit": 1}, headers=AUTH
        )
    finally:
        sa_event.remove(env.engine.sync_engine, "before_cursor_execute", busy)
    assert log.status_code == 200, log.text
    assert len(pages) > 1
    assert [r["request_id"] for r in log.json()["data"]] == ["answered"]


async def test_a_patch_that_changes_nothing_writes_no_audit_entry(env: Env) -> None:
    c = env.client
    tenant = (await c.post("/admin/api/v1/tenants", json={"name": "acme", "rpm": 60}, headers=AUTH)).json()
    path = f"/admin/api/v1/tenants/{tenant['id']}"
    for body in ({}, {"rpm": 60}, {"name": "acme"}, {"name": " acme ", "tpm": None}):
        r = await c.patch(path, json=body, headers=AUTH)
        assert r.status_code == 200 and r.json() == tenant, r.text
    assert (await c.patch(path, json={"rpm": 61}, headers=AUTH)).status_code == 200
    audit = (await c.get("/admin/api/v1/audit", params={"entity_id": tenant["id"]}, headers=AUTH)).json()
    assert [a["action"] for a in audit["data"]] == ["update", "create"]
    assert audit["data"][0]["before"]["rpm"] == 60 and audit["data"][0]["after"]["rpm"] == 61
