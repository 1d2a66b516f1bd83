"""Uptime from active probes: the routing prober's results reach `uptime_samples` in batches, and
`/reports/uptime` shows a backend that went down and came back, beside the real request outcomes."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Integer, func, select
from sqlalchemy.engine import make_url

import routing.router
from gateway.accounting.uptime import ProbeRecorder
from gateway.app import create_app
from gateway.config import parse_config
from gateway.db import migrate
from gateway.db.models import UptimeSample
from gateway.db.session import create_engine
from tests.control.helpers import TcpProxy
from tests.fakes import FakeOpenAI
from tests.fixtures.db import sync_exec
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.waiting import wait_for

ADMIN = "admin-token-for-uptime"
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai}
database_url: "${DB_URL}"
"""


def test_probes_see_a_backend_go_down_and_come_back(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    # No route probes this backend: it is probed for the uptime report alone, every 0.1 s here.
    monkeypatch.setattr(routing.router, "IDLE_PROBE_INTERVAL_S", 0.1)
    with FakeOpenAI() as fake:
        env = {"OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": fake.api_key, "DB_URL": sqlite_url}
        app = create_app(parse_config(CONFIG, env))
        app.state.control.uptime.flush_s = 0.2
        with serve(app, free_port()) as url:
            admin = httpx.Client(base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
            tenant = admin.post("/tenants", json={"name": "acme"}).json()
            key = admin.post(f"/tenants/{tenant['id']}/keys", json={}).json()["key"]
            chat = httpx.Client(base_url=f"{url}/v1", headers={"authorization": f"Bearer {key}"})
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

            def samples() -> list[tuple]:
                return sync_exec(sqlite_url, "SELECT ok FROM uptime_samples ORDER BY ts, id")

            wait_for(lambda: len(samples()) >= 5)
            fake.stop()  # the backend goes away
            try:
                assert chat.post("/chat/completions", json=body).status_code >= 500
                up_before = sum(ok for (ok,) in samples())
                wait_for(lambda: sum(not ok for (ok,) in samples()) >= 5)
            finally:
                fake.start()  # and comes back on the same port
            down = sum(not ok for (ok,) in samples())
            wait_for(lambda: sum(ok for (ok,) in samples()) >= up_before + 5)
            assert chat.post("/chat/completions", json=body).status_code == 200

            # The samples tell the story in order: up, then down, then up again.
            oks = [bool(ok) for (ok,) in samples()]
            first_down, last_down = oks.index(False), len(oks) - 1 - oks[::-1].index(False)
            assert all(oks[:first_down]) and all(oks[last_down + 1 :]) and first_down >= 5
            assert not any(oks[first_down : last_down + 1]) and last_down - first_down + 1 >= down

            # Probes are written in batches (every 0.2 s), not one transaction per probe.
            recorder = app.state.control.uptime
            assert recorder.written >= len(oks) and recorder.batches < recorder.written / 1.5

            def backend_row() -> dict:
                report = admin.get("/reports/uptime").json()
                return next(b for b in report["backends"] if b["backend"] == "openai")

            wait_for(lambda: backend_row()["attempts"] == 2)
            row = backend_row()
            probes, probes_ok = row["probes"], row["probes_ok"]
            assert probes >= len(oks) and probes - probes_ok >= down
            assert row["probe_availability"] == round(probes_ok / probes, 6) and 0 < probes_ok < probes
            assert row["attempts_ok"] == 1 and row["request_availability"] == 0.5
            tenant_row = next(
                t for t in admin.get("/reports/uptime").json()["tenants"] if t["tenant"] == tenant["id"]
            )
            assert tenant_row["requests"] == 2 and tenant_row["succeeded"] == 1


@pytest.mark.postgres
async def test_recorder_keeps_samples_while_the_db_is_down(pg_url: str) -> None:
    await migrate.upgrade_async(pg_url)
    proxy = TcpProxy(make_url(pg_url).port or 5432)
    await proxy.start()
    engine = create_engine(make_url(pg_url).set(port=proxy.port).render_as_string(hide_password=False))
    recorder = ProbeRecorder(engine)
    t0 = dt.datetime(2026, 11, 29, tzinfo=dt.UTC)
    try:
        for i in range(3):
            recorder.record("openai", True, 1.5, t0 + dt.timedelta(seconds=i))
        assert await recorder.flush() == 3
        await proxy.stop()  # the database goes away; probes keep coming
        for i in range(3, 7):
            recorder.record("openai", i % 2 == 0, None, t0 + dt.timedelta(seconds=i))
        with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises for a dead server
            await recorder.flush()
        recorder.record("anthropic", False, None, t0 + dt.timedelta(seconds=7))
        await proxy.start()
        await asyncio.sleep(0)
        assert await recorder.flush() == 5  # the four kept and the one recorded meanwhile, once
        assert await recorder.flush() == 0
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(UptimeSample.backend, func.count(), func.sum(UptimeSample.ok.cast(Integer)))
                    .group_by(UptimeSample.backend)
                    .order_by(UptimeSample.backend)
                )
            ).all()
        assert [tuple(r) for r in rows] == [("anthropic", 1, 0), ("openai", 7, 5)]
    finally:
        await engine.dispose()
        await proxy.stop()
