"""Graceful shutdown of `weir serve`: SIGTERM lets in-flight streams finish (up to the deadline), the
usage events of those streams reach the ledger, and the process exits on its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.gateway import ADMIN
from tests.fixtures.net import free_port

ROOT = Path(__file__).resolve().parents[2]
WORDS = " ".join(f"w{i}" for i in range(20))


@pytest.mark.slow
@pytest.mark.parametrize("server", ["uvicorn"])  # granian 2.8 sometimes ignores SIGTERM: see gateway/cli.py
def test_sigterm_drains_in_flight_streams_then_exits(
    fake_openai: FakeOpenAI, tmp_path: Path, server: str
) -> None:
    config = tmp_path / "weir.yaml"
    config.write_text(
        f"""backends:
  - {{name: openai, type: openai, base_url: "{fake_openai.base_url}", api_key: "{fake_openai.api_key}"}}
models:
  - {{name: gpt-4o-mini, backend: openai, price: {{input: 0.15, output: 0.60}}}}
database_url: "sqlite+aiosqlite:///{tmp_path}/weir.db"
"""
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
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "weir.log").read_text()
            time.sleep(0.2)
        admin = httpx.Client(base_url=f"{base}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
        tenant = admin.post("/tenants", json={"name": "drained"}).json()
        key = admin.post(f"/tenants/{tenant['id']}/keys", json={}).json()["key"]

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
        proc.send_signal(signal.SIGTERM)
        client.join(30)
        assert words == WORDS.split()  # the stream in flight finished, whole
        assert proc.wait(30) == 0 or proc.returncode == -signal.SIGTERM
        with contextlib.closing(sqlite3.connect(tmp_path / "weir.db")) as db:
            rows = db.execute(
                "SELECT status, output_tokens, estimated FROM usage_events WHERE tenant_id = ?",
                (tenant["id"],),
            ).fetchall()
        assert rows == [(200, 20, 0)]  # written before exit, exactly once, not estimated
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
