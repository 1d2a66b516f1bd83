"""Top-k sampling across vendors (the anthropic SDK takes it in `extra_body` since it dropped the argument): an Anthropic client's `top_k` was silently dropped on Claude itself
and on Gemini, and sent to OpenAI's API, which refuses an argument it does not know (a 400 that ended a
failover to it). It now reaches each vendor that samples by top-k under its name (Anthropic `top_k`,
Gemini `generationConfig.topK`, vLLM-style servers `top_k`) and is left out for OpenAI's own API."""

from __future__ import annotations

import openai
import pytest

from gateway.config import Backend
from gateway.providers import openai as openai_provider
from gateway.types import ChatRequest, Message
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway

HI = [{"role": "user", "content": "hi"}]


def test_an_anthropic_clients_top_k_reaches_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    gateway.anthropic().messages.create(
        model="claude-sonnet", max_tokens=10, messages=HI, extra_body={"top_k": 5}
    )  # type: ignore[arg-type]
    assert fake_anthropic.last_request.json["top_k"] == 5


def test_an_anthropic_clients_top_k_reaches_gemini(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    gateway.anthropic().messages.create(
        model="gemini-flash", max_tokens=10, messages=HI, extra_body={"top_k": 7}
    )  # type: ignore[arg-type]
    assert fake_gemini.last_request.json["generationConfig"]["topK"] == 7


def test_an_openai_clients_top_k_reaches_gemini_and_openai_compatible_servers(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    client = gateway.openai()
    client.chat.completions.create(model="gemini-flash", messages=HI, extra_body={"top_k": 3})  # type: ignore[arg-type]
    assert fake_gemini.last_request.json["generationConfig"]["topK"] == 3
    client.chat.completions.create(model="gpt-4o-mini", messages=HI, extra_body={"top_k": 3})  # type: ignore[arg-type]
    assert fake_openai.last_request.json["top_k"] == 3  # a vLLM-style server on 127.0.0.1


@pytest.mark.parametrize(
    ("base_url", "sent"),
    [
        ("https://api.openai.com/v1", False),
        ("https://acme.openai.azure.com/openai/deployments/gpt-4o", False),
        ("http://vllm.internal:8000/v1", True),
    ],
)
def test_top_k_is_left_out_for_openais_own_api_only(base_url: str, sent: bool) -> None:
    backend = Backend(name="b", type="openai", base_url=base_url, api_key="k")
    request = ChatRequest(model="m", messages=[Message(role="user", content="hi")], top_k=4)
    body = openai_provider.chat_request(backend, request, "gpt-4o").body
    assert (b'"top_k":4' in body) is sent


def test_a_top_k_of_the_wrong_type_is_a_400(gateway: RunningGateway) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(
            model="gpt-4o-mini", messages=HI, extra_body={"top_k": "many"}
        )  # type: ignore[arg-type]
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "top_k"
