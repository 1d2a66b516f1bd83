"""The output-token cap (`limits.max_output_tokens`, or a config tenant's own): a request asking for
more is refused with 400 before anything goes upstream; one asking for nothing is sent with the cap, so
a backend's default can never run past it; every inbound API (chat, legacy completions, the Responses
API, Anthropic messages)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai}
limits: {max_output_tokens: 100}
tenants:
  - {name: acme, api_keys: ["sk-acme"]}
  - {name: big, api_keys: ["sk-big"], max_output_tokens: 1000}
"""
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def url(fake_openai: FakeOpenAI) -> Iterator[str]:
    config = parse_config(
        CONFIG, {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key}
    )
    with serve(create_app(config), free_port()) as base:
        yield base


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_over_the_cap_is_a_400_and_nothing_goes_upstream(url: str, fake_openai: FakeOpenAI) -> None:
    before = len(fake_openai.requests)
    for kwargs in ({"max_tokens": 101}, {"max_completion_tokens": 5000}):
        with pytest.raises(openai.BadRequestError) as caught:
            client(url, "sk-acme").chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, **kwargs)
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["code"] == "max_tokens_exceeded"
        assert error["param"] == next(iter(kwargs))
        assert "100" in error["message"]
    assert len(fake_openai.requests) == before


def test_within_the_cap_passes_as_asked_and_none_asked_gets_the_cap(
    url: str, fake_openai: FakeOpenAI
) -> None:
    client(url, "sk-acme").chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=100)
    sent = fake_openai.last_request.json
    assert sent["max_tokens"] == 100 and "max_completion_tokens" not in sent

    client(url, "sk-acme").chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert fake_openai.last_request.json["max_completion_tokens"] == 100


def test_a_config_tenant_has_its_own_cap(url: str, fake_openai: FakeOpenAI) -> None:
    client(url, "sk-big").chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=800)
    assert fake_openai.last_request.json["max_tokens"] == 800
    with pytest.raises(openai.BadRequestError):
        client(url, "sk-big").chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=1001)


def test_anthropic_inbound_is_capped_too(url: str, fake_openai: FakeOpenAI) -> None:
    api = anthropic.Anthropic(base_url=url, api_key="sk-acme", max_retries=0)
    before = len(fake_openai.requests)
    with pytest.raises(anthropic.BadRequestError) as caught:
        api.messages.create(model="gpt-4o-mini", max_tokens=500, messages=MESSAGES)  # type: ignore[arg-type]
    assert "max_tokens" in str(caught.value)
    assert len(fake_openai.requests) == before
    reply = api.messages.create(model="gpt-4o-mini", max_tokens=50, messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.content


def test_responses_inbound_is_capped_and_names_its_own_parameter(url: str, fake_openai: FakeOpenAI) -> None:
    responses = client(url, "sk-acme").responses
    with pytest.raises(openai.BadRequestError) as caught:
        responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=101)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "max_output_tokens"
    assert error["code"] == "max_tokens_exceeded"
    responses.create(model="gpt-4o-mini", input="hi")  # none asked: the cap is sent
    assert fake_openai.last_request.json["max_completion_tokens"] == 100


def test_legacy_completions_are_capped_too(url: str, fake_openai: FakeOpenAI) -> None:
    """`/v1/completions` went around the cap: 5,000 output tokens asked of a tenant allowed 100 were
    sent upstream as asked, and none asked left the backend's own default."""
    completions = client(url, "sk-acme").completions
    before = len(fake_openai.requests)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            completions.create(model="gpt-4o-mini", prompt="hi", max_tokens=5000, stream=stream)
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "max_tokens_exceeded"
        assert error["param"] == "max_tokens" and "100" in error["message"]
    assert len(fake_openai.requests) == before

    completions.create(model="gpt-4o-mini", prompt="hi", max_tokens=100)
    assert fake_openai.last_request.json["max_tokens"] == 100
    completions.create(model="gpt-4o-mini", prompt="hi")  # none asked: the cap is sent
    assert fake_openai.last_request.json["max_tokens"] == 100
    client(url, "sk-big").completions.create(model="gpt-4o-mini", prompt="hi", max_tokens=800)
    assert fake_openai.last_request.json["max_tokens"] == 800
