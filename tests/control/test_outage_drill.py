"""The drill: Redis AND PostgreSQL stopped for real while requests flow. The gateway keeps serving
(cached keys, limits in process, usage events in the local spool), and once both are back every
usage event lands in the ledger exactly once.

Other tests share these servers, so the outage lasts a few seconds, and both are restarted in a
`finally` whatever happens."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.db import REDIS_URL, sync_exec
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.skipif(
        not (
            shutil.which("pg_ctlcluster")
            and shutil.which("redis-server")
            and os.path.isdir("/etc/postgresql")
        ),
        reason="needs the local PostgreSQL cluster and redis-server to stop and start",
    ),
]

ADMIN = "admin-token-for-the-drill"
REDIS_SERVER = ["redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", "6379"]
REDIS_SERVER += ["--save", "", "--appendonly", "no"]  # as the development machine runs it
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
database_url: "${DB_URL}"
redis_url: "${REDIS_URL}"
"""


def _pg_ctl(action: str) -> subprocess.CompletedProcess[bytes]:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    command = ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action]
    return subprocess.run(command + (["-m", "fast"] if action == "stop" else []), capture_output=True)


def _redis_up() -> bool:
    with contextlib.suppress(redis.RedisError):
        return bool(redis.Redis.from_url(REDIS_URL, socket_timeout=0.5).ping())
    return False


def _pg_up() -> bool:
    return subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1"], capture_output=True).returncode == 0


@contextlib.contextmanager
def redis_and_postgres_down() -> Iterator[None]:
    try:
        subprocess.run(["redis-cli", "-u", REDIS_URL, "shutdown", "nosave"], capture_output=True)
        assert _pg_ctl("stop").returncode == 0
        assert not _redis_up() and not _pg_up()
        yield
    finally:
        if not _redis_up():
            subprocess.run(REDIS_SERVER, capture_output=True)
        if not _pg_up():
            _pg_ctl("start")
        deadline = time.monotonic() + 30
        while not (_redis_up() and _pg_up()) and time.monotonic() < deadline:
            time.sleep(0.1)


def test_gateway_serves_through_redis_and_postgres_outage_and_bills_once(
    pg_url: str, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "spool"
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(spool))
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    with FakeOpenAI() as fake:
        env = {
            "OPENAI_BASE_URL": fake.base_url,
            "OPENAI_API_KEY": fake.api_key,
            "DB_URL": pg_url,
            "REDIS_URL": REDIS_URL,
        }
        app = create_app(parse_config(CONFIG, env))
        with serve(app, free_port()) as url:
            admin = httpx.Client(base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
            limits = {"rpm": 1000, "tpm": 10**7, "budget_usd_monthly": "100"}
            tenant = admin.post("/tenants", json={"name": "drill", **limits}).json()["id"]
            key = admin.post(f"/tenants/{tenant}/keys", json=limits).json()["key"]
            chat = httpx.Client(base_url=f"{url}/v1", headers={"authorization": f"Bearer {key}"}, timeout=10)
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

            def ledger() -> list[tuple]:
                return sync_exec(pg_url, f"SELECT request_id FROM usage_events WHERE tenant_id = '{tenant}'")

            served: list[str] = []

            def send(n: int) -> None:
                for _ in range(n):
                    reply = chat.post("/chat/completions", json=body)
                    assert reply.status_code == 200, reply.text
                    served.append(reply.headers["x-request-id"])

            send(5)  # the key is cached, the budget seeded, and these reach the ledger first
            deadline = time.monotonic() + 15
            while len(ledger()) < 5 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(ledger()) == 5

            with redis_and_postgres_down():
                send(20)
                # The events of the outage wait on disk, not only in memory.
                time.sleep(0.3)
                spooled = sum(len(f.read_bytes().splitlines()) for f in spool.rglob("*.jsonl") if f.is_file())
                assert spooled >= 20
            send(5)

            deadline = time.monotonic() + 30
            while len(ledger()) < 30 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.5)  # a late duplicate would show up here
            ids = [r[0] for r in ledger()]
            assert len(served) == 30 and sorted(ids) == sorted(served)  # every request, once
