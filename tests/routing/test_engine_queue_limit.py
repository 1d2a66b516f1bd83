"""`weir engine serve --max-queued N`: the engine refuses work that would wait behind a full batch and
more than N queued sequences with a 429 (`engine_overloaded`, retry-after 1), and a Weir route in
front of it answers such a request from its next candidate at once: no wait in place, no breaker
opened against an engine that is only busy. The real engine server runs the tiny random Llama."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import openai
import pytest

from gateway.config import ConfigError, parse_config
from gateway.engine_supervisor import EngineProcess
from tests.fakes import FakeOpenAI
from tests.fixtures.waiting import wait_for
from tests.routing.engine_candidate import (
    ECHO,
    HI,
    LONG,
    busy,
    config_text,
    engine_gateway,
    refused,
    tiny_engine,
)
from tests.routing.routed import route_header, settled


def engine_client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def test_a_full_engine_refuses_with_an_openai_shaped_429_and_serves_again_once_seats_free() -> None:
    """Two batch slots and one queue seat: three long streams fill them; a fourth request is refused
    at once (not queued behind them) with OpenAI's error shape, code `engine_overloaded` and
    retry-after, streamed or not; bad input is still a 400 about the input; once the streams end, the
    engine answers again."""
    with tiny_engine(max_num_seqs=2, max_queued=1) as (port, llm):
        client = engine_client(port)
        with busy(port, llm, 3):
            started = time.monotonic()
            with pytest.raises(openai.RateLimitError) as info:
                client.chat.completions.create(model="tiny", messages=HI, max_tokens=4)  # type: ignore[arg-type]
            assert time.monotonic() - started < 1.0
            error = info.value.body
            assert isinstance(error, dict) and error["code"] == "engine_overloaded"
            assert error["type"] == "rate_limit_error" and "overloaded" in error["message"]
            assert info.value.response.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):  # streamed: refused before any event
                client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, stream=True)  # type: ignore[arg-type]
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=-1)  # type: ignore[arg-type]
            assert refused(port) == 2
        reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4)  # type: ignore[arg-type]
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 4


def test_a_request_holds_a_seat_per_choice() -> None:
    """Three slots, no queue, two taken: an n=2 request needs two seats and is refused; a single one
    runs at once."""
    with tiny_engine(max_num_seqs=3, max_queued=0) as (port, llm), busy(port, llm, 2):
        client = engine_client(port)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, n=2)  # type: ignore[arg-type]
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=4)
        one = client.completions.create(model="tiny", prompt="hello", max_tokens=4)
        assert one.usage is not None and 1 <= one.usage.completion_tokens <= 4


def test_without_a_limit_requests_queue_instead_of_being_refused() -> None:
    """The default (no `--max-queued`) keeps vLLM's behaviour: everything queues."""
    with tiny_engine(max_num_seqs=1) as (port, llm), concurrent.futures.ThreadPoolExecutor(1) as pool:
        with busy(port, llm, 2):
            queued = pool.submit(
                engine_client(port).completions.create, model="tiny", prompt="hi", max_tokens=2, timeout=30
            )
            # Waiting behind the running stream and the queued one, not refused. The busy streams
            # are let go now rather than run to their end (400 slowed steps each, ~16 s).
            wait_for(lambda: llm.stats().num_waiting == 2 or queued.done(), timeout=10)
            assert not queued.done() and refused(port) == 0
        reply = queued.result(timeout=30)
        assert reply.choices[0].finish_reason == "length"
        assert refused(port) == 0


def test_a_route_answers_from_the_vendor_at_once_when_the_engine_is_full(fake_openai: FakeOpenAI) -> None:
    """Route `auto`: the engine, then the vendor. With the engine full, the request goes to the vendor
    without waiting the engine's retry-after in place (the route allows 2 tries per candidate here),
    the refused attempt is an event of its own, and the engine's breaker stays closed: once the
    engine has room, the next request is the engine's."""
    routes = (
        "  - {name: patient, candidates: [{model: small}], fallbacks: [gpt-4o-mini], "
        "retry: {attempts: 2, backoff: 0.02}, breaker: {failures: 1, cooldown: 30}, probe_interval: null}\n"
    )
    with (
        tiny_engine(max_num_seqs=1, max_queued=0) as (port, llm),
        engine_gateway(fake_openai, port, routes) as gateway,
    ):
        client = gateway.openai()
        with busy(port, llm, 1):
            for _ in range(3):
                started = time.monotonic()
                raw = client.chat.completions.with_raw_response.create(model="patient", messages=HI)  # type: ignore[arg-type]
                assert time.monotonic() - started < 0.9  # not the engine's retry-after of 1 s
                header = route_header(raw)
                assert header["candidate"] == "gpt-4o-mini"
                assert header["tried"] == "small:429,gpt-4o-mini:ok"
        settled(gateway, 6)
        statuses = sorted((e.backend, e.status) for e in gateway.sink.events)
        assert statuses == [("local", 429)] * 3 + [("vendor", 200)] * 3
        wait_for(lambda: not llm.has_unfinished_requests(), timeout=5)
        raw = client.chat.completions.with_raw_response.create(model="patient", messages=HI, max_tokens=4)  # type: ignore[arg-type]
        assert route_header(raw)["candidate"] == "small"  # breaker (failures: 1) never opened


def test_a_streamed_request_fails_over_invisibly_when_the_engine_is_full(fake_openai: FakeOpenAI) -> None:
    with (
        tiny_engine(max_num_seqs=1, max_queued=0) as (port, llm),
        engine_gateway(fake_openai, port) as gateway,
        busy(port, llm, 1),
    ):
        stream = gateway.openai().chat.completions.create(model="auto", messages=HI, stream=True)  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == ECHO


def test_seats_are_given_back_when_a_queued_client_leaves() -> None:
    """A request waiting for a batch slot whose client leaves frees its seat: the limit counts what
    the engine still holds, not what it once accepted."""
    with tiny_engine(max_num_seqs=1, max_queued=1) as (port, llm), busy(port, llm, 1):
        client = engine_client(port)

        async def leave_while_queued() -> None:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=30) as http:
                task = asyncio.create_task(http.post("/completions", json={**LONG, "stream": False}))
                wait = time.monotonic() + 5
                while llm.stats().num_waiting < 1 and time.monotonic() < wait:
                    await asyncio.sleep(0.02)
                with pytest.raises(openai.RateLimitError):  # the queue seat is the waiting one's
                    await asyncio.to_thread(
                        client.completions.create, model="tiny", prompt="hi", max_tokens=1
                    )
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(leave_while_queued())

        def seat_free() -> bool:
            try:
                client.completions.create(model="tiny", prompt="hi", max_tokens=1, timeout=0.5)
            except openai.RateLimitError:
                return False
            except openai.APITimeoutError:  # accepted, queued behind the busy stream
                return True
            return True

        wait_for(seat_free, timeout=5)


def test_a_supervised_engine_gets_its_backend_args(fake_openai: FakeOpenAI) -> None:
    """`args` reach the supervised `weir engine serve` command line after the model and port."""
    text = config_text('model: smollm2-135m, port: 8123, args: ["--max-queued", "16"]', fake_openai)
    backend = parse_config(text, {}).backends[0]
    command = EngineProcess(backend).command
    assert command[-8:] == [
        "--model",
        "smollm2-135m",
        "--port",
        "8123",
        "--log-format",
        "json",
        "--max-queued",
        "16",
    ]
    with pytest.raises(ConfigError):  # a typo in the list's type is a config error, not a crash later
        parse_config(config_text('model: smollm2-135m, args: "--max-queued 16"', fake_openai), {})
