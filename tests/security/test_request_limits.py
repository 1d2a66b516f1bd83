"""Request limits per tenant: messages per request (400) and concurrent streams (429 with
retry-after), from the config's `limits:`, a config tenant's own, or an admin-DB tenant's; a stream
slot comes back when the stream ends, when the client walks away and when the upstream fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from gateway.app import create_app
from gateway.config import parse_config
from gateway.stream_slots import RedisSlots
from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.db import REDIS_URL
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.waiting import wait_for

CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai}
limits: {max_messages: 3, max_concurrent_streams: 2}
tenants:
  - {name: acme, api_keys: ["sk-acme"]}
  - {name: big, api_keys: ["sk-big"], max_concurrent_streams: 3, max_messages: 5}
"""
ADMIN = "admin-token-for-tests"


def body(messages: int = 1, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": f"say {i}"} for i in range(messages)],
        "stream": stream,
    }


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def gw(fake_openai: FakeOpenAI) -> Iterator[tuple[str, Any]]:
    config = parse_config(
        CONFIG, {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key}
    )
    app = create_app(config)
    with serve(app, free_port()) as url:
        yield url, app.state.gateway.limits


def open_stream(stack: ExitStack, client: httpx.Client, url: str, key: str) -> httpx.Response:
    response = stack.enter_context(
        client.stream("POST", f"{url}/v1/chat/completions", json=body(), headers=auth(key))
    )
    return response


def test_message_count_limits(gw: tuple[str, Any]) -> None:
    url, _ = gw
    ok = httpx.post(f"{url}/v1/chat/completions", json=body(3, stream=False), headers=auth("sk-acme"))
    assert ok.status_code == 200
    over = httpx.post(f"{url}/v1/chat/completions", json=body(4, stream=False), headers=auth("sk-acme"))
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["code"] == "too_many_messages" and error["param"] == "messages"
    assert error["type"] == "invalid_request_error" and "at most 3" in error["message"]
    # A tenant's own limit wins over the global one.
    assert httpx.post(f"{url}/v1/chat/completions", json=body(5), headers=auth("sk-big")).status_code == 200
    assert httpx.post(f"{url}/v1/chat/completions", json=body(6), headers=auth("sk-big")).status_code == 400
    # The Anthropic-shaped endpoint shares the check.
    messages = {"model": "gpt-4o-mini", "max_tokens": 16, **{"messages": body(4)["messages"]}}
    refused = httpx.post(f"{url}/v1/messages", json=messages, headers={"x-api-key": "sk-acme"})
    assert refused.status_code == 400 and "at most 3" in refused.text


def test_concurrent_streams_are_limited_and_always_released(
    gw: tuple[str, Any], fake_openai: FakeOpenAI
) -> None:
    url, limits = gw
    fake_openai.set_latency(per_token=0.5)  # streams that stay open for seconds
    with ExitStack() as stack, httpx.Client(timeout=20) as client:
        first = open_stream(stack, client, url, "sk-acme")
        second = open_stream(stack, client, url, "sk-acme")
        assert first.status_code == second.status_code == 200
        assert limits.streams == {"acme": 2}

        over = client.post(f"{url}/v1/chat/completions", json=body(), headers=auth("sk-acme"))
        assert over.status_code == 429
        assert over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == "concurrent_streams_exceeded"
        assert over.json()["error"]["type"] == "requests"
        completion = {"model": "gpt-4o-mini", "prompt": "say hi", "stream": True}
        over = client.post(f"{url}/v1/completions", json=completion, headers=auth("sk-acme"))
        assert over.status_code == 429  # every streaming endpoint shares the slots
        # Non-streaming calls and other tenants are not affected.
        fake_openai.set_latency()
        assert client.post(
            f"{url}/v1/chat/completions", json=body(stream=False), headers=auth("sk-acme")
        ).is_success
        assert client.post(f"{url}/v1/chat/completions", json=body(), headers=auth("sk-big")).is_success
        fake_openai.set_latency(per_token=0.5)

        # The client walks away mid-stream: its slot is free again.
        first.close()
        wait_for(lambda: limits.streams == {"acme": 1})
        third = open_stream(stack, client, url, "sk-acme")
        assert third.status_code == 200 and limits.streams == {"acme": 2}
        third.close()
        second.close()
        wait_for(lambda: limits.streams == {})

    fake_openai.set_latency()
    # A stream that the upstream refuses, and one that breaks after it started: no slot leaks.
    fake_openai.fail_next(500, times=3)
    failed = httpx.post(f"{url}/v1/chat/completions", json=body(), headers=auth("sk-acme"))
    assert failed.status_code >= 500
    fake_openai.reset()
    fake_openai.fail_next(Fault.stream_error(after=2))
    broken = httpx.post(f"{url}/v1/chat/completions", json=body(), headers=auth("sk-acme"))
    assert broken.status_code == 200 and '"error"' in broken.text
    # One finished normally as well.
    assert httpx.post(f"{url}/v1/chat/completions", json=body(), headers=auth("sk-acme")).status_code == 200
    wait_for(lambda: limits.streams == {})


def test_admin_db_tenant_limits(
    fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    config = parse_config(
        CONFIG + 'database_url: "${DB_URL}"\n',
        {
            "OPENAI_BASE_URL": fake_openai.base_url,
            "OPENAI_API_KEY": fake_openai.api_key,
            "DB_URL": f"sqlite+aiosqlite:///{tmp_path}/weir.db",
        },
    )
    app = create_app(config)
    with serve(app, free_port()) as url, httpx.Client(timeout=20) as client:
        admin = httpx.Client(base_url=f"{url}/admin/api/v1", headers=auth(ADMIN))
        tenant = admin.post("/tenants", json={"name": "db-tenant", "max_messages": 1}).json()
        assert tenant["max_messages"] == 1 and tenant["max_concurrent_streams"] is None
        key = admin.post(f"/tenants/{tenant['id']}/keys", json={}).json()["key"]
        assert client.post(f"{url}/v1/chat/completions", json=body(2), headers=auth(key)).status_code == 400
        # Unset on the tenant: the config's global limit (3) applies; then its own, changed live.
        patched = admin.patch(
            f"/tenants/{tenant['id']}", json={"max_messages": None, "max_concurrent_streams": 1}
        )
        assert patched.status_code == 200, patched.text
        assert client.post(f"{url}/v1/chat/completions", json=body(3), headers=auth(key)).status_code == 200
        fake_openai.set_latency(per_token=0.5)
        with ExitStack() as stack:
            assert open_stream(stack, client, url, key).status_code == 200
            assert (
                client.post(f"{url}/v1/chat/completions", json=body(), headers=auth(key)).status_code == 429
            )
        fake_openai.set_latency()
        wait_for(lambda: app.state.gateway.limits.streams == {})
        bad = admin.patch(f"/tenants/{tenant['id']}", json={"max_concurrent_streams": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_concurrent_streams"


@pytest.mark.redis
def test_stream_slots_are_shared_by_replicas_through_redis(
    fake_openai: FakeOpenAI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_prefix: str,
) -> None:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    env = {
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "DB_URL": f"sqlite+aiosqlite:///{tmp_path}/weir.db",
    }
    redis = Redis.from_url(REDIS_URL)
    key = f"{redis_prefix}streams:acme"
    fake_openai.set_latency(per_token=0.5)
    with ExitStack() as stack, httpx.Client(timeout=20) as client:
        urls = []
        for name in ("a", "b"):
            monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / f"spool-{name}"))
            config = parse_config(CONFIG + 'database_url: "${DB_URL}"\n', env)
            urls.append(stack.enter_context(serve(create_app(config), free_port())))
        a, b = urls
        first = open_stream(stack, client, a, "sk-acme")
        second = open_stream(stack, client, b, "sk-acme")
        assert first.status_code == second.status_code == 200
        assert redis.zcard(key) == 2
        for url in (a, b):  # the limit (2) holds across both replicas
            refused = client.post(f"{url}/v1/chat/completions", json=body(), headers=auth("sk-acme"))
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        first.close()
        wait_for(lambda: redis.zcard(key) == 1)
        assert open_stream(stack, client, b, "sk-acme").status_code == 200

    # A lease nobody refreshes (its replica died) stops counting after its TTL.
    fake_openai.set_latency()
    with serve(create_app(parse_config(CONFIG + 'database_url: "${DB_URL}"\n', env)), free_port()) as url:
        wait_for(lambda: redis.zcard(key) == 0)  # the streams above gave their leases back
        expiry = int(redis.time()[0] * 1000) + 2000
        redis.zadd(key, {"dead-replica-1": expiry, "dead-replica-2": expiry})
        refused = httpx.post(f"{url}/v1/chat/completions", json=body(), headers=auth("sk-acme"))
        assert refused.status_code == 429
        wait_for(lambda: redis.time()[0] * 1000 > expiry + 50)
        assert (
            httpx.post(f"{url}/v1/chat/completions", json=body(), headers=auth("sk-acme")).status_code == 200
        )
    redis.close()


async def test_stream_slots_count_locally_while_redis_is_away() -> None:
    slots = RedisSlots.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    first = await slots.acquire("acme", 1)
    assert first is not None and first.startswith("local:") and slots.degraded
    assert await slots.acquire("acme", 1) is None  # the limit still holds, per replica
    slots.release("acme", first)
    assert slots.local.streams == {}
    assert await slots.acquire("acme", 1) is not None
    await slots.close()


class StalledRedis:
    """Stream slots' client of a Redis that hangs: no script call (a lease given back) is answered."""

    def register_script(self, script: str) -> Callable[..., Awaitable[int]]:
        async def hangs(**kw: Any) -> int:
            await asyncio.Event().wait()
            return 0

        return hangs

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("away", [False, True])
async def test_a_lease_given_back_to_a_hanging_redis_does_not_hold_up_the_shutdown(away: bool) -> None:
    """A stream ended just before the gateway stopped, and Redis hangs: its lease's ZREM waited out
    the client's socket timeout (2 s) in the shutdown. It waits `timeout_s` at most now, and not at
    all once Redis is known to be away; the lease expires after `ttl_s` anyway."""
    slots = RedisSlots(StalledRedis(), timeout_s=0.3)  # type: ignore[arg-type]
    slots.held["lease"] = ("acme", slots.key("acme"))
    slots.degraded = away
    slots.release("acme", "lease")
    started = time.monotonic()
    await asyncio.wait_for(slots.close(), 5)
    took = time.monotonic() - started
    assert took < (0.1 if away else 1.0), took
