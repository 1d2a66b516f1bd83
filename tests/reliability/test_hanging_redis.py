"""A Redis that hangs (accepts connections, never answers) rather than refusing them.

A refused connection fails at once; a hang costs whatever timeout the caller set, on every call. A
request touches the shared state several times (stream slot, budget seed, rate limits and budget,
breaker and hedge bookkeeping): the gateway must notice the hang once and then answer from its
in-process state, not make each request wait out a timeout again. A gateway started during a hang
must not wait for it either, and must hear other replicas' key revocations once Redis answers; one
stopped during a hang must not wait for it, nor lose the usage events Redis did not take.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from gateway.accounting.queue import RedisStreamQueue, SpoolQueue
from gateway.accounting.writer import BatchWriter
from gateway.admin.keys import key_digest
from gateway.app import create_app
from gateway.config import parse_config
from gateway.db import migrate
from gateway.db.models import ApiKey, utcnow
from gateway.db.session import create_engine, sessionmaker
from gateway.state.redis import RedisState, client_from_url
from tests.control.events import numbered_event
from tests.control.helpers import TcpProxy
from tests.fakes import FakeOpenAI
from tests.fixtures.db import REDIS_PORT, REDIS_URL
from tests.fixtures.gateway import ADMIN, Weir
from tests.fixtures.gateway import CONFIG as GATEWAY_CONFIG
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.reliability.proxy import ThreadedProxy

pytestmark = pytest.mark.redis

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
CONFIG = GATEWAY_CONFIG + "limits: {max_concurrent_streams: 4}\n"  # the shared gateway's, and a limit
RETRY_S = 0.05


class HangingRedis(TcpProxy):
    """127.0.0.1:<port> -> Redis, until `hang()`: from then on every connection, open or new, is
    kept open and never answered (what a stalled or partitioned Redis looks like to its clients)."""

    hanging = False

    def hang(self) -> None:
        self.hanging = True

    def answer(self) -> None:
        """Redis answers again, on connections made from now on (one that hung stays hung)."""
        self.hanging = False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.hanging:
            await super()._handle(reader, writer)
            return
        self._writers.add(writer)  # cut by stop(), as the relayed ones are
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass  # read and dropped: the client waits for replies that never come
        writer.close()
        self._writers.discard(writer)

    async def forward(self, data: bytes, dst: asyncio.StreamWriter, upstream: bool) -> None:
        if not self.hanging:
            await super().forward(data, dst, upstream)


@pytest.fixture
def hanging_redis() -> Iterator[HangingRedis]:
    redis = HangingRedis(REDIS_PORT)
    proxy = ThreadedProxy(redis)
    yield redis
    proxy.close()


@pytest.fixture
def gateway_app(
    fake_openai: FakeOpenAI,
    tmp_path: Path,
    redis_prefix: str,
    hanging_redis: HangingRedis,
    monkeypatch: pytest.MonkeyPatch,
) -> Any:
    """A gateway (not started) whose Redis is `hanging_redis`, its admin DB at tmp_path/weir.db."""
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("WEIR_REDIS_URL", f"redis://127.0.0.1:{hanging_redis.port}/0")
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    app = _app(fake_openai, tmp_path)
    # Redis is asked again every 50 ms, not every second: the requests below span many such
    # periods, and none of them may be the one that waits for a hanging Redis again.
    app.state.control.state.retry_s = RETRY_S
    app.state.gateway.limits.shared.retry_s = RETRY_S
    return app


def _app(fake_openai: FakeOpenAI, tmp_path: Path) -> Any:
    env = {
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "DB_URL": _db(tmp_path),
    }
    return create_app(parse_config(CONFIG, env))


def _db(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path}/weir.db"


@pytest.fixture
def weir(gateway_app: Any, tmp_path: Path) -> Iterator[Weir]:
    with serve(gateway_app, free_port()) as url:
        yield Weir(url, _db(tmp_path))


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
    # Every request after the first (which notices the hang, for its stream slot and its limits and
    # budget alike) is answered from this process's state at once.
    assert max(took[1:]) < 0.5, took
    assert sum(took) < 3.5, took


def test_a_stream_that_meets_a_hang_waits_out_one_timeout_not_two(
    weir: Weir, gateway_app: Any, hanging_redis: HangingRedis
) -> None:
    """The first request of a hang is a stream: its stream slot (counted across replicas in Redis)
    meets the hang first and waits out its timeout, then its rate limits and budget (in Redis too)
    waited out theirs as well. The slots now tell the limits' state: one timeout. Both are 2 s here,
    so one reads apart from two on a loaded machine."""
    gateway_app.state.control.state.timeout_s = 2.0
    gateway_app.state.gateway.limits.shared.timeout_s = 2.0
    _, _, key = weir.tenant_with_key("stream-in-a-hang", rpm=50, budget_usd_monthly="0.05")
    client = weir.client(key)
    assert _timed(client, stream=True) < 1.0
    time.sleep(0.5)  # its settlement reaches Redis first (in the background), not met by the hang
    hanging_redis.hang()
    took = _timed(client, stream=True)
    print(f"a stream meeting the hang took {took:.2f} s")
    assert took < 3.0, f"{took:.2f} s: the stream waited out the slots' timeout and the limits' too"
    assert _timed(client, stream=True) < 0.5


def test_a_gateway_started_while_redis_hangs_serves_and_hears_revocations_once_it_answers(
    gateway_app: Any, hanging_redis: HangingRedis, redis_prefix: str, tmp_path: Path
) -> None:
    """Redis hangs when the gateway starts. Its start subscribed to key revocations in Redis first,
    and waited out redis-py's 5 s socket timeout; then it never subscribed at all, so another
    replica's revocation reached it only when the key's cache entry lapsed. Now the start does not
    wait, the gateway serves, and once Redis answers the subscription is made: a key another replica
    revokes is refused here at once."""
    asyncio.run(migrate.upgrade_async(_db(tmp_path)))  # what the start then does is quick: timed
    hanging_redis.hang()
    started = time.monotonic()
    with serve(gateway_app, free_port()) as url:
        assert time.monotonic() - started < 3.0, "the start waited on the hanging Redis"
        weir = Weir(url, _db(tmp_path))
        _, key_id, key = weir.tenant_with_key("revoked-elsewhere")
        client = weir.client(key)
        assert _timed(client, stream=False) < 3.0  # served (from this process's state)

        hanging_redis.answer()
        with redis.Redis.from_url(REDIS_URL) as plain:
            channel = f"{redis_prefix}revocations"
            deadline = time.monotonic() + 10
            while plain.pubsub_numsub(channel)[0][1] < 1:
                assert time.monotonic() < deadline, "never subscribed to revocations once Redis answered"
                time.sleep(0.05)
        asyncio.run(_revoke_on_another_replica(_db(tmp_path), redis_prefix, key_id, key))
        # The message reaches the gateway's listener a moment after PUBLISH returns; without the
        # subscription only the key cache's 30 s TTL would end the key here.
        deadline = time.monotonic() + 3
        while True:
            try:
                client.chat.completions.create(model="gpt-4o-mini", messages=HI)
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, "the revocation was not heard"
            time.sleep(0.05)


def test_a_gateway_stops_at_once_while_redis_hangs_and_its_usage_reaches_the_ledger_later(
    gateway_app: Any, hanging_redis: HangingRedis, fake_openai: FakeOpenAI, tmp_path: Path
) -> None:
    """Redis hangs while a gateway serves and then stops. Its shutdown waited on Redis step after
    step: the usage writer's last read (redis-py's 5 s socket timeout), then the usage queue's last
    XADD (2 s), about 7 s in all. A Redis known to be away is not asked at shutdown any more. The
    request's usage event is not lost: it waits in the local spool, and the next start forwards it
    to the stream, from where it reaches the ledger."""
    hanging_redis.hang()
    with serve(gateway_app, free_port()) as url:
        weir = Weir(url, _db(tmp_path))
        tenant_id, _, key = weir.tenant_with_key("stopped-in-a-hang", rpm=50)
        assert _timed(weir.client(key), stream=False) < 3.0
        stopping = time.monotonic()
    took = time.monotonic() - stopping
    print(f"stopped in {took:.2f} s while Redis hung")
    assert took < 2.0, f"{took:.2f} s: the shutdown waited on the hanging Redis"

    spool = SpoolQueue(tmp_path / "spool" / "0")
    try:
        spooled = asyncio.run(spool.read(100, 0))
    finally:
        asyncio.run(spool.close())
    assert [event.tenant_id for _, event in spooled] == [tenant_id]

    hanging_redis.answer()
    with serve(_app(fake_openai, tmp_path), free_port()) as url:
        rows = Weir(url, _db(tmp_path)).ledger(tenant_id, 1)
    assert [status for *_, status, _key in rows] == [200]


async def test_a_usage_queue_without_the_shared_state_stops_at_once_once_it_met_a_hang(
    hanging_redis: HangingRedis, redis_prefix: str, tmp_path: Path
) -> None:
    """A usage queue built without the shared state (which tells it of a hang the limits met) knew of
    one only from its pump's XADD: its writer's read that met the hang told nobody, so the shutdown
    asked Redis twice more, the writer's last read and the queue's last XADD, a timeout each. What
    any of the queue's own calls finds counts now: the shutdown waits for neither, and the event
    Redis did not take waits in the spool."""
    timeout_s = 0.5
    client = client_from_url(f"redis://127.0.0.1:{hanging_redis.port}/0")
    spool = SpoolQueue(tmp_path / "spool")
    # A flush window longer than the test: the event is still buffered when the queue closes.
    queue = RedisStreamQueue(
        client, prefix=redis_prefix, flush_interval_s=30.0, spool=spool, timeout_s=timeout_s
    )
    engine = create_engine(_db(tmp_path))
    writer = BatchWriter(queue, engine)
    try:
        assert await queue.read_lines(10, 0) == []  # Redis answers (the consumer group is made)
        hanging_redis.hang()
        with pytest.raises(TimeoutError):
            await queue.read_lines(10, 0)  # the writer's read meets the hang
        queue.put(numbered_event(1))
        stopping = time.monotonic()
        await writer.stop()
        await queue.close()
        took = time.monotonic() - stopping
    finally:
        await engine.dispose()
    print(f"stopped in {took:.3f} s while Redis hung")
    assert took < timeout_s / 2, f"{took:.2f} s: the shutdown waited on the hanging Redis"
    left = SpoolQueue(tmp_path / "spool")
    assert [e.request_id for _, e in await left.read(10, 0)] == ["r1"]
    await left.close()


async def _revoke_on_another_replica(db_url: str, prefix: str, key_id: str, key: str) -> None:
    """What `DELETE /admin/api/v1/keys/{id}` does on another replica: revoke the key in the admin
    DB, then publish the revocation in Redis."""
    engine = create_engine(db_url)
    try:
        async with sessionmaker(engine)() as session, session.begin():
            row = await session.get(ApiKey, key_id)
            assert row is not None
            row.revoked_at = utcnow()
    finally:
        await engine.dispose()
    state = RedisState.from_url(REDIS_URL, prefix=prefix)
    try:
        await state.publish_revocation(key_digest(key))
    finally:
        await state.close()
