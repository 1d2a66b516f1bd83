"""The benchmark's near-zero-cost upstream speaks OpenAI well enough for the official SDK."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mock_upstream.py"


@pytest.fixture
def mock_upstream(unused_port: int) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--port", str(unused_port), "--stream-chunks", "4"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", unused_port)) == 0:
                    break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{unused_port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_fixed_reply_and_stream_parse_with_the_sdk(mock_upstream: str) -> None:
    client = openai.OpenAI(base_url=mock_upstream, api_key="any", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    assert reply.choices[0].message.content == "Hello from the mock upstream."
    assert reply.usage.total_tokens == 18
    chunks = list(
        client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " word0 word1 word2 word3"
    assert chunks[-1].usage.completion_tokens == 4
