"""`weir serve` meeting what commonly stops a gateway at start: each is one `Error:` line on stderr naming
what failed and what to check, exit status 1, no traceback, and no server started."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.db import PG_ADMIN_URL
from tests.fixtures.net import free_port

ROOT = Path(__file__).resolve().parents[1]
WEIR = str(ROOT / ".venv/bin/weir")
BASE = """\
backends:
  - {name: m, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: x}
models:
  - {name: gpt, backend: m}
"""


def serve(tmp_path: Path, extra: str, port: int = 0) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "weir.yaml"
    config.write_text(BASE + extra)
    env = {k: v for k, v in os.environ.items() if k != "WEIR_DATABASE_URL"}
    env["WEIR_USAGE_SPOOL"] = str(tmp_path / "spool")
    # A gateway that starts anyway runs until the timeout: the test fails on TimeoutExpired.
    return subprocess.run(
        [WEIR, "serve", "--config", str(config), "--port", str(port)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
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
