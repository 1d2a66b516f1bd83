"""Infrastructure faults under a real gateway: Redis or the database going away and coming back.

Redis and PostgreSQL are reached through a TCP proxy that the test stops and starts (the shared
servers keep running for everyone else).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.db import REDIS_PORT, REDIS_URL
from tests.fixtures.gateway import ADMIN, CONFIG, Weir
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.reliability.proxy import ThreadedProxy

HI = [{"role": "user", "content": "hello there"}]


def degraded(weir: Weir) -> float:
    metrics = httpx.get(f"{weir.url}/metrics").text
    match = re.search(r"^weir_shared_state_degraded (\S+)$", metrics, re.M)
    assert match, "the metric is exported"
    return float(match.group(1))


def statuses(client: openai.OpenAI, n: int) -> list[int]:
    codes = []
    for _ in range(n):
        try:
            client.chat.completions.create(model="gpt-4o-mini", messages=HI)  # type: ignore[arg-type]
            codes.append(200)
        except openai.APIStatusError as exc:
            codes.append(exc.status_code)
    return codes


@pytest.fixture
def redis_proxy() -> Iterator[ThreadedProxy]:
    proxy = ThreadedProxy(REDIS_PORT)
    yield proxy
    proxy.close()


@pytest.fixture
def weir_on_redis(
    fake_openai: FakeOpenAI,
    tmp_path: Path,
    redis_prefix: str,
    redis_proxy: ThreadedProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Weir]:
    db_url = f"sqlite+aiosqlite:///{tmp_path}/weir.db"
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_REDIS_URL", f"redis://127.0.0.1:{redis_proxy.port}/0")
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": db_url}
    with serve(create_app(parse_config(CONFIG, env)), free_port()) as url:
        yield Weir(url, db_url)


@pytest.mark.redis
def test_redis_down_degrades_to_in_process_limits_and_recovers(
    weir_on_redis: Weir, redis_proxy: ThreadedProxy
) -> None:
    weir = weir_on_redis
    tenant_id, _, key = weir.tenant_with_key("through-outage", rpm=4)
    client = weir.client(key)
    assert statuses(client, 3) == [200, 200, 200]
    assert degraded(weir) == 0

    redis_proxy.stop()
    # Still serving, limits now counted in this process, from the 3 of 4 Redis last said this minute
    # held (it started from none of them and admitted 4 more).
    assert statuses(client, 5) == [200, 429, 429, 429, 429]
    assert degraded(weir) == 1
    assert httpx.get(f"{weir.url}/healthz").status_code == 200

    redis_proxy.start()
    deadline = time.monotonic() + 5  # the state retries Redis every second
    while degraded(weir) and time.monotonic() < deadline:
        time.sleep(0.1)
    # Back on Redis, which was handed the outage's 1 on top of its 3: 4 of 4 this minute, so nothing
    # more is admitted.
    assert statuses(client, 2) == [429, 429]
    assert degraded(weir) == 0
    # Every usage event of the outage waited in memory and reached the ledger once Redis was back.
    rows = weir.ledger(tenant_id, expect=4)
    assert sorted(row[4] for row in rows) == [200] * 4


@pytest.fixture
def pg_proxy(pg_url: str) -> Iterator[ThreadedProxy]:
    from sqlalchemy.engine import make_url

    proxy = ThreadedProxy(make_url(pg_url).port or 5432)
    yield proxy
    proxy.close()


@pytest.mark.postgres
@pytest.mark.parametrize("with_redis", [False, True], ids=["spool", "redis"])
def test_database_down_keeps_serving_and_loses_no_usage_event(
    fake_openai: FakeOpenAI,
    tmp_path: Path,
    pg_url: str,
    pg_proxy: ThreadedProxy,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    with_redis: bool,
) -> None:
    from sqlalchemy.engine import make_url

    through_proxy = make_url(pg_url).set(port=pg_proxy.port).render_as_string(hide_password=False)
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    if with_redis:
        monkeypatch.setenv("WEIR_REDIS_URL", REDIS_URL)
    env = {
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "DB_URL": through_proxy,
    }
    with serve(create_app(parse_config(CONFIG, env)), free_port()) as url:
        weir = Weir(url, pg_url)  # the test reads the ledger directly, never through the proxy
        tenant_id, _, key = weir.tenant_with_key("through-db-outage")
        client = weir.client(key)
        assert statuses(client, 2) == [200, 200]  # the key is now cached (it is checked in the DB once)
        assert len(weir.ledger(tenant_id, expect=2)) == 2

        pg_proxy.stop()  # the database goes away
        assert statuses(client, 10) == [200] * 10  # served from the key cache; events wait in the queue
        assert httpx.get(f"{url}/healthz").status_code == 200
        streamed = client.chat.completions.create(model="gpt-4o-mini", messages=HI, stream=True)  # type: ignore[arg-type]
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "hello there"
        assert statuses(client, 1) == [200]
        time.sleep(1.0)  # the batch writer fails and retries meanwhile
        assert len(weir.ledger(tenant_id, expect=2)) == 2

        pg_proxy.start()  # and comes back: every waiting event lands, once
        rows = weir.ledger(tenant_id, expect=14, timeout=30)
        time.sleep(0.5)
        rows = weir.ledger(tenant_id, expect=14)
        assert [row[4] for row in rows] == [200] * 14
