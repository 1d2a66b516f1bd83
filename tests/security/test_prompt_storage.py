"""Prompt and completion bodies are stored only for tenants that opt in, encrypted when a master
key is set, readable through the admin API under their own tenant only, and deleted after the
tenant's retention period (by the gateway's periodic job and by `weir db purge-prompts`). On SQLite
and PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from structlog.testing import capture_logs

import gateway.prompts as prompts_module
from gateway.app import create_app
from gateway.config import parse_config
from gateway.db import migrate
from gateway.db.session import create_engine, sessionmaker
from gateway.limits import Exchange
from gateway.prompts import PromptStore
from gateway.vault import ENV, generate_key
from tests.fakes import FakeOpenAI
from tests.fixtures.db import sync_exec
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.waiting import wait_for
from weir.cli import main

ADMIN = "admin-token-for-tests"
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai}
database_url: "${DB_URL}"
"""


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def write(url: str, sql: str) -> None:
    """One committed statement (sync_exec only reads)."""

    async def run() -> None:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.execute(text(sql))
        finally:
            await engine.dispose()

    asyncio.run(run())


def rows(db: str, tenant_id: str) -> list[tuple]:
    return sync_exec(
        db,
        "SELECT request_id, key_id, request_body, response_body FROM stored_prompts "
        f"WHERE tenant_id = '{tenant_id}' ORDER BY id",
    )


def test_opt_in_storage_isolation_and_retention(
    db: str, fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv(ENV, generate_key())
    monkeypatch.setenv("WEIR_PROMPT_PURGE_INTERVAL_S", "0.3")
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": db}
    app = create_app(parse_config(CONFIG, env))
    with serve(app, free_port()) as url:
        admin = httpx.Client(base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
        a = admin.post("/tenants", json={"name": "alpha"}).json()
        b = admin.post("/tenants", json={"name": "beta"}).json()
        assert a["store_prompts"] is False and a["prompt_retention_days"] is None
        a_key = admin.post(f"/tenants/{a['id']}/keys", json={}).json()["key"]
        b_key = admin.post(f"/tenants/{b['id']}/keys", json={}).json()["key"]

        def chat(key: str, text: str, stream: bool = False) -> httpx.Response:
            payload = {
                "model": "gpt-4o-mini",
                "messages": [{"role": "user", "content": text}],
                "stream": stream,
            }
            response = httpx.post(
                f"{url}/v1/chat/completions", json=payload, headers={"authorization": f"Bearer {key}"}
            )
            assert response.status_code == 200, response.text
            return response

        # Off by default: nothing is kept for either tenant.
        chat(a_key, "alpha before opting in")
        chat(b_key, "beta never opts in")
        time.sleep(1.5)  # two flush periods of the writer
        assert rows(db, a["id"]) == [] and rows(db, b["id"]) == []

        patched = admin.patch(f"/tenants/{a['id']}", json={"store_prompts": True, "prompt_retention_days": 7})
        assert patched.json()["store_prompts"] is True and patched.json()["prompt_retention_days"] == 7
        plain = chat(a_key, "the secret plan is 42")
        streamed = chat(a_key, "stream the secret plan", stream=True)
        chat(b_key, "beta still never opts in")
        wait_for(lambda: len(rows(db, a["id"])) == 2)
        assert rows(db, b["id"]) == []

        # At rest the bodies are ciphertext (a master key is set).
        stored = rows(db, a["id"])
        assert [r[0] for r in stored] == [plain.headers["x-request-id"], streamed.headers["x-request-id"]]
        assert all(r[1] is not None and "secret plan" not in r[2] + r[3] for r in stored)

        # The admin API reads them under their tenant, and only there.
        rid = plain.headers["x-request-id"]
        got = admin.get(f"/tenants/{a['id']}/prompts/{rid}")
        assert got.status_code == 200, got.text
        (entry,) = got.json()["data"]
        assert "the secret plan is 42" in entry["request"] and entry["status"] == 200
        assert plain.json()["choices"][0]["message"]["content"] in entry["response"]
        streamed_entry = admin.get(f"/tenants/{a['id']}/prompts/{streamed.headers['x-request-id']}").json()
        assert "data: [DONE]" in streamed_entry["data"][0]["response"]
        other = admin.get(f"/tenants/{b['id']}/prompts/{rid}")
        assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
        assert [p["request_id"] for p in admin.get(f"/tenants/{a['id']}/prompts").json()["data"]] == [
            streamed.headers["x-request-id"],
            rid,
        ]
        assert admin.get(f"/tenants/{b['id']}/prompts").json()["data"] == []
        for key in (a_key, b_key):  # tenant keys do not reach stored prompts, not even their own
            forged = httpx.get(
                f"{url}/admin/api/v1/tenants/{a['id']}/prompts/{rid}",
                headers={"authorization": f"Bearer {key}"},
            )
            assert forged.status_code == 401 and "secret plan" not in forged.text
        assert admin.get("/audit", params={"entity": "stored_prompt"}).json()["data"][0]["action"] == "read"

        # Retention, by the gateway's periodic job: a row older than the tenant's 7 days goes.
        old = (dt.datetime.now(dt.UTC) - dt.timedelta(days=8)).strftime("%Y-%m-%d %H:%M:%S")
        write(db, f"UPDATE stored_prompts SET ts = '{old}' WHERE request_id = '{rid}'")
        wait_for(lambda: [r[0] for r in rows(db, a["id"])] == [streamed.headers["x-request-id"]])

    # Retention, by the CLI (the gateway is stopped): a fresh row stays, an old one goes.
    purged = CliRunner().invoke(main, ["db", "purge-prompts", "--database-url", db])
    assert purged.exit_code == 0 and "deleted 0 " in purged.output, purged.output
    write(db, f"UPDATE stored_prompts SET ts = '{old}'")
    purged = CliRunner().invoke(main, ["db", "purge-prompts", "--database-url", db])
    assert purged.exit_code == 0 and "deleted 1 " in purged.output, purged.output
    assert rows(db, a["id"]) == []


async def test_queue_is_bounded_and_survives_a_failed_write(
    sqlite_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prompts_module, "MAX_QUEUED_BYTES", 3000)
    exchange = Exchange(
        capture=True, tenant_id="t1", request=[b"q" * 1000], response=[b"r" * 400], status=200
    )
    # A database without the table: every write fails, nothing is lost, memory stays bounded.
    broken = create_engine(f"sqlite+aiosqlite:///{tmp_path}/empty.db")
    store = PromptStore(sessionmaker(broken), None)
    for i in range(3):
        store.capture(exchange, f"r{i}", "chat")
    assert len(store.queue) == 2 and store.dropped == 1 and store.queued_bytes == 2800
    with pytest.raises(Exception, match="stored_prompts"):
        await store.flush()
    assert len(store.queue) == 2 and store.queued_bytes == 2800
    await broken.dispose()
    # The database is back: the same rows land, once.
    await asyncio.to_thread(migrate.upgrade, sqlite_url)
    engine = create_engine(sqlite_url)
    store.sessions = sessionmaker(engine)
    assert await store.flush() == 2 and store.queued_bytes == 0 and not store.queue
    async with engine.connect() as conn:
        stored = (await conn.execute(text("SELECT request_id, request_body FROM stored_prompts"))).all()
    await engine.dispose()
    assert [r[0] for r in stored] == ["r0", "r1"] and stored[0][1] == "q" * 1000


async def test_a_failed_write_logs_no_prompt_text(tmp_path: Path) -> None:
    """Stored bodies are in clear without WEIR_MASTER_KEY; the warning for a write the database
    refuses must not carry them: SQLAlchemy's error text quotes the statement's parameters."""
    exchange = Exchange(
        capture=True,
        tenant_id="t1",
        request=[b'{"messages": [{"role": "user", "content": "the merger closes on friday"}]}'],
        response=[b'{"choices": [{"message": {"content": "keep it quiet until then"}}]}'],
        status=200,
    )
    broken = create_engine(f"sqlite+aiosqlite:///{tmp_path}/empty.db")  # no table: every write fails
    store = PromptStore(sessionmaker(broken), None, flush_interval_s=0.01)
    store.capture(exchange, "r1", "chat")
    with capture_logs() as logs:
        await store.start()
        try:
            deadline = time.monotonic() + 20
            while not any(line["event"] == "prompt_store_write_failed" for line in logs):
                assert time.monotonic() < deadline, "timed out"
                await asyncio.sleep(0.01)
        finally:
            await store.stop()
    await broken.dispose()
    failed = next(line for line in logs if line["event"] == "prompt_store_write_failed")
    assert "stored_prompts" in failed["error"]  # still says what failed
    assert "merger" not in str(failed) and "quiet" not in str(failed)


def test_prompts_stored_in_the_same_instant_list_newest_first(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timestamps tie (a burst within the clock's resolution, or rows copied in by hand); the listing
    then orders by insertion, newest first, so `limit` cuts the same rows every time."""
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    env = {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "sk-unused", "DB_URL": sqlite_url}
    app = create_app(parse_config(CONFIG, env))
    with serve(app, free_port()) as url:
        admin = httpx.Client(base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
        tenant = admin.post("/tenants", json={"name": "alpha"}).json()["id"]
        for rid in ("req-b", "req-c", "req-a"):  # inserted in this order, names not in it
            write(
                sqlite_url,
                "INSERT INTO stored_prompts (request_id, tenant_id, ts, endpoint, status, request_body,"
                f" response_body) VALUES ('{rid}', '{tenant}', '2026-12-06 03:00:00.000000',"
                " '/v1/chat/completions', 200, '{}', '{}')",
            )
        listed = admin.get(f"/tenants/{tenant}/prompts").json()["data"]
        assert [p["request_id"] for p in listed] == ["req-a", "req-c", "req-b"]
        first_two = admin.get(f"/tenants/{tenant}/prompts", params={"limit": 2}).json()["data"]
        assert [p["request_id"] for p in first_two] == ["req-a", "req-c"]
