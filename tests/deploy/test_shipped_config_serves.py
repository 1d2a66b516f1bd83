"""The gateway configuration shipped in deploy/ runs: `weir serve` (the images' command) started on it
as the container would, with its secrets from the environment, answers its health checks (the very
command of the image's HEALTHCHECK), serves the official OpenAI SDK through to a (fake) vendor, and
exposes the metrics the dashboard and alert rules read."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.artefacts import DEPLOY
from tests.deploy.dockerfiles import healthcheck_argv
from tests.deploy.metrics import exported_series
from tests.deploy.processes import weir_serve
from tests.fakes import FakeOpenAI
from tests.fixtures.net import free_port

DEMO_KEY = "sk-weir-deploy-test"


@pytest.fixture(scope="module")
def gateway(_fake_openai_server: FakeOpenAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """deploy/compose/weir.yaml served; deploy/k8s/weir.yaml differs only in the engine's address and
    is loaded by the real config loader in test_kubernetes.py."""
    env = {
        **os.environ,
        "WEIR_DEMO_KEY": DEMO_KEY,
        "OPENAI_BASE_URL": _fake_openai_server.base_url,
        "OPENAI_API_KEY": _fake_openai_server.api_key,
    }
    for name in ("WEIR_DATABASE_URL", "WEIR_REDIS_URL", "ANTHROPIC_API_KEY"):
        env.pop(name, None)
    with weir_serve(DEPLOY / "compose" / "weir.yaml", env, tmp_path_factory.mktemp("state")) as served:
        yield served.base


def test_health_checks_pass_with_the_images_own_command(gateway: str) -> None:
    port = int(gateway.rsplit(":", 1)[1])
    argv = healthcheck_argv(DEPLOY / "docker" / "gateway.Dockerfile", port)
    assert subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    # ... and the same command fails when nothing answers, so a dead container is marked unhealthy.
    dead = healthcheck_argv(DEPLOY / "docker" / "gateway.Dockerfile", free_port())
    assert subprocess.run(dead, capture_output=True, timeout=10).returncode != 0


def test_a_client_is_served_through_the_shipped_config(gateway: str, fake_openai: FakeOpenAI) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=DEMO_KEY, max_retries=0)
    assert {m.id for m in client.models.list()} == {"smollm2", "gpt-4o-mini", "claude-sonnet"}
    reply = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hello from deploy"}]
    )
    assert "hello from deploy" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert [r.path for r in fake_openai.requests if r.method == "POST"] == ["/v1/chat/completions"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-wrong", max_retries=0).models.list()

    # What Prometheus scrapes now carries the series the dashboard and the alerts select.
    text = httpx.get(f"{gateway}/metrics", timeout=5).text
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("weir_requests_total", "weir_request_duration_seconds_bucket", "weir_tokens_total"):
        assert name in samples and name in exported_series(), name
