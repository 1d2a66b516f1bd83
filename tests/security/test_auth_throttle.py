"""Wrong credentials are throttled per client address. Tenant keys: every unknown key costs the admin
DB a query, so past `server.auth_failures_per_minute` wrong keys an address gets 429 without one,
while its keys already known valid keep working (a real client's one typo must not lock it out).
Admin tokens: past `server.admin_auth_failures_per_minute` wrong tokens an address gets 429 even with
the right one (else the throttle would not slow guessing: the right guess would still get through)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from litestar import Litestar

from gateway.accounting.admission import Quotas
from gateway.admin.control_plane import FirstMatch
from gateway.admin.keys import DbAuthenticator, KeyRecord, key_digest
from gateway.admin.router import AdminContext, admin_router
from gateway.admin.token import token_digest
from gateway.app import create_app
from gateway.auth import Principal, StaticAuthenticator
from gateway.config import parse_config
from gateway.db.session import create_engine, sessionmaker
from gateway.state import MemoryState
from gateway.state.degradable import DegradableState
from gateway.state.redis import RedisState
from gateway.throttle import FailureThrottle, SharedFailureThrottle, client_address
from tests.control.helpers import TcpProxy
from tests.fixtures.db import REDIS_PORT, REDIS_URL, migrated_sqlite
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

N = 5  # failures a minute: a refill every 12 s of the fake clock
CONFIG_KEY = "sk-config-tenant-key"
DB_KEY = "wk-the-one-real-db-key"
ADMIN = "admin-token-for-throttle-tests"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _config(per_minute: int) -> str:
    return f"""\
backends:
  - {{name: openai, type: openai, base_url: "http://127.0.0.1:9", api_key: "unused"}}
models:
  - {{name: model-a, backend: openai, model: gpt-4o-mini}}
tenants:
  - {{name: config-tenant, api_keys: ["{CONFIG_KEY}"]}}
server: {{auth_failures_per_minute: {per_minute}}}
"""


class Gateway:
    """A gateway app (no backends reached: /v1/models only) whose admin-DB keys come from a fake DB
    that counts its queries."""

    def __init__(self, per_minute: int) -> None:
        self.queries: list[str] = []
        record = KeyRecord(
            principal=Principal(tenant_id="t1", tenant_name="db-tenant", key_id="k1"),
            key_hash=key_digest(DB_KEY),
            quotas=Quotas("t1", "k1"),
        )

        async def load(digest: str) -> KeyRecord | None:
            self.queries.append(digest)
            return record if digest == record.key_hash else None

        config = parse_config(_config(per_minute), {})
        db = DbAuthenticator(sessions=None, state=None)  # type: ignore[arg-type]  # _load replaced
        db._load = load  # type: ignore[method-assign]
        self.app = create_app(
            config, authenticator=FirstMatch([StaticAuthenticator(config.tenants or []), db])
        )
        self.clock = Clock()
        self.app.state.gateway.auth_throttle.clock = self.clock

    async def models(self, key: str, address: str = "203.0.113.7") -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app, client=(address, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://weir") as client:
            return await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})


def _assert_throttled(response: httpx.Response) -> int:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "too_many_failed_authentications"
    wait = int(response.headers["retry-after"])
    assert 1 <= wait <= 60
    return wait


async def test_unknown_keys_past_the_allowance_get_429_without_a_db_query() -> None:
    gw = Gateway(N)
    assert (await gw.models(DB_KEY)).status_code == 200  # the real key, seen once: now cached
    for i in range(N):
        assert (await gw.models(f"wk-guess-{i}")).status_code == 401
    assert len(gw.queries) == 1 + N

    for i in range(N, 3 * N):
        _assert_throttled(await gw.models(f"wk-guess-{i}"))
    assert len(gw.queries) == 1 + N  # the spray stopped reaching the DB

    # The throttled address's real keys still work: the cached DB key and the config key.
    assert (await gw.models(DB_KEY)).status_code == 200
    assert (await gw.models(CONFIG_KEY)).status_code == 200
    # Another address is not affected.
    assert (await gw.models("wk-guess-elsewhere", address="198.51.100.9")).status_code == 401
    assert len(gw.queries) == 2 + N


async def test_the_allowance_refills() -> None:
    gw = Gateway(N)
    for i in range(N):
        assert (await gw.models(f"wk-guess-{i}")).status_code == 401
    wait = _assert_throttled(await gw.models("wk-guess-x"))
    assert wait == 60 // N
    gw.clock.now += wait  # one failure's worth back
    assert (await gw.models("wk-guess-y")).status_code == 401
    _assert_throttled(await gw.models("wk-guess-z"))
    gw.clock.now += 60  # a full minute: the whole allowance back
    for i in range(N):
        assert (await gw.models(f"wk-later-{i}")).status_code == 401


async def test_zero_turns_the_throttle_off() -> None:
    gw = Gateway(0)
    for i in range(3 * N):
        assert (await gw.models(f"wk-guess-{i}")).status_code == 401
    assert len(gw.queries) == 3 * N


async def test_a_key_never_seen_valid_is_not_looked_up_while_throttled() -> None:
    # A valid DB key this replica has not cached yet waits like any unknown key: telling it from a
    # guess would take the very query the throttle saves.
    gw = Gateway(N)
    for i in range(N):
        await gw.models(f"wk-guess-{i}")
    _assert_throttled(await gw.models(DB_KEY))
    assert key_digest(DB_KEY) not in gw.queries


def test_client_addresses() -> None:
    assert client_address({"client": ("203.0.113.7", 1)}) == "203.0.113.7"
    # One IPv6 host's /64 is one bucket, however many of its addresses it sends from.
    assert client_address({"client": ("2001:db8:1:2::1", 1)}) == client_address(
        {"client": ("2001:db8:1:2::ff", 1)}
    )
    assert client_address({"client": ("2001:db8:1:2::1", 1)}) != client_address(
        {"client": ("2001:db8:1:3::1", 1)}
    )
    assert client_address({"client": ("::ffff:203.0.113.7", 1)}) == "203.0.113.7"
    assert client_address({"client": None}) == client_address({}) == "unknown"


def test_an_address_is_parsed_once_not_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every authenticated request asks for its bucket; parsing the peer's address each time cost
    more than the rest of the throttle's work. Each address still gets its own bucket."""
    from gateway import throttle

    parsed: list[str] = []
    real = throttle.ipaddress.ip_address

    def counting(host: str) -> Any:
        parsed.append(host)
        return real(host)

    monkeypatch.setattr(throttle.ipaddress, "ip_address", counting)
    # Addresses no other test uses, so not parsed before this one.
    for host in ("198.51.100.23", "2001:db8:7:8::1", "198.51.100.23", "2001:db8:7:8::1"):
        client_address({"client": (host, 40000)})
    assert client_address({"client": ("2001:db8:7:8::2", 1)}) == "2001:db8:7:8::/64"
    assert client_address({"client": ("198.51.100.23", 1)}) == "198.51.100.23"
    assert parsed == ["198.51.100.23", "2001:db8:7:8::1", "2001:db8:7:8::2"]


async def test_the_address_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway import throttle

    monkeypatch.setattr(throttle, "MAX_ADDRESSES", 100)
    limiter = FailureThrottle(1)
    for i in range(1000):
        await limiter.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter._buckets) == 100
    assert await limiter.retry_after("10.0.3.231") is not None  # the most recent are kept


# --- admin tokens ---------------------------------------------------------------------------------


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[tuple[Any, Clock]]:
    engine = create_engine(migrated_sqlite(f"sqlite+aiosqlite:///{tmp_path}/weir.db"))
    clock = Clock()
    ctx = AdminContext(
        sessions=sessionmaker(engine),
        state=MemoryState(),
        token_digest=token_digest(ADMIN),
        throttle=FailureThrottle(N, clock),
    )
    app = Litestar(route_handlers=[admin_router(ctx)])

    async def get(token: str, address: str = "203.0.113.7") -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(address, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://weir") as client:
            return await client.get("/admin/api/v1/tenants", headers={"authorization": f"Bearer {token}"})

    yield get, clock
    await engine.dispose()


async def test_wrong_admin_tokens_are_throttled_per_address(admin: tuple[Any, Clock]) -> None:
    get, clock = admin
    assert (await get(ADMIN)).status_code == 200
    for i in range(N):
        response = await get(f"{ADMIN}{i}")
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_admin_token"
    wait = _assert_throttled(await get("wrong-again"))
    # The right token too: a guesser must not learn which guess was right while throttled.
    _assert_throttled(await get(ADMIN))
    # Another address is not affected.
    assert (await get(ADMIN, address="198.51.100.9")).status_code == 200
    assert (await get("wrong", address="198.51.100.9")).status_code == 401
    # The window recovers.
    clock.now += wait
    assert (await get(ADMIN)).status_code == 200


# --- across replicas sharing Redis -----------------------------------------------------------------

SHARED_CONFIG = f"""\
backends:
  - {{name: openai, type: openai, base_url: "http://127.0.0.1:9", api_key: "unused"}}
models:
  - {{name: model-a, backend: openai, model: gpt-4o-mini}}
tenants:
  - {{name: config-tenant, api_keys: ["{CONFIG_KEY}"]}}
database_url: "${{DB_URL}}"
redis_url: "${{REDIS_URL}}"
server: {{auth_failures_per_minute: {N}, admin_auth_failures_per_minute: {N}}}
"""


@pytest.fixture
def two_replicas(
    tmp_path: Path,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[str]]:
    """Two gateways (uvicorn: an X-Forwarded-For from 127.0.0.1 names the client) on one admin DB
    and one Redis."""
    db_url = migrated_sqlite(f"sqlite+aiosqlite:///{tmp_path}/weir.db")
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    monkeypatch.delenv("WEIR_DATABASE_URL", raising=False)
    monkeypatch.delenv("WEIR_REDIS_URL", raising=False)
    with ExitStack() as up:
        urls = []
        for i in range(2):
            monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / f"spool-{i}"))
            config = parse_config(SHARED_CONFIG, {"DB_URL": db_url, "REDIS_URL": REDIS_URL})
            urls.append(up.enter_context(serve(create_app(config), free_port())))
        yield urls


def _get(url: str, path: str, token: str, address: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}", "x-forwarded-for": address}
    return httpx.get(f"{url}{path}", headers=headers, timeout=10)


@pytest.mark.redis
def test_replicas_sharing_redis_share_one_allowance_per_address(two_replicas: list[str]) -> None:
    """Each replica counted an address's failures on its own: with R replicas it got R x the
    allowance. With Redis every replica counts against one bucket per address."""
    here, there = "203.0.113.7", "198.51.100.9"
    for i in range(N):  # the allowance, spread over both replicas
        response = _get(two_replicas[i % 2], "/v1/models", f"wk-guess-{i}", here)
        assert response.status_code == 401, response.text
    for url in two_replicas:
        _assert_throttled(_get(url, "/v1/models", "wk-guess-again", here))
        assert _get(url, "/v1/models", CONFIG_KEY, here).status_code == 200  # known keys still work
    assert _get(two_replicas[1], "/v1/models", "wk-guess", there).status_code == 401  # per address
    # Admin tokens likewise, in a bucket of their own.
    assert _get(two_replicas[0], "/admin/api/v1/tenants", ADMIN, here).status_code == 200
    for i in range(N):
        assert _get(two_replicas[i % 2], "/admin/api/v1/tenants", f"wrong-{i}", here).status_code == 401
    for url in two_replicas:
        _assert_throttled(_get(url, "/admin/api/v1/tenants", ADMIN, here))
    assert _get(two_replicas[1], "/admin/api/v1/tenants", ADMIN, there).status_code == 200


@pytest.mark.redis
async def test_a_shared_throttle_counts_per_replica_while_redis_is_away(
    redis_prefix: str,
) -> None:
    proxy = TcpProxy(REDIS_PORT)
    await proxy.start()
    state = DegradableState(
        RedisState(aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0"), prefix=redis_prefix), retry_s=0.02
    )
    limiter = SharedFailureThrottle(N, state, "api")
    try:
        await limiter.failed("203.0.113.7")
        await proxy.stop()
        for _ in range(N):  # from a full bucket in the process (what Redis held is not known there)
            assert await limiter.retry_after("203.0.113.7") is None
            await limiter.failed("203.0.113.7")
        assert state.degraded
        assert await limiter.retry_after("203.0.113.7") is not None
    finally:
        await state.close()
        await proxy.stop()
