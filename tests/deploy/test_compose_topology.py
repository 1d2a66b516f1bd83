"""deploy/compose.yaml's topology, run as local processes instead of containers (no Docker engine here):
the `migrate` service's command against a fresh PostgreSQL database, then two gateway replicas with
the shipped config and the gateway service's environment, which names every secret as a file (made by
deploy/new-secrets.sh, local addresses written into the URLs), sharing that database and a Redis
started with the compose Redis command. A client spread over both replicas, as nginx spreads it, is served;
the shared ledger holds each request once; what one replica's admin API creates, the other honours."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import asyncpg
import httpx
import openai
import pytest

from tests.deploy.artefacts import DEPLOY
from tests.deploy.compose_env import at_secrets, example_env, interpolate, new_secrets
from tests.deploy.dockerfiles import healthcheck_argv
from tests.deploy.processes import WEIR, redis_server, weir_serving
from tests.fakes import FakeOpenAI

# Two gateways, a migration and a Redis start here: about 20-30 s on 2 shared cores.
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REQUESTS = 12


def pg_admin(statement: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(PG_ADMIN)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    name = f"weir_deploy_{uuid.uuid4().hex[:12]}"
    pg_admin(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def replicas(
    compose: dict[str, Any],
    database: str,
    _fake_openai_server: FakeOpenAI,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[list[str], dict[str, str]]]:
    secrets = new_secrets(tmp_path_factory.mktemp("run") / "secrets")
    services = at_secrets(interpolate(compose, example_env())["services"], secrets)
    weir_free = {k: v for k, v in os.environ.items() if not k.startswith(("WEIR_", "OPENAI_", "ANTHROPIC_"))}

    # 1. `migrate`: its command and environment, the database URL file pointed at the local server.
    compose_url = (secrets / "database_url").read_text()
    assert compose_url.startswith("postgresql+asyncpg://") and compose_url.endswith("@postgres:5432/weir\n")
    (secrets / "database_url").write_text(database + "\n")
    migrate_env = {**weir_free, **services["migrate"]["environment"]}
    argv = [str(WEIR), *services["migrate"]["command"][1:]]
    done = subprocess.run(argv, env=migrate_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    current = subprocess.run([str(WEIR), "db", "current"], env=migrate_env, capture_output=True, text=True)
    assert current.returncode == 0 and "empty" not in current.stdout

    # 2. The gateways, with the gateway service's environment (local addresses, the fake vendor's key).
    redis_argv = [*services["redis"]["entrypoint"], *services["redis"]["command"]]
    redis_argv = [a.replace("docker-entrypoint.sh ", "") for a in redis_argv]  # it only drops root
    with redis_server(redis_argv, tmp_path_factory.mktemp("redis")) as redis_port:
        redis_url = (secrets / "redis_url").read_text().replace("@redis:6379", f"@127.0.0.1:{redis_port}")
        (secrets / "redis_url").write_text(redis_url)
        (secrets / "openai_api_key").write_text(_fake_openai_server.api_key + "\n")
        env = {**weir_free, **services["gateway"]["environment"]}
        assert not [
            k for k in env if k.startswith(("WEIR_", "OPENAI_", "ANTHROPIC_")) and not k.endswith("_FILE")
        ]
        env["OPENAI_BASE_URL"] = _fake_openai_server.base_url
        config = DEPLOY / "compose" / "weir.yaml"
        cwds = [tmp_path_factory.mktemp("gateway-1"), tmp_path_factory.mktemp("gateway-2")]
        with weir_serving(config, env, cwds) as gateways:
            keys = {
                name: (secrets / name).read_text().strip() for name in ("weir_demo_key", "weir_admin_token")
            }
            yield [gateway.base for gateway in gateways], keys


def test_both_replicas_pass_the_images_health_check(replicas: tuple[list[str], dict[str, str]]) -> None:
    bases, _ = replicas
    for base in bases:
        port = int(base.rsplit(":", 1)[1])
        argv = healthcheck_argv(DEPLOY / "docker" / "gateway.Dockerfile", port)
        assert subprocess.run(argv, capture_output=True, timeout=10).returncode == 0, base


def test_requests_spread_over_replicas_land_once_in_the_shared_ledger(
    replicas: tuple[list[str], dict[str, str]], fake_openai: FakeOpenAI
) -> None:
    bases, keys = replicas
    clients = [openai.OpenAI(base_url=f"{b}/v1", api_key=keys["weir_demo_key"], max_retries=0) for b in bases]
    run = uuid.uuid4().hex[:8]
    prompt_tokens = completion_tokens = 0
    for i in range(REQUESTS):
        reply = clients[i % 2].chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": f"request {i} of run {run}"}]
        )
        assert f"request {i} of run {run}" in (reply.choices[0].message.content or "")
        assert reply.usage is not None
        prompt_tokens += reply.usage.prompt_tokens
        completion_tokens += reply.usage.completion_tokens
    assert sum(r.path == "/v1/chat/completions" for r in fake_openai.requests) == REQUESTS

    # Either replica's admin API reads the one ledger both replicas' batch writers fill.
    admin = {"authorization": f"Bearer {keys['weir_admin_token']}"}
    deadline = time.monotonic() + 30
    while True:
        reports = [
            httpx.get(
                f"{b}/admin/api/v1/reports/usage", params={"group_by": "model"}, headers=admin, timeout=5
            )
            for b in bases
        ]
        assert all(r.status_code == 200 for r in reports), [r.text for r in reports]
        rows = [{row["model"]: row for row in r.json()["rows"]}.get("gpt-4o-mini") for r in reports]
        if all(row and row["requests"] >= REQUESTS for row in rows):
            break
        assert time.monotonic() < deadline, f"the ledger did not fill: {rows}"
        time.sleep(0.5)
    assert rows[0] == rows[1]
    row = rows[0]
    assert row is not None
    assert row["requests"] == REQUESTS  # once each, though two writers share the queue
    assert (row["input_tokens"], row["output_tokens"]) == (prompt_tokens, completion_tokens)
    # Priced with the config's prices, seeded into the catalog: USD 0.15 / 0.60 per 1M tokens.
    expected = (
        Decimal(prompt_tokens) * Decimal("0.15") + Decimal(completion_tokens) * Decimal("0.60")
    ) / 10**6
    assert Decimal(row["cost_usd"]) == expected


def test_a_key_created_on_one_replica_works_on_the_other(replicas: tuple[list[str], dict[str, str]]) -> None:
    (first, second), keys = replicas
    admin = {"authorization": f"Bearer {keys['weir_admin_token']}"}
    tenant = httpx.post(
        f"{first}/admin/api/v1/tenants", json={"name": f"acme-{uuid.uuid4().hex[:6]}"}, headers=admin
    )
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(f"{first}/admin/api/v1/tenants/{tenant.json()['id']}/keys", json={}, headers=admin)
    assert key.status_code == 201, key.text
    client = openai.OpenAI(base_url=f"{second}/v1", api_key=key.json()["key"], max_retries=0)
    assert "gpt-4o-mini" in {m.id for m in client.models.list()}
