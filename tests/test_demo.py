"""`make run` promise: `weir demo` serves the real SmolLM2 through the gateway, and the curl and SDK
examples it prints work exactly as printed."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.net import free_port

pytestmark = pytest.mark.slow


def test_demo_prints_examples_that_work(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "WEIR_DEMO_KEY": "sk-weir-test-demo-key"}
    process = subprocess.Popen(
        [sys.executable, "-m", "weir.cli", "demo", "--port", str(port), "--var-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output = ""
        deadline = time.monotonic() + 600
        assert process.stdout is not None
        while "Stop: Ctrl-C" not in output and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            output += line
        assert "Stop: Ctrl-C" in output, output
        assert "sk-weir-test-demo-key" in output  # the key from the environment is the one accepted

        curl = re.search(r"^  (curl .*?)\n\n", output, re.S | re.M)
        assert curl is not None, output
        reply = subprocess.run(curl.group(1), shell=True, capture_output=True, text=True, timeout=120)
        assert '"chat.completion"' in reply.stdout and '"content"' in reply.stdout, reply.stdout

        snippet = re.search(r"^  (python -c '.*?\n')", output, re.S | re.M)
        assert snippet is not None, output
        python = snippet.group(1).replace("python -c", f"{sys.executable} -c", 1)
        reply = subprocess.run(python, shell=True, capture_output=True, text=True, timeout=120)
        assert reply.returncode == 0, reply.stderr
        assert reply.stdout.strip(), "the SDK example printed no reply"

        # Embedded defaults keep a ledger: both replies land in the SQLite admin DB (written in batches).
        rows = 0
        for _ in range(60):
            with sqlite3.connect(tmp_path / "weir.db") as db:
                rows = db.execute("SELECT count(*) FROM usage_events WHERE status = 200").fetchone()[0]
            if rows >= 2:
                break
            time.sleep(0.5)
        assert rows == 2

        wrong = subprocess.run(
            curl.group(1).replace("sk-weir-test-demo-key", "sk-wrong"),
            shell=True,
            capture_output=True,
            text=True,
        )
        assert "invalid_api_key" in wrong.stdout or "401" in wrong.stdout or "error" in wrong.stdout
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def test_demo_exits_at_once_with_the_engines_error_when_the_model_cannot_load(tmp_path: Path) -> None:
    """A model that could not load was restarted for ever, and `weir demo` waited 900 s without a word.
    Now the gateway gives up on it and the demo exits non-zero as soon as /readyz says so, with the
    engine's own error. The pulled model here is a link to a file that is gone."""
    models = tmp_path / "models" / "smollm2-135m"
    models.mkdir(parents=True)
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(tmp_path / "deleted.gguf")
    env = {**os.environ, "WEIR_MODELS_DIR": str(tmp_path / "models")}
    argv = ["demo", "--port", str(free_port()), "--var-dir", str(tmp_path / "var")]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "weir.cli", *argv], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30  # not 900 s
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: the bundled engine did not start: could not load 'smollm2-135m': "), error
    assert "No such file or directory" in error
