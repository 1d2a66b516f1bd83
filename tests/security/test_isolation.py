"""Tenant isolation and secret hygiene, tried the way an attacker with a valid tenant key would: a
key of tenant A never reads, spends or sees anything of tenant B, never reaches the admin API, and no
key or vendor secret ends up in the logs or the ledger."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.fakes import FakeOpenAI
from tests.fixtures.db import sync_exec
from tests.fixtures.gateway import ADMIN, Weir, sqlite_weir

CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: model-a, backend: openai, model: gpt-4o-mini, price: {input: 0.15, output: 0.60}}
  - {name: model-b, backend: openai, model: gpt-4o, price: {input: 2.5, output: 10.0}}
database_url: "${DB_URL}"
# Off: test_admin_api_refuses_tenant_keys sends dozens of wrong admin tokens from one address, each
# to be refused as wrong (the throttle's own tests: tests/security/test_auth_throttle.py).
server: {admin_auth_failures_per_minute: 0}
"""
HI = [{"role": "user", "content": "hello"}]
ADMIN_GETS = ["/tenants", "/prices", "/reports/usage", "/reports/uptime", "/audit", "/requests", "/routes"]


@pytest.fixture
def weir(fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Weir]:
    fake_openai.models.add("gpt-4o")
    with sqlite_weir(CONFIG, fake_openai, tmp_path, monkeypatch) as weir:
        yield weir


def keyed_tenant(weir: Weir, name: str, model: str) -> tuple[str, str]:
    tenant = weir.admin.post("/tenants", json={"name": name}).json()
    key = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"models": [model]}).json()
    return tenant["id"], key["key"]


def test_a_tenant_key_sees_uses_and_reads_only_its_own(weir: Weir) -> None:
    a_id, a_key = keyed_tenant(weir, "alpha", "model-a")
    b_id, b_key = keyed_tenant(weir, "beta", "model-b")
    a, b = weir.client(a_key), weir.client(b_key)

    # Models: each sees only what its key allows; the other's model does not exist for it.
    assert [m.id for m in a.models.list()] == ["model-a"]
    assert [m.id for m in b.models.list()] == ["model-b"]
    with pytest.raises(openai.NotFoundError):
        a.models.retrieve("model-b")
    with pytest.raises(openai.NotFoundError):
        a.chat.completions.create(model="model-b", messages=HI)  # type: ignore[arg-type]

    # Spend: A's request lands on A only.
    raw = a.chat.completions.with_raw_response.create(model="model-a", messages=HI)  # type: ignore[arg-type]
    a_request = raw.headers["x-request-id"]
    rows = weir.ledger(a_id, expect=1)
    time.sleep(0.3)  # a row for the refused model-b call (it must not reach a backend) would show now
    rows = weir.ledger(a_id, expect=1)
    assert [r[4] for r in rows] == [200]
    assert weir.ledger(b_id, expect=1, timeout=0.5) == []

    # Feedback and request ids: B can neither read A's feedback nor overwrite it.
    auth_a, auth_b = {"authorization": f"Bearer {a_key}"}, {"authorization": f"Bearer {b_key}"}
    feedback = f"{weir.url}/v1/feedback"
    assert httpx.post(feedback, json={"request_id": a_request, "score": 1}, headers=auth_a).status_code == 200
    stolen = httpx.get(f"{feedback}/{a_request}", headers=auth_b)
    assert stolen.status_code == 404 and stolen.json()["error"]["code"] == "not_found"
    assert httpx.post(feedback, json={"request_id": a_request, "score": 0}, headers=auth_b).status_code == 200
    assert httpx.get(f"{feedback}/{a_request}", headers=auth_a).json()["score"] == 1


def test_admin_api_refuses_tenant_keys(weir: Weir) -> None:
    _, key = keyed_tenant(weir, "intruder", "model-a")
    headers = [f"Bearer {key}", "Bearer", f"Basic {key}", f"Bearer {ADMIN[:-1]}", f"Bearer {ADMIN}x", key]
    for path in ADMIN_GETS:
        assert weir.admin.get(path).status_code == 200, path  # the admin token does reach it
        for header in headers:
            response = httpx.get(f"{weir.url}/admin/api/v1{path}", headers={"authorization": header})
            assert response.status_code in (401, 403), (path, header[:12], response.status_code)
            assert set(response.json()["error"]) >= {"message", "type", "code"}
    forged = httpx.post(
        f"{weir.url}/admin/api/v1/tenants", json={"name": "evil"}, headers={"authorization": f"Bearer {key}"}
    )
    assert forged.status_code in (401, 403)
    assert "evil" not in str(weir.admin.get("/tenants").json())


def test_no_secret_reaches_the_logs_or_the_ledger(
    weir: Weir,
    fake_openai: FakeOpenAI,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    tenant_id, key = keyed_tenant(weir, "quiet", "model-a")
    client = weir.client(key)
    client.chat.completions.create(model="model-a", messages=HI)  # type: ignore[arg-type]
    list(client.chat.completions.create(model="model-a", messages=HI, stream=True))  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        weir.client(key + "typo").chat.completions.create(model="model-a", messages=HI)  # type: ignore[arg-type]
    fake_openai.fail_next(500)
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="model-a", messages=HI)  # type: ignore[arg-type]
    weir.ledger(tenant_id, expect=3)

    out, err = capfd.readouterr()
    logs = out + err + caplog.text
    assert "request" in logs  # the request log was captured, so its absence of secrets means something
    ledger = str(sync_exec(weir.db_url, "SELECT * FROM usage_events"))
    keys = str(sync_exec(weir.db_url, "SELECT * FROM api_keys"))
    for secret in (key, key[len("wk-") :], ADMIN, fake_openai.api_key):  # the key with or without its prefix
        assert secret not in logs
        assert secret not in ledger and secret not in keys
