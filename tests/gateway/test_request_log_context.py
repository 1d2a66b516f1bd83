"""An operator ties every line the gateway logs while serving a request to that request's `request`
line: each carries its `request_id` (the one the client got in `x-request-id`, its own included), and
its `tenant` and `model` once known. A task the request left behind logs without them once the
request is over; a comparison's background call logs with its own id, as its ledger row has it."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
import structlog

from gateway.logging import stdlib_handler
from gateway.metrics import Metrics
from gateway.middleware import request_middleware
from gateway.state.degradable import DegradableState
from gateway.state.memory import MemoryState
from gateway.stream_slots import RedisSlots
from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fixtures.db import REDIS_URL
from tests.fixtures.net import free_port
from tests.fixtures.vendor_gateway import RunningGateway
from tests.gateway.request_logs import logged, tagged_logs

SAY = [{"role": "user", "content": "one two three four five six"}]


def test_an_upstream_break_is_logged_with_the_request_id_the_client_got(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.reset())
    with tagged_logs() as logs:
        with pytest.raises(openai.APIStatusError) as caught:
            gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=SAY)
        line = logged(logs, "upstream_request_broken")
    request_id = caught.value.response.headers["x-request-id"]
    assert len(request_id) == 32
    assert (line["request_id"], line["tenant"], line["model"]) == (request_id, "demo", "gpt-4o-mini")
    assert logged(logs, "request")["request_id"] == request_id


def test_a_stream_cut_mid_way_is_logged_with_the_clients_own_request_id(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.fail_next(Fault.cut_stream(after=5))
    with tagged_logs() as logs:
        raw = gateway.openai().chat.completions.with_raw_response.create(
            model="claude-sonnet", messages=SAY, stream=True, extra_headers={"x-request-id": "trace-cut-7"}
        )
        with pytest.raises(openai.APIError):
            list(raw.parse())
        line = logged(logs, "upstream_stream_broken")
    assert raw.headers["x-request-id"] == "trace-cut-7"
    assert (line["request_id"], line["tenant"], line["model"], line["backend"]) == (
        "trace-cut-7",
        "demo",
        "claude-sonnet",
        "anthropic",
    )


def test_requests_that_share_a_clients_request_id_are_told_apart_in_the_log(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A client may send one x-request-id on many requests (a retry of its own, a trace id): each
    request's lines carry the gateway's own `exchange_id` too, the one its ledger rows have, so an
    operator can tell whose the upstream break is. A request the gateway named has none."""
    shared = {"x-request-id": "trace-shared-3"}
    fake_openai.fail_next(Fault.reset())
    with tagged_logs() as logs:
        with pytest.raises(openai.APIStatusError):
            gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=SAY, extra_headers=shared)
        broken = logged(logs, "upstream_request_broken")
    with tagged_logs() as again:
        gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=SAY, extra_headers=shared)
        answered = logged(again, "request")
    failed = logged(logs, "request")
    assert failed["request_id"] == answered["request_id"] == broken["request_id"] == "trace-shared-3"
    exchanges = {failed["exchange_id"], answered["exchange_id"]}
    assert None not in exchanges and len(exchanges) == 2
    assert broken["exchange_id"] == failed["exchange_id"]
    ledger = {e.status: e.exchange_id for e in gateway.sink.events if e.request_id == "trace-shared-3"}
    assert ledger == {0: failed["exchange_id"], 200: answered["exchange_id"]}
    with tagged_logs() as own:
        gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=SAY)
        assert logged(own, "request")["exchange_id"] is None


def test_a_line_outside_any_request_names_none() -> None:
    """A health probe's or a poller's line belongs to no request."""
    log = structlog.get_logger("weir.test")
    with tagged_logs() as logs:
        log.info("outside_any_request")
    assert logs == [{"event": "outside_any_request", "log_level": "info"}]


async def test_a_task_the_request_left_behind_is_not_tagged_once_it_is_over() -> None:
    """A loop some request happened to start (a prober, a cache refresh) runs on in that request's
    context: its lines name the request only while the request is being served."""
    log = structlog.get_logger("weir.test")
    logged_during = asyncio.Event()
    request_over = asyncio.Event()
    left_behind: list[asyncio.Task[None]] = []

    async def loop_started_by_a_request() -> None:
        log.info("while_serving")
        logged_during.set()
        await request_over.wait()
        log.info("after_the_request")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        left_behind.append(asyncio.create_task(loop_started_by_a_request()))
        await logged_during.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    middleware = request_middleware(Metrics())(app)
    scope: dict[str, Any] = {
        "type": "http",
        "method": "GET",
        "path": "/v1/models",
        "headers": [(b"x-request-id", b"trace-left-1")],
    }
    with tagged_logs() as logs:
        await middleware(scope, receive, send)
        request_over.set()
        await left_behind[0]
    by_event = {e["event"]: e for e in logs}
    assert by_event["while_serving"]["request_id"] == "trace-left-1"
    assert by_event["request"]["request_id"] == "trace-left-1"
    assert "request_id" not in by_event["after_the_request"]
    assert dict(sent[0]["headers"])[b"x-request-id"] == b"trace-left-1"


class _Redis(MemoryState):
    """A shared state that is unreachable until told otherwise."""

    down = True

    async def kv_get(self, key: str) -> bytes | None:
        if self.down:
            raise OSError("connection refused")
        return await super().kv_get(key)


async def test_a_prober_a_request_started_logs_without_its_request_id_as_json() -> None:
    """A request meets a Redis outage: its line (the standard library's logging, rendered as the
    same JSON) names it; the prober it started runs in no request's context, so its line, written
    while that request is still being served, does not."""
    redis = _Redis()
    state = DegradableState(redis, retry_s=0.001)
    lines = io.StringIO()
    stdlib_log = logging.getLogger("gateway.state.degradable")
    handler = stdlib_handler(lines)
    stdlib_log.addHandler(handler)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await state.kv_get("k")  # Redis is away: the fallback answers, a prober starts
        redis.down = False
        assert state._prober is not None
        await state._prober  # it hears from Redis while this request is still served
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    try:
        await serve_one(app, b"trace-probe-1")
    finally:
        stdlib_log.removeHandler(handler)
    away, back = (json.loads(line) for line in lines.getvalue().splitlines())
    assert away["event"].startswith("Redis unreachable (OSError('connection refused'))")
    assert (away["request_id"], away["level"], away["logger"]) == (
        "trace-probe-1",
        "warning",
        "gateway.state.degradable",
    )
    assert away["timestamp"].endswith("Z")
    assert back["event"].startswith("Redis reachable again") and "request_id" not in back


async def serve_one(app: Any, request_id: bytes) -> None:
    """`app` serves one request, with the client's own `request_id`, behind the request middleware."""

    async def send(message: dict[str, Any]) -> None:
        pass

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    scope: dict[str, Any] = {
        "type": "http",
        "method": "GET",
        "path": "/v1/models",
        "headers": [(b"x-request-id", request_id)],
    }
    await request_middleware(Metrics())(app)(scope, receive, send)


@pytest.mark.redis
async def test_the_stream_slots_prober_a_request_started_logs_without_its_request_id() -> None:
    slots = RedisSlots(aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0"), retry_s=0.001)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert await slots.acquire("acme", 1) is not None  # counted here: nothing listens there
        slots.client = aioredis.from_url(REDIS_URL)  # Redis is back
        assert slots._prober is not None
        await slots._prober  # it hears from Redis while this request is still served
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    with tagged_logs() as logs:
        await serve_one(app, b"trace-slots-1")
    by_event = {e["event"]: e for e in logs}
    assert by_event["stream_slots_degraded"]["request_id"] == "trace-slots-1"
    assert "request_id" not in by_event["stream_slots_recovered"]
    await slots.client.aclose()


def test_a_model_name_of_any_size_is_logged_bounded(gateway: RunningGateway) -> None:
    """The model name is the client's own text until a route or model takes it: a body of megabytes
    (`max_body_bytes`) could put all of it on the request's log line, one line a log shipper splits
    (Docker's at 16 KiB) or drops. Logged to its first 200 characters, saying how long it was."""
    asked = "x" * 100_000
    with tagged_logs() as logs:
        with pytest.raises(openai.NotFoundError):
            gateway.openai().chat.completions.create(model=asked, messages=SAY)
        line = logged(logs, "request")
    assert line["status"] == 404
    assert line["model"].startswith("x" * 200) and len(line["model"]) < 300
    assert "100000" in line["model"]
