"""`weir serve` as a user runs it: the issue's example config, JSON log lines on stdout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.net import free_port
from tests.fixtures.vendor_gateway import EXAMPLE

WEIR = str(Path(sys.executable).with_name("weir"))


def weir_serve(config: Path, port: int, env: dict[str, str], server_kind: str) -> subprocess.Popen[bytes]:
    """`weir serve` as a user starts it, its stdout and stderr kept for the test to read."""
    command = [WEIR, "serve", "--config", str(config), "--port", str(port), "--server", server_kind]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_ready(server: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert server.poll() is None and time.monotonic() < deadline, "weir serve did not start"
        time.sleep(0.1)


@pytest.mark.parametrize("server_kind", ["granian", "uvicorn"])
def test_weir_serve_with_the_example_config(
    tmp_path: Path,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    server_kind: str,
) -> None:
    config = tmp_path / "weir.yaml"
    config.write_text(EXAMPLE)
    port = free_port()
    env = {
        **os.environ,
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "ANTHROPIC_BASE_URL": fake_anthropic.base_url,
        "ANTHROPIC_API_KEY": fake_anthropic.api_key,
        "GEMINI_BASE_URL": fake_gemini.base_url,
        "GEMINI_API_KEY": fake_gemini.api_key,
        "WEIR_DEMO_KEY": "sk-serve-test",
    }
    server = weir_serve(config, port, env, server_kind)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(server, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-serve-test", max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="claude-sonnet", messages=[{"role": "user", "content": "served"}]
        )
        assert reply.parse().choices[0].message.content == "served"
        request_id = reply.headers["x-request-id"]
        # A backend that breaks: its line, as JSON, names the request (the client's own id here).
        fake_anthropic.fail_next(Fault.reset())
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="claude-sonnet",
                messages=[{"role": "user", "content": "broken"}],
                extra_headers={"x-request-id": "serve-trace-1"},
            )
        assert caught.value.response.headers["x-request-id"] == "serve-trace-1"
    finally:
        server.terminate()
        stdout, stderr = server.communicate(timeout=30)
    lines = [json.loads(line) for line in stdout.decode().splitlines() if line.startswith("{")]
    line, failed = [entry for entry in lines if entry.get("event") == "request"]
    assert line["request_id"] == request_id and line["level"] == "info"
    assert (failed["request_id"], failed["status"]) == ("serve-trace-1", 502)
    assert (line["status"], line["backend"], line["tenant"], line["output_tokens"]) == (
        200,
        "anthropic",
        "demo",
        1,
    )
    [broken] = [entry for entry in lines if entry.get("event") == "upstream_request_broken"]
    assert (broken["request_id"], broken["tenant"], broken["model"], broken["level"]) == (
        "serve-trace-1",
        "demo",
        "claude-sonnet",
        "warning",
    )
    assert "Traceback" not in stderr.decode()


@pytest.mark.parametrize("server_kind", ["granian", "uvicorn"])
def test_weir_serve_writes_nothing_but_json_lines(
    tmp_path: Path, fake_anthropic: FakeAnthropic, server_kind: str
) -> None:
    """A log pipeline reads JSON lines: what the standard library's logging writes (the control
    plane's lines, alembic's migration at start, a Redis outage) is JSON too, and nothing else
    reaches stdout or stderr."""
    config = tmp_path / "weir.yaml"
    config.write_text(EXAMPLE)
    port = free_port()
    env = {
        **os.environ,
        "OPENAI_API_KEY": "unused",
        "GEMINI_API_KEY": "unused",
        "ANTHROPIC_BASE_URL": fake_anthropic.base_url,
        "ANTHROPIC_API_KEY": fake_anthropic.api_key,
        "WEIR_DEMO_KEY": "sk-serve-test",
        "WEIR_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/weir.db",
        "WEIR_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens: an outage
        "WEIR_USAGE_SPOOL": str(tmp_path / "spool"),
        "WEIR_ADMIN_TOKEN": "wa-serve-test-0123456789",  # else one is made and shown once on stderr
    }
    server = weir_serve(config, port, env, server_kind)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(server, url)
        # A tenant with a limit: its request asks Redis, finds it away and says so.
        admin = httpx.Client(
            base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {env['WEIR_ADMIN_TOKEN']}"}
        )
        tenant = admin.post("/tenants", json={"name": "limited", "rpm": 60}).json()
        key = admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "app"}).json()["key"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="claude-sonnet", messages=[{"role": "user", "content": "served"}]
        )
        assert reply.parse().choices[0].message.content == "served"
    finally:
        server.terminate()
        stdout, stderr = server.communicate(timeout=30)
    assert stderr.decode() == ""
    lines = [json.loads(line) for line in stdout.decode().splitlines()]  # every one of them
    assert all(isinstance(line, dict) and {"event", "level", "timestamp"} <= line.keys() for line in lines)
    # The outage is met by the usage writer's first read at start, before any request pays for it:
    # no request's line. (A stdlib line a request writes carries its fields: test_request_log_context.)
    [away] = [line for line in lines if line["event"].startswith("Redis unreachable")]
    assert (away["logger"], away["level"], "request_id" in away) == (
        "gateway.state.degradable",
        "warning",
        False,
    )
    [served] = [line for line in lines if line["event"] == "request" and line.get("tenant") == "limited"]
    assert (served["request_id"], served["status"]) == (reply.headers["x-request-id"], 200)


@pytest.mark.parametrize("server_kind", ["granian", "uvicorn"])
@pytest.mark.parametrize("fault", ["database_url", "port_taken"])
def test_weir_serve_that_cannot_start_says_why_in_one_line(
    tmp_path: Path, server_kind: str, fault: str
) -> None:
    """A gateway that cannot start (a database URL no driver reads; a port another process holds)
    wrote Python's plain-text traceback on stderr, then a JSON line holding it: `weir serve` checks
    both before any server or worker starts (gateway.preflight), and says why in one `Error:` line on
    stderr, as for a bad config, with exit status 1 and nothing on stdout."""
    config = tmp_path / "weir.yaml"
    config.write_text(EXAMPLE)
    env = {
        **os.environ,
        "OPENAI_API_KEY": "unused",
        "ANTHROPIC_API_KEY": "unused",
        "GEMINI_API_KEY": "unused",
        "WEIR_DEMO_KEY": "sk-serve-test",
        "WEIR_ADMIN_TOKEN": "wa-serve-test-0123456789",
    }
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if fault == "database_url":
            env["WEIR_DATABASE_URL"] = "nosuchdialect://weir/db"
            port, expected = free_port(), "admin DB nosuchdialect://weir/db: Can't load plugin"
        else:
            port = taken.getsockname()[1]
            expected = f"cannot listen on 127.0.0.1:{port}: Address already in use"
        done = subprocess.run(
            [WEIR, "serve", "--config", str(config), "--port", str(port), "--server", server_kind],
            env=env,
            capture_output=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert done.stdout.decode() == ""
    [line] = done.stderr.decode().splitlines()
    assert line.startswith(f"Error: {expected}"), line


CRASHES = """\
import asyncio, threading
from gateway.logging import configure_logging

configure_logging("info")

async def background() -> None:
    raise ValueError("task nobody awaited")

async def main() -> None:
    task = asyncio.get_running_loop().create_task(background())
    await asyncio.sleep(0.05)
    del task

asyncio.run(main())
thread = threading.Thread(target=lambda: 1 / 0, name="poller")
thread.start()
thread.join()

class Leaky:
    def __del__(self) -> None:
        raise KeyError("in a finalizer")

Leaky()
raise RuntimeError("the process gives up")
"""


def test_exceptions_nothing_caught_are_json_lines() -> None:
    """What Python writes as plain text on stderr, logged as `weir serve` configures logging: the main
    thread's uncaught exception, another thread's, one in a finalizer, a background task's that
    nobody retrieved (asyncio's own logger). Each is one JSON line with its traceback."""
    done = subprocess.run([sys.executable, "-c", CRASHES], capture_output=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.decode() == ""
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    last = {line["exception"].splitlines()[-1]: line for line in lines}
    assert set(last) == {
        "ValueError: task nobody awaited",
        "ZeroDivisionError: division by zero",
        "KeyError: 'in a finalizer'",
        "RuntimeError: the process gives up",
    }
    task = last["ValueError: task nobody awaited"]
    assert (task["logger"], task["level"]) == ("asyncio", "error")
    thread = last["ZeroDivisionError: division by zero"]
    assert (thread["event"], thread["level"], thread["thread"]) == ("uncaught_exception", "error", "poller")
    finalizer = last["KeyError: 'in a finalizer'"]
    assert finalizer["event"] == "uncaught_exception" and "Leaky.__del__" in finalizer["where"]
    crash = last["RuntimeError: the process gives up"]
    assert (crash["event"], crash["level"]) == ("uncaught_exception", "critical")
    assert crash["exception"].splitlines()[-2].endswith("in <module>")  # where it was raised


def serve_on_port_0(config: Path, server_kind: str) -> tuple[subprocess.Popen[bytes], int]:
    """`weir serve --port 0` and the port it says it bound, read from its `gateway_listening` line."""
    server = weir_serve(config, 0, {**os.environ, "WEIR_DEMO_KEY": "sk-serve-test"}, server_kind)
    assert server.stdout is not None
    for line in server.stdout:  # ends, and the test fails below, if it stops without the line
        event = json.loads(line)
        if event["event"] == "gateway_listening":
            assert (event["level"], event["host"]) == ("info", "127.0.0.1"), event
            return server, event["port"]
    server.communicate(timeout=30)
    raise AssertionError("weir serve wrote no gateway_listening line")


def stop(server: subprocess.Popen[bytes]) -> str:
    server.terminate()
    return server.communicate(timeout=30)[1].decode()


@pytest.mark.parametrize("server_kind", ["granian", "uvicorn"])
def test_weir_serve_port_0_logs_the_port_it_bound(tmp_path: Path, server_kind: str) -> None:
    """With `--port 0` the system picks the port, and `weir serve` wrote nothing at start (the servers'
    own lines are below the level it gives them): one JSON line says where it listens now."""
    config = tmp_path / "weir.yaml"
    config.write_text(THROTTLED.format(trusted="[127.0.0.1]"))
    server, port = serve_on_port_0(config, server_kind)
    try:
        assert port != 0
        wait_ready(server, f"http://127.0.0.1:{port}")
    finally:
        assert "Traceback" not in stop(server)


THROTTLED = """\
backends:
  - {{name: openai, type: openai, base_url: "http://127.0.0.1:9", api_key: "unused"}}
models:
  - {{name: model-a, backend: openai, model: gpt-4o-mini}}
tenants:
  - {{name: demo, api_keys: ["${{WEIR_DEMO_KEY}}"]}}
server: {{auth_failures_per_minute: 3, forwarded_allow_ips: {trusted}}}
"""


@pytest.mark.parametrize(
    ("server_kind", "trusted", "per_client"),
    [
        ("uvicorn", "[127.0.0.1]", True),
        ("granian", "[127.0.0.1]", True),
        ("granian", '"*"', True),
        ("uvicorn", "[192.0.2.0/24]", False),  # the peer is no trusted proxy: its header is ignored
    ],
)
def test_forwarded_allow_ips_names_the_client_the_auth_throttle_counts(
    tmp_path: Path, server_kind: str, trusted: str, per_client: bool
) -> None:
    """Behind a proxy the failed-auth throttle counted the proxy's address (granian always, uvicorn
    unless FORWARDED_ALLOW_IPS named it), so one client's wrong keys throttled every client behind
    it. `server.forwarded_allow_ips` names the proxies whose `X-Forwarded-For` names the client."""
    config = tmp_path / "weir.yaml"
    config.write_text(THROTTLED.format(trusted=trusted))
    server, port = serve_on_port_0(config, server_kind)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(server, url)

        def models(key: str, client: str) -> int:
            headers = {"authorization": f"Bearer {key}", "x-forwarded-for": client}
            return httpx.get(f"{url}/v1/models", headers=headers, timeout=10).status_code

        assert [models(f"sk-wrong-{i}", "203.0.113.9") for i in range(4)] == [401, 401, 401, 429]
        assert models("sk-wrong", "198.51.100.7") == (401 if per_client else 429)
        assert models("sk-serve-test", "198.51.100.7") == 200
    finally:
        assert "Traceback" not in stop(server)


def test_granians_port_falls_back_to_the_port_asked_for_when_its_spec_is_unreadable() -> None:
    """The bound port is read from granian's private socket spec; a granian that shapes it otherwise
    gets the port asked for in the line, and the start goes on."""
    from types import SimpleNamespace

    from gateway.cli import _granian_port

    assert _granian_port(SimpleNamespace(), 8080) == 8080
    assert _granian_port(SimpleNamespace(_ssp=SimpleNamespace(__getstate__=lambda: ())), 8080) == 8080
    assert _granian_port(SimpleNamespace(_ssp=SimpleNamespace(__getstate__=lambda: ("h", 4321))), 0) == 4321


def test_sigterm_stops_weir_serve_with_status_0(tmp_path: Path) -> None:
    """A drained stop ended "killed by SIGTERM" (status 143, -15 here), which uvicorn raises again once
    it has drained: the stop a deployment asked for read as a failure. (granian already exits 0.)"""
    config = tmp_path / "weir.yaml"
    config.write_text(THROTTLED.format(trusted="[127.0.0.1]"))
    server, port = serve_on_port_0(config, "uvicorn")
    try:
        wait_ready(server, f"http://127.0.0.1:{port}")
    finally:
        stderr = stop(server)
    assert server.returncode == 0, stderr
