"""The bundled engine as a route candidate, for the tests of engines behind routes: the real engine server
on the tiny random Llama in this process, its steps broken, slowed or its seats held on cue, and a
gateway with a route from it to the fake OpenAI."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from gateway.config import parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.vendor_gateway import RunningGateway, running_gateway
from tests.fixtures.waiting import wait_for

HI = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"  # the fake OpenAI's answer to HI: it echoes the prompt
# Fail over at once, and keep the engine's breaker closed through a test's few failures.
FAST = "retry: {attempts: 1}, breaker: {failures: 3, cooldown: 0.5}, probe_interval: null"
BS = {"66": 100}  # the tiny model's byte vocabulary: token 66 is "B", so the engine says "BBB..."
# A completion that lasts: it holds an engine seat until the client closes it.
LONG = {"model": "tiny", "prompt": "x" * 20, "max_tokens": 400, "ignore_eos": True, "stream": True}


def config_text(engine: str, vendor: FakeOpenAI, routes: str = "") -> str:
    """The engine backend (`engine`: its `url:`, or `model:`/`command:` for a supervised one) as
    `small`, the fake OpenAI as `gpt-4o-mini`, a route `auto` (engine first, the vendor as fallback)
    and a route `auto-no-resume` that forbids resuming a cut stream."""
    return f"""
backends:
  - {{name: local, type: engine, {engine}}}
  - {{name: vendor, type: openai, base_url: "{vendor.base_url}", api_key: "{vendor.api_key}"}}
models:
  - {{name: small, backend: local, model: tiny, price: {{input: 1.0, cached_input: 0.25, output: 2.0}}}}
  - {{name: gpt-4o-mini, backend: vendor, price: {{input: 0.15, output: 0.60}}}}
routes:
  - {{name: auto, candidates: [{{model: small}}], fallbacks: [gpt-4o-mini], {FAST}}}
  - {{name: auto-no-resume, resume: false, candidates: [{{model: small}}], fallbacks: [gpt-4o-mini], {FAST}}}
{routes}"""


@contextmanager
def tiny_engine(
    loading: bool = False,
    max_num_seqs: int = 64,
    max_queued: int | None = None,
    port: int | None = None,
    max_model_len: int | None = None,
) -> Iterator[tuple[int, Any]]:
    """The real engine server on the tiny random model, on its own event loop in a thread; yields its
    port and the LLMEngine (None while `loading`: the server answers as one still loading its model).
    `port`: that one (an engine started again where the last one was), else a free one."""
    from engine.async_engine import AsyncLLMEngine
    from engine.config import KNOWN_MODELS
    from engine.llm_engine import LLMEngine
    from engine.server import EngineServer, start_server

    port = port or free_port()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    llm = (
        None
        if loading
        else LLMEngine.from_config(
            KNOWN_MODELS["tiny"], num_kv_blocks=64, max_num_seqs=max_num_seqs, max_model_len=max_model_len
        )
    )
    server = EngineServer(
        AsyncLLMEngine(llm) if llm is not None else None, model_name="tiny", max_queued=max_queued
    )
    runner = asyncio.run_coroutine_threadsafe(start_server(server, "127.0.0.1", port), loop).result(30)
    try:
        yield port, llm
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextmanager
def engine_gateway(fake_openai: FakeOpenAI, port: int, routes: str = "") -> Iterator[RunningGateway]:
    text = config_text(f'url: "http://127.0.0.1:{port}"', fake_openai, routes)
    with running_gateway(parse_config(text, {})) as gateway:
        yield gateway


@contextmanager
def failing_steps(llm: Any, after: int) -> Iterator[None]:
    """The engine's loop dies at its step number `after + 1` (an engine bug, a device fault)."""
    real, calls = llm.step, [0]

    def step() -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("device fault")
        return real()

    llm.step = step
    try:
        yield
    finally:
        llm.step = real


@contextmanager
def slow_steps(llm: Any, seconds: float) -> Iterator[None]:
    """Every engine step takes `seconds` (a big model on a small CPU)."""
    real = llm.step

    def step() -> Any:
        time.sleep(seconds)
        return real()

    llm.step = step
    try:
        yield
    finally:
        llm.step = real


@contextmanager
def busy(port: int, llm: Any, streams: int) -> Iterator[None]:
    """`streams` long streamed completions held by the engine (running or queued; each holds its seat
    until it ends), every engine step slowed so they last; closed, and so aborted, on exit."""
    stop = threading.Event()

    def hold() -> None:
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=30) as http,
            http.stream("POST", "/completions", json=LONG) as resp,
        ):
            assert resp.status_code == 200
            stop.wait(30)

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(streams)]
    with slow_steps(llm, 0.02):
        for t in threads:
            t.start()
        wait_for(lambda: llm.stats().num_running + llm.stats().num_waiting == streams)
        try:
            yield
        finally:
            stop.set()
            for t in threads:
                t.join(10)
    wait_for(lambda: not llm.has_unfinished_requests(), timeout=5)


def refused(port: int) -> float:
    """How many requests the engine has refused as overloaded (its /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("weir_engine_requests_refused_total "))
    return float(line.split()[1])
