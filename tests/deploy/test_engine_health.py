"""The engine image's health check against the real engine: `weir engine serve` run with the image's
own command (on a free port), probed with the image's own HEALTHCHECK command. It must fail while the
model loads and pass once it serves, which is what the compose start-up order and the Kubernetes
startup probe rely on."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine import registry
from tests.deploy.artefacts import DEPLOY
from tests.deploy.dockerfiles import exec_form, parse
from tests.fixtures.net import free_port

ENGINE = DEPLOY / "docker" / "engine.Dockerfile"


@pytest.mark.slow
def test_engine_health_check_fails_while_loading_and_passes_once_serving() -> None:
    final = parse(ENGINE).stages[-1]
    (cmd,) = final.values("CMD")
    argv = exec_form(cmd)
    model = argv[argv.index("--model") + 1]
    registry.pull(model, quiet=True)  # what the image build does (a no-op when already pulled)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[0] = str(Path(sys.executable).with_name("weir"))
    (healthcheck,) = final.values("HEALTHCHECK")
    probe = [
        sys.executable if a == "python" else a.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        for a in exec_form(healthcheck.partition("CMD")[2].strip())
    ]

    def healthy() -> bool:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0

    assert not healthy()  # nothing listens yet
    server = subprocess.Popen([*argv, "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        loading_seen = False  # the port open, /health 503, and the probe failing
        while not healthy():
            assert server.poll() is None, server.stdout.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the engine did not become healthy within 240 s"
            with contextlib.suppress(httpx.TransportError):
                loading_seen |= httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 503
            time.sleep(0.5)
        assert loading_seen
        # Healthy means serving: a real completion goes through.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            temperature=0,
        )
        assert reply.usage is not None and reply.usage.completion_tokens > 0
    finally:
        server.terminate()
        server.wait(timeout=30)
