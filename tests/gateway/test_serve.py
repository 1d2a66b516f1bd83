"""`weir serve` as a user runs it: the issue's example config, JSON log lines on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.gateway.conftest import EXAMPLE


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
    weir = Path(sys.executable).with_name("weir")
    server = subprocess.Popen(
        [str(weir), "serve", "--config", str(config), "--port", str(port), "--server", server_kind],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "weir serve did not start"
            time.sleep(0.1)
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
