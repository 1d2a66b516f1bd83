"""OpenAI's reasoning models (o-series, gpt-5) as candidates and fallbacks behind every inbound API.

They refuse `max_tokens` (they take `max_completion_tokens`) and sampling parameters other than the
defaults, as the fake OpenAI does for their ids. An Anthropic client always sends `max_tokens`, an
OpenAI client often does: a route that fails over to such a model must send the limit under the name
it takes, and a request it still cannot take (a temperature) must go on to the next candidate, or end
with a clear 400 when it is the only one, never with a 400 that blames the client for a fallback's
limits while the route's own model was merely overloaded.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from gateway.config import Backend
from gateway.providers import openai as openai_provider
from gateway.providers.base import CONTINUE_INSTRUCTION
from gateway.types import ChatRequest, Message
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway, full_config_text
from tests.routing.routed import FAST, ledger, route_header

HI: Any = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
MODELS = """\
  - {name: o4-mini, backend: openai}
  - {name: o3-mini, backend: openai}
  - {name: gpt-5-mini, backend: openai}
  - {name: gemini-25-pro, backend: gemini, model: gemini-2.5-pro}
"""
ROUTES = f"""\
routes:
  - {{name: claude-then-gpt5, candidates: [{{model: claude-sonnet}}, {{model: gpt-5}}], {FAST}}}
  - {{name: claude-then-o4, candidates: [{{model: claude-sonnet}}, {{model: o4-mini}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: claude-then-o4-only, candidates: [{{model: claude-sonnet}}, {{model: o4-mini}}], {FAST}}}
  - {{name: o3-first, candidates: [{{model: o3-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: gpt5-then-gemini-pro, candidates: [{{model: gpt-5}}, {{model: gemini-25-pro}}], {FAST}}}
"""
OVERLOADED = Fault.status(529)  # Anthropic's overload: retried once in place (FAST), then failed over


@pytest.fixture(scope="module")
def gateway_config() -> str:
    text = full_config_text()
    anchor = "  - {name: gpt-5, backend: openai}\n"
    assert anchor in text
    return text.replace(anchor, anchor + MODELS, 1) + ROUTES


def _claude_down(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.fail_next(OVERLOADED, times=2)


def _messages(gateway: RunningGateway, model: str, stream: bool, **kwargs: Any) -> tuple[str, dict[str, str]]:
    """The Anthropic client's answer text and the route header. (This SDK has no `temperature`
    argument any more; clients that send one, older SDKs among them, are sent it in `extra_body`.)"""
    client = gateway.anthropic()
    if not stream:
        raw = client.messages.with_raw_response.create(model=model, messages=HI, **kwargs)
        return "".join(b.text for b in raw.parse().content if b.type == "text"), route_header(raw)
    with client.messages.with_streaming_response.create(
        model=model, messages=HI, stream=True, **kwargs
    ) as response:
        text = ""
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("type") == "content_block_delta" and event["delta"].get("type") == "text_delta":
                    text += event["delta"]["text"]
        return text, route_header(response)


# --- the output limit ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_anthropic_clients_max_tokens_reaches_a_gpt5_fallback_as_max_completion_tokens(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    _claude_down(fake_anthropic)
    text, route = _messages(gateway, "claude-then-gpt5", stream, max_tokens=64)
    assert text == ECHO and route["candidate"] == "gpt-5"
    sent = fake_openai.last_request.json
    assert sent["model"] == "gpt-5" and sent["max_completion_tokens"] == 64 and "max_tokens" not in sent
    assert ledger(gateway) == [("anthropic", 529), ("anthropic", 529), ("openai", 200)]


@pytest.mark.parametrize("model", ["o4-mini", "o3-mini", "gpt-5-mini"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_openai_clients_max_tokens_reaches_a_reasoning_model_as_max_completion_tokens(
    gateway: RunningGateway, fake_openai: FakeOpenAI, model: str, stream: bool
) -> None:
    client = gateway.openai()
    if stream:
        chunks = client.chat.completions.create(model=model, messages=HI, max_tokens=50, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = client.chat.completions.create(model=model, messages=HI, max_tokens=50)
        text = reply.choices[0].message.content or ""
    assert text == ECHO
    sent = fake_openai.last_request.json
    assert sent["max_completion_tokens"] == 50 and "max_tokens" not in sent


def test_a_reasoning_primary_takes_the_openai_clients_max_tokens_instead_of_failing_over(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """o3-mini first: its 400 for `max_tokens` would have ended the request (a 400 never fails over)."""
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="o3-first", messages=HI, max_tokens=40
    )
    assert raw.parse().choices[0].message.content == ECHO
    assert route_header(raw)["candidate"] == "o3-mini" and not fake_anthropic.requests
    assert ledger(gateway) == [("openai", 200)]


def test_a_responses_clients_max_output_tokens_survives_a_failover_to_a_reasoning_model(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    _claude_down(fake_anthropic)
    raw = gateway.openai().responses.with_raw_response.create(
        model="claude-then-gpt5", input="one two three four five six", max_output_tokens=3
    )
    response = raw.parse()
    assert route_header(raw)["candidate"] == "gpt-5"
    # The limit held: three words, cut at the length, reported as the Responses API reports it.
    assert response.output_text == "one two three" and response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    sent = fake_openai.last_request.json
    assert sent["max_completion_tokens"] == 3 and "max_tokens" not in sent


def test_a_stream_cut_on_claude_continues_on_gpt5_within_the_anthropic_clients_max_tokens(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The continuation after a mid-stream break is a new request to the fallback, with the limit
    left: it too must name it as the reasoning model takes it."""
    fake_anthropic.fail_next(Fault.cut_stream(after=5))  # start, block start, ping, "one", " two"
    text, _ = _messages(gateway, "claude-then-gpt5", True, max_tokens=100)
    assert text.split() == ECHO.split()  # the whole answer, not one cut by a stream error event
    sent = fake_openai.last_request.json
    # The continuation: OpenAI answers a trailing assistant message afresh, so it is asked for the rest.
    assert sent["model"] == "gpt-5" and sent["messages"][-2] == {"role": "assistant", "content": "one two"}
    assert sent["messages"][-1] == {"role": "user", "content": CONTINUE_INSTRUCTION}
    assert "max_tokens" not in sent and 90 <= sent["max_completion_tokens"] < 100


# --- sampling parameters a reasoning model refuses -------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_temperature_the_reasoning_fallback_refuses_goes_on_to_the_next_candidate(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    _claude_down(fake_anthropic)
    text, route = _messages(gateway, "claude-then-o4", stream, max_tokens=64, extra_body={"temperature": 0.3})
    assert text == ECHO and route["candidate"] == "gpt-4o-mini"
    assert "o4-mini:400" in route["tried"]
    sent = fake_openai.last_request.json
    assert sent["model"] == "gpt-4o-mini" and sent["temperature"] == 0.3  # honoured, not dropped
    assert ledger(gateway) == [("anthropic", 529), ("anthropic", 529), ("openai", 400), ("openai", 200)]


def test_the_default_temperature_is_taken_by_the_reasoning_fallback(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    _claude_down(fake_anthropic)
    text, route = _messages(gateway, "claude-then-o4", False, max_tokens=64, extra_body={"temperature": 1.0})
    assert text == ECHO and route["candidate"] == "o4-mini"
    assert fake_openai.last_request.json["temperature"] == 1.0


def test_when_no_fallback_takes_the_temperature_the_client_sees_the_primarys_overload(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Not o4-mini's 400 about the temperature: the request is valid for the route's own model, which
    was only overloaded; the client retries later (a 400 says never to retry)."""
    _claude_down(fake_anthropic)
    with pytest.raises(anthropic.APIStatusError) as caught:
        _messages(gateway, "claude-then-o4-only", False, max_tokens=64, extra_body={"temperature": 0.3})
    assert caught.value.status_code >= 500
    assert caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


@pytest.mark.parametrize(
    ("parameter", "value", "code"),
    [
        ("temperature", 0.2, "unsupported_value"),
        ("top_p", 0.5, "unsupported_value"),
        ("logprobs", True, "unsupported_parameter"),
    ],
)
def test_a_reasoning_model_alone_answers_a_parameter_it_refuses_with_a_clear_400(
    gateway: RunningGateway, parameter: str, value: Any, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model="o4-mini", messages=HI, extra_body={parameter: value})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == parameter and error["code"] == code
    assert parameter in error["message"]


def test_no_reasoning_asked_of_a_gemini_2_5_pro_fallback_is_its_least_budget_not_its_400(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    """`reasoning_effort: "none"` (GPT-5.1's default, which clients send) was Gemini's budget 0, which
    2.5 Pro refuses ("This model only works in thinking mode"): the route ended with Gemini's 400
    once gpt-5 was down. 2.5 Pro gets its least budget, 128, its thoughts not asked for."""
    fake_openai.fail_next(500, times=2)
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="gpt5-then-gemini-pro", messages=HI, reasoning_effort="none"
    )
    chat = raw.parse()
    assert route_header(raw)["candidate"] == "gemini-25-pro" and chat.choices[0].message.content == ECHO
    assert fake_gemini.last_request.json["generationConfig"]["thinkingConfig"] == {"thinkingBudget": 128}
    assert (chat.choices[0].message.model_extra or {}).get("reasoning_content") is None


def test_a_responses_clients_temperature_skips_the_reasoning_fallback(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    _claude_down(fake_anthropic)
    raw = gateway.openai().responses.with_raw_response.create(
        model="claude-then-o4", input="one two three four five six", temperature=0.4, max_output_tokens=50
    )
    assert raw.parse().output_text == ECHO
    assert route_header(raw)["candidate"] == "gpt-4o-mini"
    sent = fake_openai.last_request.json
    assert sent["temperature"] == 0.4 and sent["max_completion_tokens"] == 50


# --- the limit's name on the wire, per backend ------------------------------------------------------


def _sent(base_url: str, model: str, field: str = "max_tokens", **backend: object) -> dict[str, object]:
    config = Backend(name="b", type="openai", base_url=base_url, **backend)  # type: ignore[arg-type]
    request = ChatRequest(model="public", messages=[Message(role="user", content="hi")], **{field: 77})  # type: ignore[arg-type]
    body = json.loads(openai_provider.chat_request(config, request, model).body)
    return {k: v for k, v in body.items() if k in ("max_tokens", "max_completion_tokens")}


@pytest.mark.parametrize(
    ("base_url", "model", "field", "expected"),
    [
        # OpenAI and Azure OpenAI: every current chat model takes max_completion_tokens, reasoning
        # models only that.
        ("https://api.openai.com/v1", "gpt-4o", "max_tokens", "max_completion_tokens"),
        (
            "https://acme.openai.azure.com/openai/deployments/prod",
            "prod",
            "max_tokens",
            "max_completion_tokens",
        ),
        # A reasoning model's id: wherever it is served (a proxy in front of OpenAI).
        ("http://10.0.0.7:4000/v1", "o4-mini", "max_tokens", "max_completion_tokens"),
        ("http://10.0.0.7:4000/v1", "gpt-5.1", "max_tokens", "max_completion_tokens"),
        # Servers that know only max_tokens: DeepSeek's and Mistral's APIs (Mistral refuses the other
        # name with a 422; what the gateway's own cap or a Responses client sets must still reach them).
        ("https://api.deepseek.com", "deepseek-chat", "max_completion_tokens", "max_tokens"),
        ("https://api.mistral.ai/v1", "mistral-large-latest", "max_completion_tokens", "max_tokens"),
        # Other OpenAI-compatible servers (vLLM, SGLang, Ollama, the bundled engine): as the client named it.
        ("http://10.0.0.8:8000/v1", "meta-llama/Llama-3.1-8B-Instruct", "max_tokens", "max_tokens"),
        ("http://10.0.0.8:8000/v1", "Qwen/Qwen3-8B", "max_completion_tokens", "max_completion_tokens"),
    ],
)
def test_the_output_limit_is_sent_under_the_name_the_backend_takes(
    base_url: str, model: str, field: str, expected: str
) -> None:
    assert _sent(base_url, model, field) == {expected: 77}


@pytest.mark.parametrize("configured", ["max_tokens", "max_completion_tokens"])
def test_a_backends_configured_limit_name_wins(configured: str) -> None:
    """An old vLLM refuses max_completion_tokens; an Azure deployment named after nothing may hold o3."""
    for base_url, model in (("http://10.0.0.8:8000/v1", "o3"), ("https://api.openai.com/v1", "gpt-4o")):
        for field in ("max_tokens", "max_completion_tokens"):
            assert _sent(base_url, model, field, max_tokens_field=configured) == {configured: 77}


def test_both_limits_are_sent_as_one() -> None:
    """A client that sent both: one field, the one `output_limit` (and the tenant's cap) goes by, not
    two, whose `max_tokens` a reasoning model refuses."""
    config = Backend(name="b", type="openai", base_url="https://api.openai.com/v1")
    request = ChatRequest(
        model="public",
        messages=[Message(role="user", content="hi")],
        max_tokens=500,
        max_completion_tokens=100,
    )
    body = json.loads(openai_provider.chat_request(config, request, "o4-mini").body)
    assert body["max_completion_tokens"] == 100 and "max_tokens" not in body
