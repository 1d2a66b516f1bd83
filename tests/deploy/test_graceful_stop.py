"""What a rolling restart relies on: a gateway replica told to stop (SIGTERM, as Kubernetes and compose
do) refuses new connections, so the load balancer moves on, yet finishes the streams it is serving."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.deploy.artefacts import DEPLOY
from tests.deploy.processes import weir_serve
from tests.fakes import FakeOpenAI
from tests.fakes.faults import Fault

pytestmark = pytest.mark.slow  # a gateway start and a 2 s stream


def test_a_stopping_replica_finishes_its_stream_and_takes_no_new_work(
    fake_openai: FakeOpenAI, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "WEIR_DEMO_KEY": "sk-weir-drain",
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
    }
    for name in ("WEIR_DATABASE_URL", "WEIR_REDIS_URL"):
        env.pop(name, None)
    words = [f"word{i}" for i in range(20)]
    with weir_serve(DEPLOY / "compose" / "weir.yaml", env, tmp_path) as gateway:
        fake_openai.fail_next(Fault.slow_stream(0.1))  # one word per chunk, 0.1 s apart: ~2 s of stream
        client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="sk-weir-drain", max_retries=0)
        stream = client.chat.completions.create(
            model="gpt-4o-mini", stream=True, messages=[{"role": "user", "content": " ".join(words)}]
        )
        text: list[str] = []
        stopped_at: float | None = None
        refused_new: bool | None = None
        for chunk in stream:
            if stopped_at is None:
                gateway.process.send_signal(signal.SIGTERM)
                stopped_at = time.monotonic()
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if refused_new is None and time.monotonic() - stopped_at > 0.5:
                # Mid-stream, after the signal: a new connection is refused.
                try:
                    httpx.get(f"{gateway.base}/healthz", timeout=2)
                    refused_new = False
                except httpx.TransportError:
                    refused_new = True
        assert refused_new is True, "a stopping replica still accepted a connection"
        # The stream ran to its end: every word, and the SDK saw the terminator.
        assert "".join(text).split() == words
        assert stopped_at is not None and time.monotonic() - stopped_at > 1.0
        # uvicorn re-raises the SIGTERM it handled once it has drained: -SIGTERM is a clean stop too.
        assert gateway.process.wait(timeout=30) in (0, -signal.SIGTERM)
