"""Two gateway replicas on one PostgreSQL admin DB and one Redis: a session opened on one is good on
the other, signing out on one ends it on both, and a lockout counts failures from both."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from gateway.admin import ui
from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.db import REDIS_URL
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.ui.helpers import ADMIN, CONFIG

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def replicas(
    fake_openai: FakeOpenAI,
    pg_url: str,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[str]]:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": pg_url}
    with ExitStack() as stack:
        urls = []
        for _ in range(2):
            urls.append(stack.enter_context(serve(create_app(parse_config(CONFIG, env)), free_port())))
        yield urls


def test_sessions_and_lockouts_are_shared_by_replicas(replicas: list[str]) -> None:
    a, b = (httpx.Client(base_url=url, headers={"origin": url}) for url in replicas)
    signed = a.post("/admin/session", json={"token": ADMIN})
    assert signed.status_code == 200
    csrf, cookie = signed.json()["csrf"], a.cookies[ui.COOKIE]

    b.cookies.set(ui.COOKIE, cookie)
    made = b.post("/admin/session/api/v1/tenants", json={"name": "acme"}, headers={"x-weir-csrf": csrf})
    assert made.status_code == 201
    assert [t["name"] for t in a.get("/admin/session/api/v1/tenants").json()["data"]] == ["acme"]

    assert a.delete("/admin/session", headers={"x-weir-csrf": csrf}).status_code == 204
    assert b.get("/admin/session/api/v1/tenants").status_code == 401

    for i in range(ui.MAX_FAILURES):
        assert (a if i % 2 else b).post("/admin/session", json={"token": "nope"}).status_code == 401
    assert a.post("/admin/session", json={"token": ADMIN}).status_code == 429
    assert b.post("/admin/session", json={"token": ADMIN}).status_code == 429
