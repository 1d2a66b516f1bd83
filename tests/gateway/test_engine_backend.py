"""Backends of `type: engine`: a running engine by URL, or one Weir starts, supervises and stops."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from gateway.engine_supervisor import EngineProcess
from tests.conftest import free_port, wait_for
from tests.gateway.conftest import serve

FAKE_ENGINE = str(Path(__file__).with_name("fake_engine.py"))


def ready(url: str) -> bool:
    return httpx.get(f"{url}/readyz").status_code == 200


def test_supervised_engine_is_started_restarted_and_stopped() -> None:
    engine_port = free_port()
    config = parse_config(
        f"""
backends:
  - name: local
    type: engine
    model: smollm2-135m
    port: {engine_port}
    command: ["{sys.executable}", "{FAKE_ENGINE}", "{engine_port}"]
models:
  - {{name: small, backend: local, model: smollm2-135m}}
""",
        {},
    )
    app = create_app(config)
    with serve(app, free_port()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        wait_for(lambda: ready(url))
        reply = client.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}])
        first_pid = int((reply.choices[0].message.content or "").split()[2])
        engine = app.state.gateway.engines[0]
        assert engine.process.pid == first_pid

        os.kill(first_pid, signal.SIGKILL)  # the engine dies...
        wait_for(lambda: not ready(url))
        wait_for(lambda: ready(url))  # ...and is back
        reply = client.chat.completions.create(model="small", messages=[{"role": "user", "content": "again"}])
        second_pid = int((reply.choices[0].message.content or "").split()[2])
        assert second_pid != first_pid and engine.restarts == 1
    # Shutting the gateway down stops the engine.
    wait_for(lambda: engine.process.returncode is not None, timeout=5)


def test_a_started_engine_logs_json_lines_unless_its_args_say_otherwise() -> None:
    """Its output shares the gateway's stdout, where a log pipeline reads JSON lines; `args` come last,
    so an operator's own `--log-format` wins."""
    config = parse_config(
        """
backends:
  - {name: a, type: engine, model: smollm2-135m, port: 8001}
  - {name: b, type: engine, model: smollm2-135m, port: 8002, args: ["--log-format", "text"]}
models: [{name: small, backend: a, model: smollm2-135m}]
""",
        {},
    )
    plain, told = (EngineProcess(backend).command for backend in config.backends)
    assert plain[plain.index("--log-format") + 1] == "json"
    assert told[-2:] == ["--log-format", "text"] and told.index("--log-format") < len(told) - 2


def test_engine_by_url_needs_no_process() -> None:
    engine_port = free_port()
    config = parse_config(
        f"""
backends:
  - {{name: remote, type: engine, url: "http://127.0.0.1:{engine_port}"}}
models:
  - {{name: small, backend: remote}}
""",
        {},
    )
    engine = subprocess.Popen([sys.executable, FAKE_ENGINE, str(engine_port)])
    try:
        wait_for(lambda: _up(engine_port))
        app = create_app(config)
        assert app.state.gateway.engines == []
        with serve(app, free_port()) as url:
            assert ready(url)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(
                model="small", messages=[{"role": "user", "content": "hi"}]
            )
            assert (reply.choices[0].message.content or "").endswith("says: hi")
    finally:
        engine.terminate()
        engine.wait(10)


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def tiny_engine_server() -> Iterator[int]:
    """The real engine server (tiny random model) on its own event loop in a thread; yields its port."""
    from engine.async_engine import AsyncLLMEngine
    from engine.config import KNOWN_MODELS
    from engine.llm_engine import LLMEngine
    from engine.server import EngineServer, start_server

    port = free_port()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = LLMEngine.from_config(KNOWN_MODELS["tiny"], num_kv_blocks=64)
    server = EngineServer(AsyncLLMEngine(engine), model_name="tiny")
    runner = asyncio.run_coroutine_threadsafe(start_server(server, "127.0.0.1", port), loop).result(30)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextmanager
def tiny_engine_gateway() -> Iterator[str]:
    """A gateway with one engine backend (the tiny model as `small`); yields the gateway's URL."""
    with tiny_engine_server() as engine_port:
        config = parse_config(
            f"""
backends:
  - {{name: local, type: engine, url: "http://127.0.0.1:{engine_port}"}}
models:
  - {{name: small, backend: local, model: tiny}}
""",
            {},
        )
        with serve(create_app(config), free_port()) as url:
            yield url


def test_n_choices_logit_bias_and_json_schema_reach_the_engine_through_the_gateway() -> None:
    with tiny_engine_gateway() as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(
            model="small", messages=messages, n=3, seed=5, temperature=1.0, max_tokens=6
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        one = client.chat.completions.create(
            model="small", messages=messages, seed=5, temperature=1.0, max_tokens=6
        )
        assert reply.usage and one.usage and reply.usage.prompt_tokens == one.usage.prompt_tokens
        assert reply.choices[0].message.content == one.choices[0].message.content
        stream = client.chat.completions.create(
            model="small", messages=messages, n=3, seed=5, temperature=1.0, max_tokens=6, stream=True
        )
        texts = ["", "", ""]
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        assert texts == [c.message.content for c in reply.choices]  # streamed through the gateway
        forced = client.chat.completions.create(
            model="small", messages=messages, max_tokens=3, temperature=0, logit_bias={"66": 100}
        )
        assert forced.choices[0].message.content == "BBB"  # byte-level tokenizer: 66 is "B"
        schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"]}
        shaped = client.chat.completions.create(
            model="small",
            messages=messages,
            max_tokens=32,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
        )
        assert json.loads(shaped.choices[0].message.content or "")["pet"] in ("cat", "dog")


def test_engine_backend_counts_tokens_as_it_bills_and_refuses_embeddings_clearly() -> None:
    with tiny_engine_gateway() as url:
        messages = [{"role": "user", "content": "count these words for me"}]
        counted = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages
        raw = counted.with_raw_response.count_tokens(model="small", system="Be brief.", messages=messages)  # type: ignore[arg-type]
        assert raw.headers["x-weir-token-count"] == "backend"
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="small", messages=[{"role": "system", "content": "Be brief."}, *messages], max_tokens=1
        )
        assert chat.usage is not None and raw.parse().input_tokens == chat.usage.prompt_tokens > 5
        with pytest.raises(openai.BadRequestError, match=r"does not support embeddings \(engine backend\)"):
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).embeddings.create(
                model="small", input="hi"
            )


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def test_a_count_the_engine_cannot_make_is_estimated_not_refused() -> None:
    """The tiny model reads no images and its template writes no tool prompt: its /tokenize refuses
    both with an `unsupported_*` 400, which the count passed on to the client as a 400 (Claude Code
    counts before it sends). A count is estimated where the engine cannot make it, as for a model
    that cannot count at all; what it can count is still its own."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    tool = {"name": "f", "input_schema": {"type": "object"}}
    with tiny_engine_gateway() as url:
        counted = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages
        for asked in (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]},
            {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]},
        ):
            raw = counted.with_raw_response.count_tokens(model="small", **asked)  # type: ignore[arg-type]
            assert raw.headers["x-weir-token-count"] == "estimate" and raw.parse().input_tokens > 0
        raw = counted.with_raw_response.count_tokens(
            model="small", messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.headers["x-weir-token-count"] == "backend"
