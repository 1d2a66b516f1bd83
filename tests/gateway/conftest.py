"""What only the gateway tests use: `compat_gateway`, a gateway in front of `tests.fakes.compat`. The
session's gateway on the fake vendors and its helpers are shared by every folder:
tests/fixtures/vendor_gateway.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.config import parse_config
from tests.fakes.compat import compat_server
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway, running_gateway

COMPAT_CONFIG = """
backends:
  - {{name: compat, type: openai, base_url: "{url}/v1", api_key: "k"}}
models:
  - {{name: mistral-small, backend: compat}}
  - {{name: vllm-reasoner, backend: compat}}
  - {{name: gpt-4o-audio-preview, backend: compat}}
  - {{name: cut-short, backend: compat}}
  - {{name: vllm-served, backend: compat}}
  - {{name: ollama-parallel, backend: compat}}
  - {{name: sglang-parallel, backend: compat}}
routes:
  - {{name: cut-then-mistral, candidates: [{{model: cut-short}}, {{model: mistral-small}}], probe_interval: null}}
  - {{name: cut-then-vllm, candidates: [{{model: cut-short}}, {{model: vllm-served}}], probe_interval: null}}
  - {{name: cut-then-sglang, candidates: [{{model: cut-short}}, {{model: sglang-parallel}}], probe_interval: null}}
tenants:
  - {{name: demo, api_keys: ["{key}"]}}
"""


@pytest.fixture(scope="module")
def compat_gateway() -> Iterator[RunningGateway]:
    """A gateway in front of `tests.fakes.compat`: OpenAI-compatible servers' own ways (each of its
    models as a plain model, and `cut-then-mistral` / `cut-then-vllm` / `cut-then-sglang`: a stream
    cut after "Hello", resumed on Mistral / vLLM / SGLang)."""
    with serve(compat_server, free_port()) as upstream:
        config = parse_config(COMPAT_CONFIG.format(url=upstream, key=DEMO_KEY), {})
        with running_gateway(config) as gateway:
            yield gateway
