"""A Redis that hangs (accepts connections, never answers) rather than refusing them.

A refused connection fails at once; a hang costs whatever timeout the caller set, on every call. A
request touches the shared state several times (stream slot, budget seed, rate limits and budget,
breaker and hedge bookkeeping): the gateway must notice the hang once and then answer from its
in-process state, not make each request wait out a timeout again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.app import create_app
from gateway.config import parse_config
from tests.conftest import free_port
from tests.control.conftest import REDIS_URL
from tests.control.test_gateway_control import ADMIN, Weir
from tests.fakes import FakeOpenAI
from tests.gateway.conftest import serve

pytestmark = pytest.mark.redis

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, cached_input: 0.075, output: 0.60}}
database_url: "${DB_URL}"
limits: {max_concurrent_streams: 4}
"""
RETRY_S = 0.05


class HangingRedis:
    """127.0.0.1:<port> -> Redis, until `hang()`: from then on every connection, open or new, is
    kept open and never answered (what a stalled or partitioned Redis looks like to its clients)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.hanging = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(5)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._handle, "127.0.0.1", 0)

    def hang(self) -> None:
        self.hanging = True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.hanging:
            with contextlib.suppress(Exception):
                while await reader.read(65536):
                    pass  # read and dropped: the client waits for replies that never come
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if not self.hanging:
                        dst.write(data)
                        await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def hanging_redis() -> Iterator[HangingRedis]:
    port = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
    redis = HangingRedis(("127.0.0.1", port))
    yield redis
    redis.close()


@pytest.fixture
def weir(
    fake_openai: FakeOpenAI,
    tmp_path: Path,
    redis_prefix: str,
    hanging_redis: HangingRedis,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Weir]:
    db_url = f"sqlite+aiosqlite:///{tmp_path}/weir.db"
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("WEIR_REDIS_URL", f"redis://127.0.0.1:{hanging_redis.port}/0")
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": db_url}
    app = create_app(parse_config(CONFIG, env))
    # Redis is asked again every 50 ms, not every second: the requests below span many such
    # periods, and none of them may be the one that waits for a hanging Redis again.
    app.state.control.state.retry_s = RETRY_S
    app.state.gateway.limits.shared.retry_s = RETRY_S
    with serve(app, free_port()) as url:
        yield Weir(url, db_url)


def _timed(client: openai.OpenAI, stream: bool) -> float:
    started = time.monotonic()
    if stream:
        chunks = client.chat.completions.create(model="gpt-4o-mini", messages=HI, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=HI)
        assert reply.choices[0].message.content
    return time.monotonic() - started


def test_a_hanging_redis_costs_one_timeout_not_one_per_call(weir: Weir, hanging_redis: HangingRedis) -> None:
    """Once Redis hangs, a tenant with rate limits, a budget and a stream limit keeps being answered;
    the requests together wait out about one timeout (noticing the hang), not one per shared-state
    call of every request, for as long as the hang lasts."""
    # Limits too small for leases (a replica's share of them, admitted without a round trip): every
    # request is admitted by the shared state itself.
    _, _, key = weir.tenant_with_key("through-a-hang", rpm=50, budget_usd_monthly="0.05")
    client = weir.client(key)
    assert _timed(client, stream=True) < 1.0  # Redis answers: no timeout anywhere

    hanging_redis.hang()
    took = []
    for i in range(8):
        took.append(_timed(client, stream=i % 2 == 0))
        time.sleep(2 * RETRY_S)  # each request comes after the time to ask Redis again
    print("seconds per request against a hanging Redis:", [round(t, 2) for t in took])
    # Every request after the first two (which may each notice the hang: one for the stream slots,
    # one for the limits and budgets) is answered from this process's state at once.
    assert max(took[2:]) < 0.5, took
    assert sum(took) < 3.5, took
