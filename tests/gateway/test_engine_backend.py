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
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from gateway import engine_supervisor
from gateway.app import create_app
from gateway.config import Backend, parse_config
from gateway.engine_supervisor import EngineProcess
from tests.fakes import FakeOpenAI
from tests.fixtures.gateway import sqlite_weir
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.waiting import exited, wait_for

FAKE_ENGINE = str(Path(__file__).with_name("fake_engine.py"))


def ready(url: str) -> bool:
    return httpx.get(f"{url}/readyz").status_code == 200


def readyz(url: str) -> tuple[int, Any]:
    response = httpx.get(f"{url}/readyz")
    return response.status_code, response.json()


def engine_command(port: int, loaded: Path) -> str:
    """The fake engine on `port`, loading (its /health a 503) until the file `loaded` exists."""
    return f'["{sys.executable}", "{FAKE_ENGINE}", "{port}", "{loaded}"]'


def test_supervised_engine_is_started_restarted_and_stopped(tmp_path: Path) -> None:
    """A replica whose models are all on a supervised engine (`make run`'s) answers nothing while
    that engine restarts, so it leaves the pool meanwhile (503 "unavailable")."""
    engine_port, loaded = free_port(), tmp_path / "loaded"
    loaded.touch()
    config = parse_config(
        f"""
backends:
  - name: local
    type: engine
    model: smollm2-135m
    port: {engine_port}
    command: {engine_command(engine_port, loaded)}
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

        loaded.unlink()  # the next engine loads until the test says
        os.kill(first_pid, signal.SIGKILL)  # the engine dies...
        wait_for(lambda: engine.state == "restarting")
        assert readyz(url) == (503, {"status": "unavailable", "engines": {"local": "restarting"}})
        loaded.touch()
        wait_for(lambda: ready(url))  # ...and is back
        reply = client.chat.completions.create(model="small", messages=[{"role": "user", "content": "again"}])
        second_pid = int((reply.choices[0].message.content or "").split()[2])
        assert second_pid != first_pid and engine.restarts == 1
    # Shutting the gateway down stops the engine.
    wait_for(lambda: engine.process.returncode is not None, timeout=5)


def test_a_replica_with_a_vendor_stays_ready_while_its_engine_restarts(
    tmp_path: Path, fake_openai: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/readyz wanted every supervised engine up at all times: while one restarted after a crash (its
    model reloading, up to a minute), or for ever when it could not come back, the replica left the
    load balancer, its vendor models and the routes failing over from the engine included, and the
    same input crashing every replica's engine took every replica out. Now the first start alone is
    waited for, and the body says how each engine is."""
    monkeypatch.setattr(engine_supervisor, "RESTART_BACKOFF", (0.1,))
    engine_port, loaded = free_port(), tmp_path / "loaded"
    config = parse_config(
        f"""
backends:
  - name: local
    type: engine
    model: smollm2-135m
    port: {engine_port}
    command: {engine_command(engine_port, loaded)}
  - {{name: vendor, type: openai, base_url: "{fake_openai.base_url}", api_key: "{fake_openai.api_key}"}}
models:
  - {{name: small, backend: local, model: smollm2-135m}}
  - {{name: gpt-4o-mini, backend: vendor}}
""",
        {},
    )
    app = create_app(config)
    with serve(app, free_port()) as url:
        engine = app.state.gateway.engines[0]
        wait_for(lambda: engine.process is not None)  # its first start: not ready yet
        assert readyz(url) == (503, {"status": "starting", "engines": {"local": "loading"}})
        loaded.touch()
        wait_for(lambda: ready(url))
        assert readyz(url) == (200, {"status": "ready", "engines": {"local": "ready"}})

        loaded.unlink()  # the next engine loads until the test says
        os.kill(engine.process.pid, signal.SIGKILL)
        wait_for(lambda: engine.state == "restarting")
        assert readyz(url) == (200, {"status": "ready", "engines": {"local": "restarting"}})
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "hi"  # the vendor answers meanwhile
        wait_for(lambda: engine.restarts == 1 and engine.process.returncode is None)  # the new one loads
        assert readyz(url) == (200, {"status": "ready", "engines": {"local": "restarting"}})
        loaded.touch()
        wait_for(lambda: readyz(url) == (200, {"status": "ready", "engines": {"local": "ready"}}))


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


def test_a_count_with_a_tool_of_anthropics_api_is_refused_as_its_message_is() -> None:
    """The engine is never sent a tool of Anthropic's API (its message is refused before anything
    is sent): a count without the tool was below anything the message could bill."""
    asked = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
    }
    with tiny_engine_gateway() as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages
        with pytest.raises(anthropic.BadRequestError, match=r"tools\[0\]"):
            client.create(model="small", max_tokens=5, **asked)  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError, match=r"tools\[0\]"):
            client.count_tokens(model="small", **asked)  # type: ignore[arg-type]


# --- supervision: restarts, the port, a gateway that dies ---------------------------------------------

TINY_ENGINE = str(Path(__file__).with_name("tiny_engine.py"))

# An engine whose model does not load: it says why on stderr, as a traceback's last line, and exits 1.
OUT_OF_MEMORY = (
    "import sys; sys.exit('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB')"
)

# An engine that serves /health for a moment, then crashes with a word on stderr. argv: port.
CRASHES = """
import sys, threading, time, http.server
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(0.5)
sys.exit("RuntimeError: CUDA error: an illegal memory access was encountered")
"""


def engine_backend(port: int, command: list[str]) -> Backend:
    return msgspec.convert(
        {"name": "local", "type": "engine", "model": "tiny", "port": port, "command": command}, Backend
    )


def crashing_engine(tmp_path: Path) -> EngineProcess:
    script, port = tmp_path / "crashes.py", free_port()
    script.write_text(CRASHES)
    return EngineProcess(engine_backend(port, [sys.executable, str(script), str(port)]))


async def test_restarts_wait_the_backoff_lists_entries_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The n-th quick crash in a row waits the n-th entry of RESTART_BACKOFF. The first quick crash
    waited the second entry (2 s) and the first (1 s) was only used after an engine that had run for
    over a minute."""
    monkeypatch.setattr(engine_supervisor, "RESTART_BACKOFF", (0.1, 0.2, 0.3))
    monkeypatch.setattr(engine_supervisor, "WATCH_INTERVAL_S", 0.1)
    engine = crashing_engine(tmp_path)
    with capture_logs() as logs:
        await engine.start()
        try:
            async with asyncio.timeout(20):
                while sum(e["event"] == "engine_exited" for e in logs) < 4:
                    await asyncio.sleep(0.05)
        finally:
            await engine.stop()
    exits = [e for e in logs if e["event"] == "engine_exited"]
    assert [e["restart_in"] for e in exits[:4]] == [0.1, 0.2, 0.3, 0.3]
    assert exits[0]["code"] == 1


async def test_a_process_already_on_the_port_is_not_taken_for_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process on the engine's port (the engine a SIGKILLed gateway left behind) answered the
    new engine's /health, so the supervisor said ready while its own engine could not bind and
    restarted in a loop. Now it starts nothing while the port is taken, says so, and starts its
    engine once the port is free."""
    monkeypatch.setattr(engine_supervisor, "RESTART_BACKOFF", (0.2,))
    port = free_port()
    squatter = subprocess.Popen([sys.executable, FAKE_ENGINE, str(port)])
    engine = EngineProcess(engine_backend(port, [sys.executable, FAKE_ENGINE, str(port)]))
    try:
        wait_for(lambda: _up(port))
        with capture_logs() as logs:
            await engine.start()
            await asyncio.sleep(1.5)
            assert not engine.healthy and engine.process is None  # nothing started
            assert any(e["event"] == "engine_port_in_use" and e["port"] == port for e in logs)
        squatter.terminate()
        squatter.wait(10)
        while not engine.healthy:
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient() as client:
            reply = await client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert engine.process is not None
        assert reply.json()["choices"][0]["message"]["content"] == f"engine pid {engine.process.pid} says: hi"
    finally:
        await engine.stop()
        squatter.kill()
        squatter.wait(10)


SUPERVISOR = """
import asyncio, sys
import msgspec
from gateway.config import Backend
from gateway.engine_supervisor import EngineProcess

async def main() -> None:
    port = int(sys.argv[1])
    command = [sys.executable, sys.argv[2], "engine", "serve", "--model", "tiny", "--port", str(port)]
    backend = {"name": "local", "type": "engine", "model": "tiny", "port": port, "command": command}
    await EngineProcess(msgspec.convert(backend, Backend)).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_supervised_engine_exits_when_its_gateway_is_killed(tmp_path: Path) -> None:
    """The engine runs in a session of its own, so a SIGKILLed gateway left it serving, unsupervised,
    and the restarted gateway's engine could not bind its port. Now the engine watches the gateway's
    pid and shuts down within a second or so of it going. The real engine server, tiny model."""
    port, pid_file = free_port(), tmp_path / "engine.pid"
    env = {**os.environ, "TINY_ENGINE_PID_FILE": str(pid_file)}
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(port), TINY_ENGINE], env=env)
    engine_pid = None
    try:
        wait_for(lambda: _up(port), timeout=90)  # torch's import on a loaded machine
        engine_pid = int(pid_file.read_text())
        supervisor.kill()
        supervisor.wait(10)
        wait_for(lambda: exited(engine_pid), timeout=5)
        assert not _up(port)
    finally:
        supervisor.kill()
        supervisor.wait(10)
        if engine_pid is not None and not exited(engine_pid):
            os.killpg(engine_pid, signal.SIGKILL)


async def test_a_start_that_fails_once_the_engine_runs_stops_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's start failed after its engine was spawned (the admin DB's routes unreadable, say):
    the engine ran on, unsupervised, until the dying process's watch ended it. Now it is stopped in
    order as the failed start unwinds."""
    from routing.router import Router

    port = free_port()
    config = parse_config(
        f"""
backends:
  - {{name: local, type: engine, model: tiny, port: {port}, command: ["{sys.executable}", "{FAKE_ENGINE}", "{port}"]}}
models:
  - {{name: small, backend: local, model: tiny}}
""",
        {},
    )
    app = create_app(config)
    engine = app.state.gateway.engines[0]

    async def fails_once_the_engine_runs(self: Router, transport: object) -> None:
        while engine.process is None:  # the supervisor's task spawns it
            await asyncio.sleep(0.02)
        raise RuntimeError("routes unreadable")

    monkeypatch.setattr(Router, "start", fails_once_the_engine_runs)
    try:
        with pytest.raises(BaseException, match=r"routes unreadable|unhandled errors"):
            async with app.lifespan():
                pass
        assert engine.process.returncode is not None
    finally:
        if engine.process is not None and engine.process.returncode is None:
            os.killpg(engine.process.pid, signal.SIGKILL)
            await engine.process.wait()


def test_a_responses_clients_logprobs_come_from_the_engine() -> None:
    """The bundled engine gives chat logprobs: a Responses client gets them on its output_text part
    and on each streamed delta, as many as the tokens the engine billed."""
    with tiny_engine_gateway() as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        asked: Any = {
            "model": "small",
            "input": "hi",
            "max_output_tokens": 4,
            "temperature": 0,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 2,
        }
        response = client.responses.create(**asked)
        part = response.output[0].content[0]
        assert part.type == "output_text" and response.usage is not None
        assert len(part.logprobs) == response.usage.output_tokens == 4
        assert all(len(token.top_logprobs) == 2 and token.logprob <= 0 for token in part.logprobs)
        # The tiny model's byte tokens need not be whole characters: their bytes make the text.
        answer = bytes(b for token in part.logprobs for b in token.bytes)
        assert answer.decode(errors="replace") == response.output_text
        events = list(client.responses.create(**asked, stream=True))
        streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
        assert streamed == [token.token for token in part.logprobs]


# --- an engine that cannot load its model, one that keeps crashing -----------------------------------


def metric(url: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_an_engine_whose_model_is_missing_is_given_up_on_at_once_and_said_why(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A model that cannot load was restarted for ever on the backoff, /readyz said "starting" and
    `weir demo` waited 900 s without a word. A model that is not there is a configuration error: the
    real engine exits with os.EX_CONFIG, the supervisor starts it once, logs one `engine_failed` line
    with the engine's own error, /readyz says "failed", and the engine's model answers 503 in
    OpenAI's shape, saying why (not only "cannot connect"). /readyz, which needs no token, leaves the
    error out: it names the model's path."""
    engine_port = free_port()
    config = parse_config(
        f"""
backends:
  - {{name: local, type: engine, model: /nonexistent/model.gguf, port: {engine_port}}}
models:
  - {{name: small, backend: local, model: tiny}}
""",
        {},
    )
    app = create_app(config)
    with capture_logs() as logs, serve(app, free_port()) as url:
        engine = app.state.gateway.engines[0]
        wait_for(lambda: engine.state == "failed")
        status, body = readyz(url)
        assert status == 503 and body == {"status": "failed", "engines": {"local": "failed"}}
        error = next(e for e in logs if e["event"] == "engine_failed")["error"]
        assert error.startswith("could not load '/nonexistent/model.gguf': unknown model"), error
        with pytest.raises(openai.InternalServerError) as refused:
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).chat.completions.create(
                model="small", messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.status_code == 503 and refused.value.code == "backend_unavailable"
        assert refused.value.body["message"] == (  # type: ignore[index]
            "backend local: its engine failed to load its model and is not started again "
            "(the reason is in the gateway's log and the admin API's routes/status)"
        )
        assert "/nonexistent" not in str(refused.value.body)  # paths are for operators, not tenants
        assert metric(url, "weir_engine_state", backend="local", state="failed") == 1
        assert metric(url, "weir_engine_state", backend="local", state="loading") == 0
        assert engine._task.done() and engine.process.returncode == os.EX_CONFIG  # started once
    assert [e["event"] for e in logs if e["event"].startswith("engine_")] == [
        "engine_started",
        "engine_failed",
    ]
    failed = next(e for e in logs if e["event"] == "engine_failed")
    assert failed["attempts"] == 1 and failed["code"] == os.EX_CONFIG
    assert "could not load '/nonexistent/model.gguf'" in capfd.readouterr().out  # its own lines, relayed


def test_an_engine_given_up_on_says_why_to_the_admin_api(
    fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own error, out of /readyz, is in the admin API's routes/status for an operator."""
    config = f"""
backends:
  - {{name: openai, type: openai, base_url: "${{OPENAI_BASE_URL}}", api_key: "${{OPENAI_API_KEY}}"}}
  - {{name: local, type: engine, model: tiny, port: {free_port()}, command: ["/nonexistent/weir-engine"]}}
models:
  - {{name: gpt-4o-mini, backend: openai}}
  - {{name: small, backend: local, model: tiny}}
database_url: "${{DB_URL}}"
"""
    with sqlite_weir(config, fake_openai, tmp_path, monkeypatch) as weir:
        wait_for(lambda: readyz(weir.url) == (200, {"status": "ready", "engines": {"local": "failed"}}))
        engines = weir.admin.get("/routes/status").json()["engines"]
    assert engines["local"]["state"] == "failed"
    assert engines["local"]["error"].startswith("cannot run /nonexistent/weir-engine: [Errno 2]")


async def test_an_engine_that_fails_to_load_is_tried_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load that fails otherwise (out of memory, a corrupt file) may pass on another try, but not on
    every one: after LOAD_ATTEMPTS the supervisor gives up, with the engine's own last error."""
    monkeypatch.setattr(engine_supervisor, "RESTART_BACKOFF", (0.1,))
    engine = EngineProcess(engine_backend(free_port(), [sys.executable, "-c", OUT_OF_MEMORY]))
    with capture_logs() as logs:
        await engine.start()
        try:
            assert engine._task is not None
            await asyncio.wait_for(engine._task, 10)  # supervision ends: nothing is started again
        finally:
            await engine.stop()
    events = [e["event"] for e in logs if e["event"] in ("engine_started", "engine_exited", "engine_failed")]
    assert events == ["engine_started", "engine_exited"] * 2 + ["engine_started", "engine_failed"]
    failed = logs[-1]
    assert failed["event"] == "engine_failed" and failed["attempts"] == engine_supervisor.LOAD_ATTEMPTS == 3
    assert failed["error"] == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert engine.state == "failed" and failed["code"] == 1


async def test_an_engine_that_keeps_crashing_while_serving_is_held_after_a_capped_number_of_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash while serving is not a failed load: it is restarted on the backoff, but at most
    CRASH_RESTARTS times in CRASH_WINDOW_S; the next start then waits for the window, said in the log,
    /readyz's state ("crash_loop") and the metrics, with the engine's last error."""
    monkeypatch.setattr(engine_supervisor, "RESTART_BACKOFF", (0.1,))
    monkeypatch.setattr(engine_supervisor, "WATCH_INTERVAL_S", 0.1)
    monkeypatch.setattr(engine_supervisor, "CRASH_RESTARTS", 2)
    monkeypatch.setattr(engine_supervisor, "CRASH_WINDOW_S", 4.0)
    engine = crashing_engine(tmp_path)
    registry = CollectorRegistry()
    registry.register(engine_supervisor.EngineCollector([engine]))
    with capture_logs() as logs:
        await engine.start()
        try:
            while engine.state != "crash_loop":
                await asyncio.sleep(0.02)
            assert engine.restarts == 2
            assert (
                registry.get_sample_value("weir_engine_state", {"backend": "local", "state": "crash_loop"})
                == 1
            )
            assert registry.get_sample_value("weir_engine_restarts_total", {"backend": "local"}) == 2
            held = next(e for e in logs if e["event"] == "engine_crash_loop")
            assert held["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
            assert 0 < held["restart_in"] <= 4.0 and held["crashes"] == 3
            while engine.restarts < 3:  # the window passes: started again
                await asyncio.sleep(0.05)
        finally:
            await engine.stop()


async def test_waits_for_a_port_in_use_do_not_count_as_failed_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port still held by the engine a killed gateway left (it ends itself within a second or so) is
    waited for on the backoff: those waits are no tries of the model, which still gets LOAD_ATTEMPTS."""
    monkeypatch.setattr(engine_supervisor, "RESTART_BACKOFF", (0.2,))
    port = free_port()
    squatter = subprocess.Popen([sys.executable, FAKE_ENGINE, str(port)])
    engine = EngineProcess(engine_backend(port, [sys.executable, "-c", OUT_OF_MEMORY]))
    try:
        wait_for(lambda: _up(port))
        with capture_logs() as logs:
            await engine.start()
            while sum(e["event"] == "engine_port_in_use" for e in logs) < 3:
                await asyncio.sleep(0.05)
            squatter.terminate()
            squatter.wait(10)
            assert engine._task is not None
            await asyncio.wait_for(engine._task, 10)
    finally:
        await engine.stop()
        squatter.kill()
        squatter.wait(10)
    assert sum(e["event"] == "engine_started" for e in logs) == engine_supervisor.LOAD_ATTEMPTS
    assert logs[-1]["event"] == "engine_failed" and logs[-1]["attempts"] == engine_supervisor.LOAD_ATTEMPTS
