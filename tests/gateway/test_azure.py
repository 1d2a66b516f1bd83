"""Azure OpenAI is an `openai` backend with its deployment URL, `api-key` header and `api-version`."""

from __future__ import annotations

import openai

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

CONFIG = """
backends:
  - name: azure
    type: openai
    base_url: ${AZURE_BASE_URL}
    headers: {api-key: "${AZURE_KEY}"}
    query: {api-version: "2024-10-21"}
models:
  - {name: gpt-4o, backend: azure}
"""


def test_azure_deployment(fake_openai: FakeOpenAI) -> None:
    env = {"AZURE_BASE_URL": fake_openai.azure_base_url("gpt-4o"), "AZURE_KEY": fake_openai.api_key}
    with serve(create_app(parse_config(CONFIG, env)), free_port()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "via azure"}]
        )
        chunks = list(
            client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "streamed too"}], stream=True
            )
        )
    assert reply.choices[0].message.content == "via azure"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "streamed too"
    sent = fake_openai.last_request
    assert sent.path == "/openai/deployments/gpt-4o/chat/completions"
    assert sent.query == {"api-version": "2024-10-21"}
    assert sent.headers["api-key"] == fake_openai.api_key and "authorization" not in sent.headers
