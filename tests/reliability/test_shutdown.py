"""Graceful shutdown of `weir serve`: SIGTERM (or SIGINT) lets in-flight requests finish up to the drain's
deadline, where each stream still running ends with its API's error event and each request still awaiting
its answer with its API's 503; their usage events reach the ledger, and the process exits on its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.gateway import ADMIN
from tests.fixtures.net import free_port
from tests.fixtures.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
WORDS = " ".join(f"w{i}" for i in range(20))


def _serve(
    fake_openai: FakeOpenAI, tmp_path: Path, server: str, extra: str = ""
) -> tuple[subprocess.Popen[bytes], str]:
    """`weir serve` on a free port in front of the fake OpenAI, with an admin DB, once it is ready:
    the process (its own session, SIGKILLed with its children by `_stop`) and its base URL."""
    config = tmp_path / "weir.yaml"
    config.write_text(
        f"""backends:
  - {{name: openai, type: openai, base_url: "{fake_openai.base_url}", api_key: "{fake_openai.api_key}"}}
models:
  - {{name: gpt-4o-mini, backend: openai, price: {{input: 0.15, output: 0.60}}}}
database_url: "sqlite+aiosqlite:///{tmp_path}/weir.db"
{extra}"""
    )
    port = free_port()
    env = {**os.environ, "WEIR_ADMIN_TOKEN": ADMIN, "WEIR_USAGE_SPOOL": str(tmp_path / "spool")}
    log = (tmp_path / "weir.log").open("wb")
    proc = subprocess.Popen(
        [
            str(ROOT / ".venv/bin/weir"),
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
            "--server",
            server,
        ],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/readyz").status_code == 200:
                    return proc, base
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "weir.log").read_text()
            time.sleep(0.2)
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tenant_key(base: str, name: str) -> tuple[str, str]:
    admin = httpx.Client(base_url=f"{base}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
    tenant = admin.post("/tenants", json={"name": name}).json()
    return tenant["id"], admin.post(f"/tenants/{tenant['id']}/keys", json={}).json()["key"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("server", "signals"),
    [
        ("uvicorn", ["SIGTERM"]),  # granian 2.8 sometimes ignores SIGTERM: see gateway/cli.py
        # Ctrl-C in a terminal: the terminal's SIGINT, and under `weir demo` (`make run`) the one the
        # demo passes on as well, which must not be a second SIGINT: that one stops uvicorn at once.
        ("uvicorn", ["SIGINT"]),
        ("uvicorn", ["SIGINT", "SIGTERM"]),
    ],
)
def test_a_stop_signal_drains_in_flight_streams_then_exits(
    fake_openai: FakeOpenAI, tmp_path: Path, server: str, signals: list[str]
) -> None:
    proc, base = _serve(fake_openai, tmp_path, server)
    try:
        tenant, key = _tenant_key(base, "drained")

        fake_openai.fail_next(Fault.slow_stream(0.1))  # 20 chunks: about 2 s
        words: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": WORDS}], "stream": True}
            with httpx.stream(
                "POST",
                f"{base}/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {key}"},
                timeout=30,
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            words.extend((choice["delta"].get("content") or "").split())
                        if words:
                            first.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(10)
        for name in signals:
            proc.send_signal(getattr(signal, name))
        client.join(30)
        assert words == WORDS.split()  # the stream in flight finished, whole
        assert proc.wait(30) == 0, (tmp_path / "weir.log").read_text()
        with contextlib.closing(sqlite3.connect(tmp_path / "weir.db")) as db:
            rows = db.execute(
                "SELECT status, output_tokens, estimated FROM usage_events WHERE tenant_id = ?",
                (tenant,),
            ).fetchall()
        assert rows == [(200, 20, 0)]  # written before exit, exactly once, not estimated
    finally:
        _stop(proc)


# One request per API: its path and body (streamed, or not), as its client sends it.
REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": WORDS}]}),
    "messages": ("/v1/messages", {"max_tokens": 100, "messages": [{"role": "user", "content": WORDS}]}),
    "responses": ("/v1/responses", {"input": WORDS}),
    "completions": ("/v1/completions", {"prompt": WORDS}),
}


def _shutdown_error(api: str, lines: list[str]) -> dict[str, Any]:
    """The error event that ended the stream `lines` of `api`, in that API's wire format."""
    events = [line[6:] for line in lines if line.startswith("data: ")]
    if api in ("chat", "completions"):
        assert "[DONE]" not in events  # a failed stream never ends as a whole one
        return json.loads(events[-1])["error"]
    if api == "messages":
        assert lines[-2:] == ["event: error", f"data: {events[-1]}"], lines[-4:]
        return json.loads(events[-1])["error"]
    # An `error` event with the gateway's code, then `response.failed` (whose codes are OpenAI's few).
    error, failed = json.loads(events[-2]), json.loads(events[-1])
    assert (error["type"], failed["type"]) == ("error", "response.failed"), events[-2:]
    assert failed["response"]["error"]["code"] == "server_error"
    return error


@pytest.mark.slow
@pytest.mark.parametrize("server", ["uvicorn", "granian"])
def test_streams_still_running_at_the_drain_deadline_end_with_an_error_event(
    fake_openai: FakeOpenAI, tmp_path: Path, server: str
) -> None:
    """A stream longer than the drain was cut off at its deadline: an incomplete chunked body, no
    error event, and an "Exception in ASGI application" traceback in the log."""
    proc, base = _serve(fake_openai, tmp_path, server, "server: {drain_timeout: 1}\n")
    try:
        tenant, key = _tenant_key(base, "cut")
        fake_openai.fail_next(Fault.slow_stream(0.5), times=len(REQUESTS))  # 20 chunks: about 10 s
        lines: dict[str, list[str]] = {api: [] for api in REQUESTS}
        failures: dict[str, BaseException] = {}
        under_way = {api: threading.Event() for api in REQUESTS}  # its first word came

        def stream(api: str) -> None:
            path, body = REQUESTS[api]
            body = {**body, "model": "gpt-4o-mini", "stream": True}
            headers = {"authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
            try:
                with httpx.stream(
                    "POST", f"{base}{path}", json=body, headers=headers, timeout=30
                ) as response:
                    for line in response.iter_lines():
                        lines[api].append(line)
                        if "w0" in line:
                            under_way[api].set()
            except BaseException as exc:  # an incomplete body: httpx.RemoteProtocolError
                failures[api] = exc

        clients = [threading.Thread(target=stream, args=(api,)) for api in REQUESTS]
        for client in clients:
            client.start()
        assert all(event.wait(10) for event in under_way.values())
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(20)
        assert time.monotonic() - signalled < 8  # ended at the deadline, not at the stream's end
        assert failures == {}
        for api in REQUESTS:
            error = _shutdown_error(api, [line for line in lines[api] if line])
            assert "shutting down" in error["message"], (api, error)
            if api != "messages":  # Anthropic's errors have a type only (503: `overloaded_error`)
                assert error["code"] == "server_shutting_down", (api, error)
        assert proc.wait(15) == 0
        log = (tmp_path / "weir.log").read_text()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
        with contextlib.closing(sqlite3.connect(tmp_path / "weir.db")) as db:
            rows = db.execute(
                "SELECT status, output_tokens > 0, estimated FROM usage_events WHERE tenant_id = ?", (tenant,)
            ).fetchall()
        # What was streamed is billed (estimated: the vendor's usage report never came), once a stream.
        assert rows == [(503, 1, 1)] * len(REQUESTS)
    finally:
        _stop(proc)


@pytest.mark.slow
@pytest.mark.parametrize("server", ["uvicorn", "granian"])
def test_answers_still_awaited_at_the_drain_deadline_are_503s_in_their_api_shape(
    fake_openai: FakeOpenAI, tmp_path: Path, server: str
) -> None:
    """A request not streamed, its upstream still silent at the deadline, was cancelled by uvicorn
    2 s later (a 500, an "Exception in ASGI application" traceback, a 499 in the ledger), and under
    granian waited for however long its upstream took: here, for ever."""
    proc, base = _serve(fake_openai, tmp_path, server, "server: {drain_timeout: 1}\n")
    try:
        tenant, key = _tenant_key(base, "unanswered")
        fake_openai.fail_next(Fault.hang(), times=len(REQUESTS))  # no answer until the test ends
        answers: dict[str, httpx.Response | BaseException] = {}

        def ask(api: str) -> None:
            path, body = REQUESTS[api]
            headers = {"authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
            try:
                answers[api] = httpx.post(
                    f"{base}{path}", json={**body, "model": "gpt-4o-mini"}, headers=headers, timeout=10
                )
            except BaseException as exc:  # granian's endless wait: httpx.ReadTimeout
                answers[api] = exc

        clients = [threading.Thread(target=ask, args=(api,)) for api in REQUESTS]
        for client in clients:
            client.start()
        wait_for(lambda: sum(r.method == "POST" for r in fake_openai.requests) == len(REQUESTS))
        proc.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(15)
        assert answers.keys() == REQUESTS.keys()
        for api, answer in answers.items():
            # Anthropic's shape: a type only, and a 503 is its `overloaded_error`, whose status is 529.
            status = 529 if api == "messages" else 503
            assert isinstance(answer, httpx.Response) and answer.status_code == status, (api, answer)
            error = answer.json()["error"]
            assert "shutting down" in error["message"], (api, error)
            if api == "messages":
                assert answer.json()["type"] == "error" and error["type"] == "overloaded_error", error
            else:
                assert error["code"] == "server_shutting_down", (api, error)
        assert proc.wait(15) == 0
        log = (tmp_path / "weir.log").read_text()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
        with contextlib.closing(sqlite3.connect(tmp_path / "weir.db")) as db:
            rows = db.execute("SELECT status FROM usage_events WHERE tenant_id = ?", (tenant,)).fetchall()
        assert rows == [(503,)] * len(REQUESTS)  # the server's, not the client's 499
    finally:
        _stop(proc)


# `weir demo` with its model's download left out and its engine replaced by the fake OpenAI.
DEMO_IN_FRONT_OF = """
import sys
import engine.registry
import weir.demo
engine.registry.pull = lambda model: None
weir.demo.DEMO_CONFIG = '''
backends:
  - {{name: openai, type: openai, base_url: "%s", api_key: "%s"}}
models:
  - {{name: gpt-4o-mini, backend: openai}}
server: {{host: {host}, port: {port}}}
'''
from weir.cli import main
main()
"""


@pytest.mark.slow
def test_ctrl_c_under_weir_demo_drains_in_flight_streams(fake_openai: FakeOpenAI, tmp_path: Path) -> None:
    """Ctrl-C reaches the whole foreground process group: the demo and its gateway. The demo passed
    on a second SIGINT, with which uvicorn stops at once: the stream was cut off, undrained."""
    port = free_port()
    code = DEMO_IN_FRONT_OF % (fake_openai.base_url, fake_openai.api_key)
    log = (tmp_path / "demo.log").open("wb")
    demo = subprocess.Popen(
        [sys.executable, "-c", code, "demo", "--port", str(port), "--var-dir", str(tmp_path / "var")],
        env={**os.environ, "WEIR_USAGE_SPOOL": str(tmp_path / "spool")},
        stdout=log,
        stderr=log,
        start_new_session=True,  # a process group of its own, as a terminal's foreground job
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: demo.poll() is not None or _ready(base), timeout=60)
        fake_openai.fail_next(Fault.slow_stream(0.1))  # 20 chunks: about 2 s
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": WORDS}], "stream": True}
        words: list[str] = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        words.extend((choice["delta"].get("content") or "").split())
                    if len(words) == 1:
                        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C
        assert words == WORDS.split()  # drained: the stream in flight finished, whole
        assert demo.wait(30) == 0, (tmp_path / "demo.log").read_text()
    finally:
        _stop(demo)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz").status_code == 200
    except httpx.HTTPError:
        return False
