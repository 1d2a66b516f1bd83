"""Chat Completions parameters as each backend honours them, seen with the official OpenAI SDK (the
table in docs/gateway.md, "Chat parameters by backend").

What a vendor's API cannot carry and that changes the answer (token biases, repetition penalties,
audio output, web search) was dropped on the way to Claude and Gemini, which answered another
question than the one asked, or (a penalty for Gemini after 2.0) sent, and refused with a 400 that
named nothing: it is now a 400 `unsupported_parameter` naming it, nothing sent, so a route skips the
candidate (tests/routing/test_parameter_routing.py). `safety_identifier`, OpenAI's
successor to `user`, was dropped for Claude: it is now its `metadata.user_id`. `metadata` without
`store` reached OpenAI, which refuses it ("only allowed when 'store' is enabled"). And the stream
option `include_obfuscation` was dropped before OpenAI, whose padded chunks reach clients as they
come."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.config import Backend
from gateway.errors import InvalidRequest
from gateway.providers import anthropic, gemini
from gateway.types import ChatRequest, Message
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway

HI: Any = [{"role": "user", "content": "sky is blue"}]

# Parameters that change the answer and that neither Claude's API nor Gemini's (as Weir asks it) carries.
BIAS = {"logit_bias": {"50256": -100}}
AUDIO = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
SEARCH = {"web_search_options": {"search_context_size": "low"}}


def _refused(gateway: RunningGateway, model: str, stream: bool, **params: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model=model, messages=HI, stream=stream, **params)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    return body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("params", "param"),
    [
        (BIAS, "logit_bias"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -0.5}, "presence_penalty"),
        (AUDIO, "modalities"),
        (SEARCH, "web_search_options"),
    ],
    ids=["logit_bias", "frequency_penalty", "presence_penalty", "modalities", "web_search_options"],
)
def test_what_claude_cannot_honour_is_a_400_naming_it(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, params: dict[str, Any], param: str, stream: bool
) -> None:
    body = _refused(gateway, "claude-sonnet", stream, **params)
    assert body["param"] == param and body["code"] == "unsupported_parameter"
    assert "Anthropic" in body["message"]
    assert not fake_anthropic.requests  # refused before anything was sent


@pytest.mark.parametrize(
    ("params", "param"),
    [(BIAS, "logit_bias"), (AUDIO, "modalities"), (SEARCH, "web_search_options")],
    ids=["logit_bias", "modalities", "web_search_options"],
)
def test_what_gemini_cannot_honour_is_a_400_naming_it(
    gateway: RunningGateway, fake_gemini: FakeGemini, params: dict[str, Any], param: str
) -> None:
    body = _refused(gateway, "gemini-flash", False, **params)
    assert body["param"] == param and body["code"] == "unsupported_parameter"
    assert not fake_gemini.requests


@pytest.mark.parametrize("model", ["gemini-flash", "gemini-pro"])  # 2.5 Flash, 3 Pro
def test_a_penalty_is_a_400_for_gemini_after_2_0(
    gateway: RunningGateway, fake_gemini: FakeGemini, model: str
) -> None:
    # Google's own 400 ("Penalty is not enabled for models/...") named no parameter and ended a route.
    body = _refused(gateway, model, False, frequency_penalty=0.3)
    assert body["param"] == "frequency_penalty" and body["code"] == "unsupported_parameter"
    assert not fake_gemini.requests
    gateway.openai().chat.completions.create(
        model=model, messages=HI, frequency_penalty=0, presence_penalty=0
    )
    assert "frequencyPenalty" not in fake_gemini.last_request.json.get("generationConfig", {})


def test_what_changes_no_answer_is_left_out_for_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Penalties of 0 (what many clients send by default), a text-only modality, the seed and the
    caching, storage and length hints ask for no other answer: Claude is asked without them."""
    reply = gateway.openai().chat.completions.create(
        model="claude-sonnet",
        messages=HI,
        frequency_penalty=0,
        presence_penalty=0,
        modalities=["text"],
        seed=7,
        store=True,
        metadata={"team": "a"},
        prediction={"type": "content", "content": "sky is blue"},
        prompt_cache_key="thread-1",
        verbosity="low",
    )
    assert reply.choices[0].message.content
    sent = fake_anthropic.last_request.json
    assert set(sent) == {"model", "max_tokens", "messages"}


def test_safety_identifier_is_claudes_end_user_id(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    gateway.openai().chat.completions.create(
        model="claude-sonnet", messages=HI, safety_identifier="user-hash-1", user="old-style"
    )
    assert fake_anthropic.last_request.json["metadata"] == {"user_id": "user-hash-1"}
    gateway.openai().chat.completions.create(model="claude-sonnet", messages=HI, user="old-style")
    assert fake_anthropic.last_request.json["metadata"] == {"user_id": "old-style"}


def test_metadata_without_store_is_kept_from_openai(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    """OpenAI refuses `metadata` on a completion it does not store; it tags stored ones only."""
    reply = gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=HI, metadata={"team": "a"})
    assert reply.choices[0].message.content
    assert "metadata" not in fake_openai.last_request.json
    gateway.openai().chat.completions.create(
        model="gpt-4o-mini", messages=HI, metadata={"team": "a"}, store=True
    )
    sent = fake_openai.last_request.json
    assert sent["metadata"] == {"team": "a"} and sent["store"] is True


def test_openais_current_parameters_reach_it_as_sent(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    stream = gateway.openai().chat.completions.create(
        model="gpt-5",
        messages=HI,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        reasoning_effort="minimal",
        verbosity="low",
        prompt_cache_key="thread-1",
        prompt_cache_retention="24h",
        safety_identifier="user-hash-1",
        service_tier="flex",
        max_completion_tokens=50,
    )
    assert [c for c in stream if c.usage is not None]
    sent = fake_openai.last_request.json
    assert sent["stream_options"] == {"include_usage": True, "include_obfuscation": False}
    assert {k: sent[k] for k in ("reasoning_effort", "verbosity", "prompt_cache_key")} == {
        "reasoning_effort": "minimal",
        "verbosity": "low",
        "prompt_cache_key": "thread-1",
    }
    assert sent["prompt_cache_retention"] == "24h" and sent["safety_identifier"] == "user-hash-1"
    assert sent["service_tier"] == "flex" and sent["max_completion_tokens"] == 50


@pytest.mark.parametrize(
    ("adapter", "model"),
    [(anthropic.PROVIDER, "claude-sonnet-4-5"), (gemini.PROVIDER, "gemini-2.5-flash")],
    ids=["anthropic", "gemini"],
)
def test_tools_are_refused_before_parameters_on_every_adapter(adapter: Any, model: str) -> None:
    """A request no adapter but OpenAI's Responses API takes, for two reasons: each adapter names the
    same one first (its built-in tool), so the 400 a client of no able candidate reads does not depend
    on which vendor came first."""
    request = ChatRequest(
        model=model,
        messages=[Message(role="user", content="hi")],
        logit_bias={"50256": -100},
        responses={"tools": [{"type": "web_search"}]},
    )
    backend = Backend(name="b", type=adapter.name, base_url="http://127.0.0.1:9", api_key="k")
    with pytest.raises(InvalidRequest) as caught:
        adapter.chat_request(backend, request, model)
    assert caught.value.param == "tools[0].type" and caught.value.code == "unsupported_parameter"
