"""Vendor API keys stored in the admin DB: encrypted under WEIR_MASTER_KEY, never shown or logged,
used by every replica within seconds, rotated with `weir db rotate-master-key`, and a wrong key
is a clear error rather than a crash. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import select

from gateway.app import create_app
from gateway.config import Backend, parse_config
from gateway.credentials import CredentialStore
from gateway.db import migrate
from gateway.db.models import StoredPrompt
from gateway.db.session import create_engine, sessionmaker
from gateway.limits import Exchange
from gateway.prompts import PromptStore, read_body
from gateway.vault import ENV, ENV_PREVIOUS, Vault, VaultError, generate_key
from tests.fakes import FakeOpenAI
from tests.fixtures.db import sync_exec
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.waiting import wait_for
from weir.cli import main

ADMIN = "admin-token-for-tests"
TENANT_KEY = "sk-tenant-secrets-test"
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "config-key-the-fake-refuses"}
models:
  - {name: gpt-4o-mini, backend: openai}
tenants:
  - {name: acme, api_keys: ["sk-tenant-secrets-test"]}
database_url: "${DB_URL}"
"""
HI = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_PREVIOUS, raising=False)
    return monkeypatch


def gateway(stack: ExitStack, fake: FakeOpenAI, db: str) -> str:
    config = parse_config(CONFIG, {"OPENAI_BASE_URL": fake.base_url, "DB_URL": db})
    return stack.enter_context(serve(create_app(config), free_port()))


def chat(url: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions", json=HI, headers={"authorization": f"Bearer {TENANT_KEY}"}
    )


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})


# --- the vault on its own -------------------------------------------------------------------------


def test_vault_round_trip_binds_context_and_names_missing_keys() -> None:
    key_text = generate_key()
    vault = Vault.from_env({ENV: key_text})
    assert vault is not None
    token = vault.encrypt("sk-very-secret", "backend_credentials:openai")
    assert "sk-very-secret" not in token and token.startswith(f"v1:{vault.primary_id}:")
    assert vault.decrypt(token, "backend_credentials:openai") == "sk-very-secret"
    with pytest.raises(VaultError, match="altered or moved"):  # copied onto another backend's row
        vault.decrypt(token, "backend_credentials:anthropic")
    other = Vault.from_env({ENV: generate_key()})
    assert other is not None
    with pytest.raises(VaultError, match=f"master key {vault.primary_id}, which is not in"):
        other.decrypt(token, "backend_credentials:openai")
    # During a rotation the old key may also come from WEIR_MASTER_KEY_PREVIOUS.
    rotating = Vault.from_env({ENV: generate_key(), ENV_PREVIOUS: key_text})
    assert rotating is not None and rotating.key_ids[1] == vault.primary_id
    moved = rotating.rotate(token, "backend_credentials:openai")
    assert moved.startswith(f"v1:{rotating.primary_id}:")
    assert rotating.decrypt(moved, "backend_credentials:openai") == "sk-very-secret"
    assert Vault.from_env({}) is None
    with pytest.raises(VaultError, match="is not a master key"):
        Vault.from_env({ENV: "too-short"})
    with pytest.raises(VaultError, match="WEIR_MASTER_KEY is not"):
        Vault.from_env({ENV_PREVIOUS: generate_key()})


def test_serve_refuses_a_malformed_master_key(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "weir.yaml"
    config.write_text("backends: []\n")
    env.setenv(ENV, "not-a-key")
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 1 and "WEIR_MASTER_KEY key 1 is not a master key" in result.output


# --- through the gateway --------------------------------------------------------------------------


def test_stored_key_is_encrypted_used_everywhere_and_never_shown(
    db: str, env: pytest.MonkeyPatch, fake_openai: FakeOpenAI, capfd: pytest.CaptureFixture[str]
) -> None:
    master = generate_key()
    env.setenv(ENV, master)
    secret = fake_openai.api_key
    with ExitStack() as stack:
        a = gateway(stack, fake_openai, db)
        b = gateway(stack, fake_openai, db)  # a second replica on the same DB
        assert chat(a).status_code != 200  # the config's key is wrong: the fake refuses it

        put = admin(a).put("/backends/openai/credentials", json={"api_key": secret})
        assert put.status_code == 200, put.text
        shown = put.json()
        vault = Vault.from_env({ENV: master})
        assert vault is not None
        assert shown["last4"] == secret[-4:] and shown["in_use"] is True
        assert shown["key_id"] == vault.primary_id
        assert secret not in put.text

        # The replica that took the write uses the key at once, the other within seconds.
        response = chat(a)
        assert response.status_code == 200, response.text
        assert fake_openai.requests[-1].headers["authorization"] == f"Bearer {secret}"
        wait_for(lambda: chat(b).status_code == 200)

        got = admin(b).get("/backends/openai/credentials")
        assert got.status_code == 200 and secret not in got.text and got.json()["in_use"] is True
        listed = admin(a).get("/credentials")
        assert [c["backend"] for c in listed.json()["data"]] == ["openai"] and secret not in listed.text
        assert admin(a).put("/backends/nope/credentials", json={"api_key": secret}).status_code == 404

        # A tenant key can neither read, replace nor delete a vendor key.
        for method, path in [
            ("PUT", "/backends/openai/credentials"),
            ("GET", "/backends/openai/credentials"),
            ("GET", "/credentials"),
            ("DELETE", "/backends/openai/credentials"),
        ]:
            forged = httpx.request(
                method,
                f"{a}/admin/api/v1{path}",
                json={"api_key": "sk-attacker-key"} if method == "PUT" else None,
                headers={"authorization": f"Bearer {TENANT_KEY}"},
            )
            assert forged.status_code == 401 and secret not in forged.text, (method, path)
        assert chat(a).status_code == 200

        # At rest: the column holds ciphertext only; the audit log has the change without the key.
        (ciphertext,) = sync_exec(db, "SELECT ciphertext FROM backend_credentials")[0]
        assert secret not in ciphertext and ciphertext.startswith("v1:")
        audit = sync_exec(db, "SELECT action, after FROM audit_log WHERE entity = 'backend_credential'")
        assert [row[0] for row in audit] == ["create"] and all(secret not in str(row) for row in audit)

        # Deleted: the config's (wrong) key is back, on both replicas.
        assert admin(a).delete("/backends/openai/credentials").status_code == 204
        assert chat(a).status_code != 200
        wait_for(lambda: chat(b).status_code != 200)
        assert admin(a).get("/backends/openai/credentials").status_code == 404
    logged = capfd.readouterr()
    assert "backend_credentials_loaded" in logged.out  # the log was captured...
    assert secret not in logged.out + logged.err  # ...and never shows the key


def test_without_a_master_key_nothing_is_stored(
    db: str, env: pytest.MonkeyPatch, fake_openai: FakeOpenAI
) -> None:
    with ExitStack() as stack:
        url = gateway(stack, fake_openai, db)
        refused = admin(url).put("/backends/openai/credentials", json={"api_key": fake_openai.api_key})
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "master_key_not_configured" and "WEIR_MASTER_KEY" in error["message"]
    assert sync_exec(db, "SELECT count(*) FROM backend_credentials") == [(0,)]


def test_a_key_that_is_blank_or_holds_a_line_break_is_refused_and_changes_nothing(
    db: str, env: pytest.MonkeyPatch, fake_openai: FakeOpenAI
) -> None:
    """The key's length was checked before its surrounding whitespace was dropped: eight spaces
    replaced a working stored key with an empty one. A line break inside a key made every request
    of the backend fail on an invalid header. Both are a 400 naming `api_key`, and the stored key
    stays."""
    env.setenv(ENV, generate_key())
    with ExitStack() as stack:
        url = gateway(stack, fake_openai, db)
        stored = admin(url).put("/backends/openai/credentials", json={"api_key": fake_openai.api_key})
        assert stored.status_code == 200, stored.text
        for bad in (" " * 8, "\n  sk-1234  \n", "sk-12345\nx-extra: 1", "sk-1234\u00005678"):
            refused = admin(url).put("/backends/openai/credentials", json={"api_key": bad})
            assert refused.status_code == 400, (bad, refused.text)
            assert refused.json()["error"]["param"] == "api_key"
        assert admin(url).get("/backends/openai/credentials").json() == stored.json()
        assert chat(url).status_code == 200
        # A key pasted with a trailing newline is the key.
        again = admin(url).put("/backends/openai/credentials", json={"api_key": f" {fake_openai.api_key}\n"})
        assert again.status_code == 200 and again.json()["fingerprint"] == stored.json()["fingerprint"]


def test_rotation_then_old_key_removal_and_a_wrong_key(
    db: str, env: pytest.MonkeyPatch, fake_openai: FakeOpenAI
) -> None:
    old, new, wrong = generate_key(), generate_key(), generate_key()
    env.setenv(ENV, old)
    with ExitStack() as stack:
        url = gateway(stack, fake_openai, db)
        assert (
            admin(url).put("/backends/openai/credentials", json={"api_key": fake_openai.api_key}).is_success
        )
    old_id, new_id = sync_exec(db, "SELECT key_id FROM backend_credentials")[0][0], None
    asyncio.run(store_prompt(db, Vault.from_env({ENV: old})))  # a stored prompt under the old key too

    runner = CliRunner()
    # A wrong key: a clear error, and nothing changes.
    env.setenv(ENV, wrong)
    failed = runner.invoke(main, ["db", "rotate-master-key", "--database-url", db])
    assert (
        failed.exit_code == 1
        and "not in WEIR_MASTER_KEY" in failed.output
        and "nothing was changed" in failed.output
    )
    assert sync_exec(db, "SELECT key_id FROM backend_credentials")[0][0] == old_id

    # New key first, old one still readable: every row moves under the new key.
    env.setenv(ENV, f"{new},{old}")
    rotated = runner.invoke(main, ["db", "rotate-master-key", "--database-url", db])
    assert rotated.exit_code == 0, rotated.output
    assert "1 vendor keys, 1 stored prompts" in rotated.output
    new_id = sync_exec(db, "SELECT key_id FROM backend_credentials")[0][0]
    assert new_id != old_id
    assert sync_exec(db, "SELECT key_id FROM stored_prompts") == [(new_id,)]
    assert asyncio.run(read_prompt(db, Vault.from_env({ENV: new}))) == ("the prompt", "the reply")
    again = runner.invoke(main, ["db", "rotate-master-key", "--database-url", db])
    assert again.exit_code == 0 and "0 vendor keys, 0 stored prompts (1 keys already were)" in again.output

    # The old key removed: the gateway still reads the stored key and uses it.
    env.setenv(ENV, new)
    with ExitStack() as stack:
        url = gateway(stack, fake_openai, db)
        assert chat(url).status_code == 200
        assert fake_openai.requests[-1].headers["authorization"] == f"Bearer {fake_openai.api_key}"

    # The gateway with a wrong key starts, says why the stored key is unused, and falls back.
    env.setenv(ENV, wrong)
    with ExitStack() as stack:
        url = gateway(stack, fake_openai, db)
        shown = admin(url).get("/backends/openai/credentials").json()
        assert shown["in_use"] is False and "not in WEIR_MASTER_KEY" in shown["error"]
        assert chat(url).status_code != 200  # the config's key, which the fake refuses


async def store_prompt(db: str, vault: Vault | None) -> None:
    engine = create_engine(db)
    store = PromptStore(sessionmaker(engine), vault)
    exchange = Exchange(capture=True, tenant_id="t1", request=[b"the prompt"], response=[b"the reply"])
    store.capture(exchange, "req-1", "chat")
    assert await store.flush() == 1
    await engine.dispose()


async def read_prompt(db: str, vault: Vault | None) -> tuple[str, str]:
    engine = create_engine(db)
    async with sessionmaker(engine)() as session:
        row = (await session.scalars(select(StoredPrompt))).one()
    await engine.dispose()
    return read_body(row, vault)


def test_store_applies_and_reverts_config_keys(sqlite_url: str) -> None:
    migrate.upgrade(sqlite_url)
    vault = Vault([bytes(32)])
    backends = [Backend(name="x", type="openai", base_url="http://x", api_key="from-config")]

    async def run() -> None:
        engine = create_engine(sqlite_url)
        store = CredentialStore(sessionmaker(engine), backends, vault)
        store.apply({"x": vault.encrypt("from-db", "backend_credentials:x")})
        assert backends[0].api_key == "from-db" and store.in_use == {"x"}
        store.apply({"x": vault.encrypt("from-db", "backend_credentials:y")})  # a row moved over
        assert backends[0].api_key == "from-config" and "altered or moved" in store.errors["x"]
        store.apply({})
        assert backends[0].api_key == "from-config" and store.errors == {}
        await engine.dispose()

    asyncio.run(run())
