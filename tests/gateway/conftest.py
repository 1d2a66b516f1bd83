"""A real `weir` gateway (create_app served by uvicorn on 127.0.0.1) in front of the fake vendors.

The config is the issue's example, verbatim, with the vendors' URLs and keys from the environment,
plus a few models and tenants the tests need.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import Config, parse_config
from gateway.usage_sink import ListSink
from tests.conftest import free_port
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fakes.compat import OLLAMA_CALLS, SGLANG_CALLS, compat_server
from tests.fakes.plugin import FakeVendors

EXAMPLE = """\
backends:
  - name: openai
    type: openai                      # also serves any OpenAI-compatible server
    base_url: ${OPENAI_BASE_URL:-https://api.openai.com/v1}
    api_key: ${OPENAI_API_KEY}
  - name: anthropic
    type: anthropic
    base_url: ${ANTHROPIC_BASE_URL:-https://api.anthropic.com}
    api_key: ${ANTHROPIC_API_KEY}
  - name: gemini
    type: gemini
    base_url: ${GEMINI_BASE_URL:-https://generativelanguage.googleapis.com}
    api_key: ${GEMINI_API_KEY}
models:                               # public name -> backend and upstream model id; prices in USD per 1M tokens
  - {name: gpt-4o-mini, backend: openai, model: gpt-4o-mini, price: {input: 0.15, cached_input: 0.075, output: 0.60}}
  - {name: claude-sonnet, backend: anthropic, model: claude-sonnet-4-5, price: {input: 3.0, cached_input: 0.30, cache_write_5m: 3.75, cache_write_1h: 6.0, output: 15.0, web_search_per_1k: 10}}
  - {name: gemini-flash, backend: gemini, model: gemini-2.5-flash, price: {input: 0.30, cached_input: 0.03, output: 2.50}}
tenants:                              # seeds; keys come from the environment, never from the file
  - {name: demo, api_keys: ["${WEIR_DEMO_KEY}"]}
"""

# What the tests add to the example: more backends and models, and a tenant limited to one model.
EXTRA_BACKENDS = """\
  - name: deepseek
    type: openai
    base_url: ${DEEPSEEK_BASE_URL}
    api_key: ${DEEPSEEK_API_KEY}
    send_reasoning: true              # what api.deepseek.com gets by default
  - name: openai-impatient
    type: openai
    base_url: ${OPENAI_BASE_URL}
    api_key: ${OPENAI_API_KEY}
    timeouts: {first_byte: 0.5, read: 0.5}
  - name: dead
    type: openai
    base_url: http://127.0.0.1:${DEAD_PORT}/v1
    api_key: unused
"""
EXTRA_MODELS = """\
  - {name: gpt-5, backend: openai}
  - {name: gpt-4o-search-preview, backend: openai}
  - {name: gpt-instruct, backend: openai, model: gpt-3.5-turbo-instruct}
  - {name: text-embedding-3-small, backend: openai}
  - {name: gemini-embedding, backend: gemini, model: gemini-embedding-001}
  - {name: gemini-pro, backend: gemini, model: gemini-3-pro-preview}
  - {name: gemma, backend: gemini, model: gemma-3-27b-it}
  - {name: claude-opus-46, backend: anthropic, model: claude-opus-4-6}
  - {name: claude-opus-47, backend: anthropic, model: claude-opus-4-7}
  - {name: deepseek-chat, backend: deepseek}
  - {name: deepseek-reasoner, backend: deepseek}
  - {name: dead-model, backend: dead, model: gpt-4o-mini}
  - {name: impatient, backend: openai-impatient, model: gpt-4o-mini}
"""
EXTRA_TENANTS = """\
  - {name: limited, api_keys: ["${WEIR_LIMITED_KEY}"], models: [gemini-flash]}
server:
  max_body_bytes: 200000
"""

DEMO_KEY = "sk-weir-demo-0123456789"
LIMITED_KEY = "sk-weir-limited-0123456789"


def full_config_text() -> str:
    backends, rest = EXAMPLE.split("models:", 1)
    models, tenants = rest.split("tenants:", 1)
    return (
        backends + EXTRA_BACKENDS + "models:" + models + EXTRA_MODELS + "tenants:" + tenants + EXTRA_TENANTS
    )


@dataclass
class RunningGateway:
    url: str
    sink: ListSink
    config: Config
    app: object

    def openai(self, api_key: str = DEMO_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=20)

    def anthropic(self, api_key: str = DEMO_KEY) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=api_key, max_retries=0, timeout=20)


class _Server(uvicorn.Server):
    """uvicorn's server, stopping without its fixed waits: it looks at `should_exit` every 0.1 s and,
    stopping, sleeps 0.1 s for connections to close before it waits for them to. The suite stops a
    server for most of its tests, so those 0.2 s came to minutes; `stop()` wakes it at once instead."""

    loop: asyncio.AbstractEventLoop | None = None  # known once it runs: where its tasks are
    _wake: asyncio.Event | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        await super().serve(sockets)

    def stop(self) -> None:
        """Ask the server to exit, from any thread, and wake its main loop to see it."""
        self.should_exit = True
        loop, wake = self.loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed already: it has stopped
                loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        # uvicorn's loop, its 0.1 s sleep cut short by `stop()` (on_tick still refreshes the date header).
        assert self._wake is not None
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            # (asyncio.timeout, not wait_for: 3.11's wait_for runs the wait as a task of its own,
            # which tests that compare the loop's tasks before and after would see)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._wake.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn's shutdown, less its fixed 0.1 s sleep after asking connections to close: an idle
        # keep-alive one is gone a loop iteration later, and `_wait_tasks_to_complete` waits for a
        # busy one (a request still being answered) as it does anyway.
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        for _ in range(3):  # lets the closed transports' connection_lost callbacks run
            await asyncio.sleep(0)
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                await self._wait_tasks_to_complete()
        except TimeoutError:
            for task in self.server_state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()


@contextmanager
def serve(app: object, port: int) -> Iterator[str]:
    """Run an ASGI app with uvicorn on 127.0.0.1 in a background thread, and make sure it is gone after.

    A request still hanging at exit (a fake told to hang, a stream nobody read to the end) would keep
    uvicorn waiting for it for ever; the gateway would then live on behind the test, probing the
    session's fake vendors and failing later tests that count their requests. So lingering requests
    are cancelled after a grace period, and a server that still does not stop fails the test."""
    server = _Server(
        uvicorn.Config(
            app,  # type: ignore[arg-type]
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30  # a migrating start on a loaded 2-core machine takes seconds
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.stop()  # or a slow start would go on and serve behind the test
            thread.join(20)
            raise RuntimeError("the gateway did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        thread.join(20)
        if thread.is_alive():
            stuck = _stuck_at(server, thread)
            server.force_exit = True  # skips the app's shutdown; ending the loop cancels its tasks
            thread.join(10)
            raise RuntimeError(f"the gateway on port {port} did not stop within 20 s; waiting in:\n{stuck}")


def _stuck_at(server: uvicorn.Server, thread: threading.Thread) -> str:
    """Where a server that does not stop is waiting: its thread's stack and its event loop's tasks."""
    lines = ["".join(traceback.format_stack(sys._current_frames()[thread.ident]))] if thread.ident else []
    if isinstance(server, _Server) and server.loop is not None:
        for task in asyncio.all_tasks(server.loop):
            out = io.StringIO()
            task.print_stack(file=out)
            lines.append(out.getvalue())
    return "\n".join(lines)


def fakes_env(oa: FakeOpenAI, an: FakeAnthropic, ge: FakeGemini, ds: FakeOpenAI) -> dict[str, str]:
    return {
        "OPENAI_BASE_URL": oa.base_url,
        "OPENAI_API_KEY": oa.api_key,
        "ANTHROPIC_BASE_URL": an.base_url,
        "ANTHROPIC_API_KEY": an.api_key,
        "GEMINI_BASE_URL": ge.base_url,
        "GEMINI_API_KEY": ge.api_key,
        "DEEPSEEK_BASE_URL": ds.base_url,
        "DEEPSEEK_API_KEY": ds.api_key,
        "DEAD_PORT": str(free_port()),  # nothing listens there
        "WEIR_DEMO_KEY": DEMO_KEY,
        "WEIR_LIMITED_KEY": LIMITED_KEY,
    }


@contextmanager
def running_gateway(config: Config) -> Iterator[RunningGateway]:
    """A gateway on `config` on 127.0.0.1, its usage events in a list."""
    sink = ListSink()
    app = create_app(config, usage_sink=sink)
    with serve(app, free_port()) as url:
        yield RunningGateway(url=url, sink=sink, config=config, app=app)


@contextmanager
def gateway_on_fakes(
    config_text: str, vendors: FakeVendors, env: dict[str, str] | None = None
) -> Iterator[RunningGateway]:
    """A gateway on `config_text` with the fakes' URLs and keys (`fakes_env`) and `env` besides."""
    with running_gateway(parse_config(config_text, fakes_env(*vendors) | (env or {}))) as gateway:
        yield gateway


@pytest.fixture(scope="session")
def _running_gateway(fake_vendors: FakeVendors) -> Iterator[RunningGateway]:
    with gateway_on_fakes(full_config_text(), fake_vendors) as gateway:
        yield gateway


@pytest.fixture
def gateway(_running_gateway: RunningGateway, fresh_fakes: None) -> RunningGateway:
    """The gateway, with fresh fakes and an empty ledger."""
    _running_gateway.sink.events.clear()
    return _running_gateway


COMPAT_CONFIG = """
backends:
  - {{name: compat, type: openai, base_url: "{url}/v1", api_key: "k"}}
models:
  - {{name: mistral-small, backend: compat}}
  - {{name: vllm-reasoner, backend: compat}}
  - {{name: gpt-4o-audio-preview, backend: compat}}
  - {{name: cut-short, backend: compat}}
  - {{name: vllm-served, backend: compat}}
  - {{name: ollama-parallel, backend: compat}}
  - {{name: sglang-parallel, backend: compat}}
routes:
  - {{name: cut-then-mistral, candidates: [{{model: cut-short}}, {{model: mistral-small}}], probe_interval: null}}
  - {{name: cut-then-vllm, candidates: [{{model: cut-short}}, {{model: vllm-served}}], probe_interval: null}}
  - {{name: cut-then-sglang, candidates: [{{model: cut-short}}, {{model: sglang-parallel}}], probe_interval: null}}
tenants:
  - {{name: demo, api_keys: ["{key}"]}}
"""


@pytest.fixture(scope="module")
def compat_gateway() -> Iterator[RunningGateway]:
    """A gateway in front of `tests.fakes.compat`: OpenAI-compatible servers' own ways (each of its
    models as a plain model, and `cut-then-mistral` / `cut-then-vllm` / `cut-then-sglang`: a stream
    cut after "Hello", resumed on Mistral / vLLM / SGLang)."""
    with serve(compat_server, free_port()) as upstream:
        config = parse_config(COMPAT_CONFIG.format(url=upstream, key=DEMO_KEY), {})
        with running_gateway(config) as gateway:
            yield gateway


# The parallel calls each of `tests.fakes.compat`'s models streams all at index 0, as a client must
# get them: (id, name, arguments), an empty object where the server sent "" (none).
PARALLEL_CALLS: dict[str, list[tuple[str, str, str]]] = {
    "ollama-parallel": OLLAMA_CALLS,
    "sglang-parallel": [(id_, name, "".join(pieces) or "{}") for id_, name, pieces in SGLANG_CALLS],
}


# A short chat and a one-tool list, for tests of what each vendor is sent.
HI: Any = [{"role": "user", "content": "one two three"}]
LOOKUP: Any = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}
