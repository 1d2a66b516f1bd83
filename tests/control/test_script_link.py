"""The shared state's own Redis connection for script pipelines (`gateway.state.redis.ScriptLink`):
pipelines in flight together get their own replies, a cut or silent connection fails what waits on
it as redis-py would (so the state degrades to in-process limits), and the next call reconnects."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.state import redis as redis_state
from gateway.state.redis import RedisState, ScriptLink, client_from_url
from tests.control.helpers import TcpProxy
from tests.fixtures.db import REDIS_URL

pytestmark = pytest.mark.redis


async def test_pipelines_in_flight_together_get_their_own_replies(redis_prefix: str) -> None:
    state = RedisState(client_from_url(REDIS_URL), prefix=redis_prefix)
    calls = [
        state._pipeline([("SET", f"{redis_prefix}{i}", i), ("INCR", f"{redis_prefix}{i}"), ("HGET", "x")])
        for i in range(50)
    ]
    results = await asyncio.gather(*calls)
    for i, (ok, incremented, error) in enumerate(results):
        assert ok == b"OK" and incremented == i + 1 and isinstance(error, ResponseError)
    assert isinstance(state._link, ScriptLink)  # all on the state's own connection
    await state.close()


async def test_a_cut_connection_fails_what_waits_and_the_next_call_reconnects(redis_prefix: str) -> None:
    proxy = TcpProxy(6379)
    await proxy.start()
    state = RedisState(client_from_url(f"redis://127.0.0.1:{proxy.port}/0"), prefix=redis_prefix)
    try:
        assert await state._pipeline([("SET", f"{redis_prefix}k", "a")]) == [b"OK"]
        waiting = asyncio.ensure_future(state._pipeline([("BLPOP", f"{redis_prefix}none", "5")]))
        await asyncio.sleep(0.1)
        await proxy.stop()
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(waiting, 2)
        with pytest.raises(RedisConnectionError):  # refused while the proxy is down
            await state._pipeline([("GET", f"{redis_prefix}k")])
        await proxy.start()
        assert await state._pipeline([("GET", f"{redis_prefix}k")]) == [b"a"]
    finally:
        await state.close()
        await proxy.stop()


async def test_a_silent_connection_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_state, "LINK_TIMEOUT_S", 0.2)
    accepted: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, says nothing

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    state = RedisState(client_from_url(f"redis://127.0.0.1:{port}/0"))
    try:
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await state._pipeline([("GET", "k")])
        assert time.monotonic() - started < 2
        assert state._link is not None and state._link.closed
    finally:
        await state.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_the_link_uses_the_urls_database(redis_prefix: str) -> None:
    state = RedisState(client_from_url(REDIS_URL.rsplit("/", 1)[0] + "/3"), prefix=redis_prefix)
    other = aioredis.from_url(REDIS_URL.rsplit("/", 1)[0] + "/3")
    try:
        await state._pipeline([("SET", f"{redis_prefix}db3", "x", "PX", 10_000)])
        assert await other.get(f"{redis_prefix}db3") == b"x"
    finally:
        await other.delete(f"{redis_prefix}db3")
        await other.aclose()
        await state.close()
