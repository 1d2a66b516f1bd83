"""`weir serve` meeting what commonly stops a gateway at start: each is one `Error:` line on stderr naming
what failed and what to check, exit status 1, no traceback, and no server started; a failure once those
checks have passed is one line too, with exit status 3 (gateway.startup)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.db import PG_ADMIN_URL
from tests.fixtures.net import free_port
from tests.fixtures.waiting import exited, wait_for

ROOT = Path(__file__).resolve().parents[1]
WEIR = str(ROOT / ".venv/bin/weir")
BASE = """\
backends:
  - {name: m, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: x}
models:
  - {name: gpt, backend: m}
"""


def serve(tmp_path: Path, extra: str, port: int = 0, *options: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "weir.yaml"
    config.write_text(BASE + extra)
    env = {k: v for k, v in os.environ.items() if k != "WEIR_DATABASE_URL"}
    env["WEIR_USAGE_SPOOL"] = str(tmp_path / "spool")
    env["WEIR_ADMIN_TOKEN"] = "wa-startup-test-0123456789"  # else one is made and shown on stderr
    # A gateway that starts anyway runs until the timeout: the test fails on TimeoutExpired.
    return subprocess.run(
        [WEIR, "serve", "--config", str(config), "--port", str(port), *options],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], *words: str, status: int = 1) -> None:
    assert result.returncode == status, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    if status == 1:  # refused before any server started
        assert "gateway_listening" not in result.stdout


def test_an_unreachable_admin_db_is_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    result = serve(tmp_path, f"database_url: postgresql://weir:secret@127.0.0.1:{port}/weir\n")
    assert_one_error_line(result, f"127.0.0.1:{port}", "is the database server up")
    assert "secret" not in result.stderr  # the password is masked


@pytest.mark.postgres
def test_an_unknown_database_is_one_line(tmp_path: Path) -> None:
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/weir_no_such_database"
    assert_one_error_line(
        serve(tmp_path, f"database_url: {url}\n"), "weir_no_such_database", "create the database"
    )


@pytest.mark.postgres
def test_an_unknown_database_user_is_one_line(tmp_path: Path) -> None:
    url = PG_ADMIN_URL.replace("postgresql://postgres@", "postgresql://weir_no_such_role:pw@")
    assert_one_error_line(serve(tmp_path, f"database_url: {url}\n"), "weir_no_such_role", "check the user")


def test_an_admin_db_without_schema_and_no_auto_migrate_says_weir_db_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/weir.db"
    result = serve(tmp_path, f"database_url: {url}\nauto_migrate: false\n")
    assert_one_error_line(result, "has no schema", "weir db upgrade")


def test_a_sqlite_path_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = serve(tmp_path, f"database_url: sqlite:///{tmp_path}/file/var/weir.db\n")
    assert_one_error_line(result, "Not a directory", "directory exists and is writable")


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(tmp_path, "", port=port)
    assert_one_error_line(result, f"127.0.0.1:{port}", "already in use", "--port")


def test_an_unreadable_secret_file_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "weir.yaml"
    config.write_text(BASE.replace("api_key: x", 'api_key: "${VENDOR_KEY}"'))
    env = {**os.environ, "VENDOR_KEY_FILE": str(tmp_path / "missing")}
    env.pop("VENDOR_KEY", None)
    result = subprocess.run(
        [WEIR, "serve", "--config", str(config), "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert_one_error_line(result, "VENDOR_KEY_FILE", "does not exist")


def migrated_by_a_newer_weir(path: Path) -> str:
    """A SQLite admin DB at a revision this Weir does not know: its migration at start fails, after
    the checks (which, with auto_migrate, only ask that the DB answers)."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        db.execute("INSERT INTO alembic_version VALUES ('f00dcafe0099')")
    return f"database_url: sqlite:///{path}\n"


@pytest.mark.parametrize("server_kind", ["uvicorn", "granian"])
def test_a_migration_that_fails_after_the_checks_is_one_line(tmp_path: Path, server_kind: str) -> None:
    """It was the server's `Application startup failed` after a traceback of a hundred lines, with
    exit status 3 (uvicorn) or 1 (granian, as for any worker's end)."""
    result = serve(tmp_path, migrated_by_a_newer_weir(tmp_path / "weir.db"), 0, "--server", server_kind)
    assert_one_error_line(result, "admin DB sqlite", "f00dcafe0099", "a newer version of Weir", status=3)
    [failed] = [line for line in map(json.loads, result.stdout.splitlines()) if "error" in line]
    assert failed["event"] == "gateway_startup_failed" and "exception" not in failed


def test_log_level_debug_logs_a_failed_starts_traceback(tmp_path: Path) -> None:
    result = serve(tmp_path, migrated_by_a_newer_weir(tmp_path / "weir.db"), 0, "--log-level", "debug")
    assert result.returncode == 3, result
    assert result.stderr.startswith("Error: admin DB") and "Traceback" not in result.stderr
    failures = [
        line
        for line in map(json.loads, result.stdout.splitlines())
        if line["event"] == "gateway_startup_failed"
    ]
    assert [("exception" in line) for line in failures] == [False, True]
    assert "ResolutionError: No such revision or branch 'f00dcafe0099'" in failures[1]["exception"]


async def test_a_failed_start_nothing_foresaw_names_the_exception_and_the_debug_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the server is told of a failed start (and logs) is no traceback, and the failure file gets
    the exception's one line, out of the task group Litestar's lifespan wraps it in."""
    from gateway.startup import FAILURE_FILE_ENV, failure_said, reporting_startup_failure

    monkeypatch.setenv(FAILURE_FILE_ENV, str(tmp_path / "failure"))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "Traceback (most recent call last): ..."})
        raise ExceptionGroup("unhandled errors in a TaskGroup", [KeyError("routes")])

    async def receive() -> dict[str, str]:
        return {"type": "lifespan.startup"}

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    await reporting_startup_failure(app)({"type": "lifespan"}, receive, send)
    assert sent == [{"type": "lifespan.startup.failed", "message": ""}]
    assert failure_said(tmp_path / "failure") == (
        "the gateway failed to start: KeyError: 'routes' (--log-level debug logs the traceback)"
    )


def children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_granian_worker_that_dies_stops_the_gateway_with_one_line(tmp_path: Path) -> None:
    """granian's worker killed (the OOM killer, a crash in native code): its main process ended with
    status 1 and only a JSON line on stdout, the status a bad config gets."""
    config = tmp_path / "weir.yaml"
    config.write_text(BASE)
    port = free_port()
    server = subprocess.Popen(
        [WEIR, "serve", "--config", str(config), "--port", str(port), "--server", "granian"],
        env={**os.environ, "WEIR_USAGE_SPOOL": str(tmp_path / "spool")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: server.poll() is not None or _ready(port), timeout=30)
        [worker] = children(server.pid)
        os.kill(worker, signal.SIGKILL)
        stdout, stderr = server.communicate(timeout=20)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 4, (stdout, stderr)
    [line] = stderr.splitlines()
    assert line.startswith("Error: the gateway's server worker (granian) exited unexpectedly"), line
    assert "start it again" in line


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_granian_worker_exits_when_its_main_process_is_killed(tmp_path: Path) -> None:
    """granian's main process SIGKILLed left its worker serving the port for ever, unsupervised (with
    the engines it supervises), and a restarted `weir serve` found the port taken."""
    config = tmp_path / "weir.yaml"
    config.write_text(BASE)
    port = free_port()
    server = subprocess.Popen(
        [WEIR, "serve", "--config", str(config), "--port", str(port), "--server", "granian"],
        env={**os.environ, "WEIR_USAGE_SPOOL": str(tmp_path / "spool")},
        stdout=subprocess.DEVNULL,
    )
    worker = None
    try:
        wait_for(lambda: server.poll() is not None or _ready(port), timeout=30)
        [worker] = children(server.pid)
        server.kill()
        server.wait(10)
        wait_for(lambda: exited(worker), timeout=10)
        assert not _ready(port)
    finally:
        server.kill()
        server.wait(10)
        if worker is not None and not exited(worker):
            os.kill(worker, signal.SIGKILL)


TAKEN_AFTER_THE_CHECK = """\
import gateway.cli
gateway.cli.check_before_serving = lambda *_: None  # as if another process took the port since
from weir.cli import main
main()
"""


@pytest.mark.parametrize("server_kind", ["uvicorn", "granian"])
def test_a_port_taken_after_the_check_is_one_line(tmp_path: Path, server_kind: str) -> None:
    """uvicorn binds once the app has started (a migration, an engine: seconds after the check), and
    another process may take the port meanwhile: that was a JSON line on stdout and exit status 3 with
    nothing on stderr (uvicorn), or a traceback (granian)."""
    config = tmp_path / "weir.yaml"
    config.write_text(BASE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--config", str(config), "--port", str(port), "--server", server_kind]
        result = subprocess.run(
            [sys.executable, "-c", TAKEN_AFTER_THE_CHECK, *argv],
            env={**os.environ, "WEIR_USAGE_SPOOL": str(tmp_path / "spool")},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert_one_error_line(result, f"cannot listen on 127.0.0.1:{port}", "already in use", "--port", status=3)


def test_the_gateway_weir_demo_started_exits_when_the_demo_is_killed(tmp_path: Path) -> None:
    """`weir demo` runs `weir serve` as a child: a SIGKILLed demo left that gateway serving the port
    (and its engine) for ever. The demo names itself in WEIR_GATEWAY_PARENT_PID; a stand-in here."""
    config = tmp_path / "weir.yaml"
    config.write_text(BASE)
    port = free_port()
    demo = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = subprocess.Popen(
        [WEIR, "serve", "--config", str(config), "--port", str(port)],
        env={
            **os.environ,
            "WEIR_USAGE_SPOOL": str(tmp_path / "spool"),
            "WEIR_GATEWAY_PARENT_PID": str(demo.pid),
        },
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: server.poll() is not None or _ready(port), timeout=30)
        assert server.poll() is None
        demo.kill()
        demo.wait(10)
        assert server.wait(10) == 0  # drained: the SIGTERM's clean stop
    finally:
        for process in (demo, server):
            process.kill()
            process.wait(10)


TINY_ENGINE = str(ROOT / "tests/gateway/tiny_engine.py")


@pytest.mark.parametrize("server_kind", ["uvicorn", "granian"])
def test_weir_serve_starts_its_engine_and_answers_from_it(tmp_path: Path, server_kind: str) -> None:
    """`make run`'s path: `weir serve` supervising a `weir engine serve` of its own. The engine, a `weir`
    process, read an environment variable `weir serve` sets for its worker (named `WEIR_..._FILE`) as a
    secret file that did not exist, and exited at once, restarted forever. The real CLI on both sides."""
    port, engine_port = free_port(), free_port()
    command = [sys.executable, TINY_ENGINE, "engine", "serve", "--model", "tiny", "--port", str(engine_port)]
    config = tmp_path / "weir.yaml"
    config.write_text(
        f"backends:\n  - {{name: local, type: engine, model: tiny, port: {engine_port}, "
        f"command: {json.dumps(command)}}}\nmodels:\n  - {{name: tiny, backend: local, model: tiny}}\n"
        "tenants:\n  - {name: t, api_keys: [sk-startup-test-key-0123456789]}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "WEIR_DATABASE_URL"}
    env["WEIR_USAGE_SPOOL"] = str(tmp_path / "spool")
    env["WEIR_ADMIN_TOKEN"] = "wa-startup-test-0123456789"
    argv = [WEIR, "serve", "--config", str(config), "--port", str(port), "--server", server_kind]
    server = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(lambda: _ready(port), timeout=60)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"authorization": "Bearer sk-startup-test-key-0123456789"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3, reply.text
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=30)
    assert "does not exist" not in out, out
    assert "engine_exited" not in out, out
