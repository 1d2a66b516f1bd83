"""Reasoning across vendors: Anthropic thinking (budgets, signed blocks, the tool loop), OpenAI's
reasoning_effort, DeepSeek's reasoning_content and Gemini's thoughts, with the official SDKs as
clients, and the pure translations underneath."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import msgspec
import openai as openai_sdk
import pytest

from gateway.anthropic_inbound import MessagesRequest, from_canonical, stream_events, to_canonical
from gateway.api.openai import render_chat, render_chunk
from gateway.config import Backend
from gateway.errors import InvalidRequest
from gateway.estimate import chunk_text_bytes
from gateway.providers import anthropic as anthropic_provider
from gateway.providers import gemini, openai
from gateway.providers.base import effort_for_budget
from gateway.types import (
    AssistantMessage,
    ChatChunk,
    ChatRequest,
    ChatResponse,
    Choice,
    ChunkChoice,
    Delta,
    ReasoningBlock,
    RedactedReasoning,
)
from routing.stats import RoutingStats
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fakes.gemini import check_thinking
from tests.fakes.server import Invalid
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway

THINKING = {"type": "enabled", "budget_tokens": 1024}
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
OPENAI_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
INTERNAL = ("signature", "reasoning_blocks", "redacted_reasoning", "reasoning_signature")


def _post_raw(gateway: RunningGateway, body: dict[str, Any]) -> str:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {DEMO_KEY}"},
        timeout=20,
    )
    assert response.status_code == 200, response.text
    return response.text


def _stream_reasoning(raw: str) -> tuple[str, str]:
    """(reasoning_content, content) joined from an OpenAI SSE stream's deltas."""
    reasoning, content = [], []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices") or ():
            reasoning.append(choice["delta"].get("reasoning_content") or "")
            content.append(choice["delta"].get("content") or "")
    return "".join(reasoning), "".join(content)


# --- Anthropic clients to Claude -----------------------------------------------------------------


def test_thinking_reaches_claude_and_comes_back_signed(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    message = gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=2000,
        thinking=THINKING,
        messages=[{"role": "user", "content": "a b"}],
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == THINKING and sent["max_tokens"] == 2000
    assert [block.type for block in message.content] == ["thinking", "text"]
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking == "Let me think about: a b"
    assert thinking.signature == fake_anthropic.sign(thinking.thinking)
    assert message.content[1].text == "a b"
    # Anthropic counts thinking in output_tokens and (this model) reports no split: the Anthropic
    # client sees its report as it was; the ledger's reasoning is the thinking text's estimate,
    # "Let me think about: a b" (23 bytes) at 4 bytes a token, within the output and not billed twice.
    assert message.usage.output_tokens == 6 + 2 and message.usage.output_tokens_details is None
    [event] = gateway.sink.events
    assert (event.usage.output_tokens, event.usage.reasoning_tokens) == (8, 6)
    assert event.usage.reasoning_estimated


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_claudes_thinking_is_estimated_for_the_ledger_openai_clients_and_routing(
    gateway: RunningGateway, stream: bool
) -> None:
    """Claude's thinking, billed inside `output_tokens` with no split reported, is estimated from
    the thinking received (6 of the answer's 8 tokens): in the ledger (marked estimated), in an
    OpenAI client's `reasoning_tokens`, and in what routing learns, so that `cheapest` prices it and
    `lowest_latency` expects it after the first (thinking) token. Before, all of them saw none."""
    ask = {
        "model": "claude-sonnet",
        "reasoning_effort": "low",
        "messages": [{"role": "user", "content": "a b"}],
    }
    client = gateway.openai()
    if stream:
        chunks = list(
            client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
        )
        usage = chunks[-1].usage
    else:
        usage = client.chat.completions.create(**ask).usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert (usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens) == (8, 6)
    [event] = gateway.sink.events
    assert (event.usage.output_tokens, event.usage.reasoning_tokens) == (8, 6)
    assert event.usage.reasoning_estimated
    stats = RoutingStats()
    stats.record(event)
    learned = stats.get(event.backend, event.model)
    assert learned.reasoning_tokens == 6  # `cheapest`'s reasoning term
    assert learned.streams_reasoning is stream  # `lowest_latency` expects it after the first token


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_claudes_own_thinking_count_wins_and_reaches_anthropic_clients_unchanged(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """A model that reports `output_tokens_details.thinking_tokens` (the full thinking, though the
    text returned may be a summary): that count, not an estimate, everywhere."""
    fake_anthropic.set_next_usage(output_tokens=50, reasoning_tokens=40)
    ask: dict[str, Any] = {
        "model": "claude-sonnet",
        "max_tokens": 2000,
        "thinking": THINKING,
        "messages": [{"role": "user", "content": "a b"}],
    }
    client = gateway.anthropic()
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**ask)
    assert message.usage.output_tokens == 50
    assert message.usage.output_tokens_details is not None
    assert message.usage.output_tokens_details.thinking_tokens == 40
    [event] = gateway.sink.events
    assert (event.usage.output_tokens, event.usage.reasoning_tokens) == (50, 40)
    assert not event.usage.reasoning_estimated
    fake_anthropic.set_next_usage(output_tokens=50, reasoning_tokens=40)
    usage = (
        gateway.openai()
        .chat.completions.create(
            model="claude-sonnet", reasoning_effort="low", messages=[{"role": "user", "content": "a b"}]
        )
        .usage
    )
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 40


def test_thinking_disabled_sends_no_thinking(gateway: RunningGateway, fake_anthropic: FakeAnthropic) -> None:
    message = gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=100,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "a b"}],
    )
    assert "thinking" not in fake_anthropic.last_request.json
    assert [block.type for block in message.content] == ["text"]


def test_thinking_stream_event_sequence(gateway: RunningGateway, fake_anthropic: FakeAnthropic) -> None:
    events = list(
        gateway.anthropic().messages.create(
            model="claude-sonnet",
            max_tokens=2000,
            thinking=THINKING,
            messages=[{"role": "user", "content": "a b"}],
            stream=True,
        )
    )
    shape = []
    for event in events:
        if event.type == "content_block_start":
            shape.append(("start", event.index, event.content_block.type))
        elif event.type == "content_block_delta":
            shape.append(("delta", event.index, event.delta.type))
        elif event.type == "content_block_stop":
            shape.append(("stop", event.index, ""))
        else:
            shape.append((event.type, -1, ""))
    # (The SDK does not yield pings.) Thinking deltas one word each ("Let me think about: a b"), then its signature, then the text.
    assert shape == [
        ("message_start", -1, ""),
        ("start", 0, "thinking"),
        *[("delta", 0, "thinking_delta")] * 6,
        ("delta", 0, "signature_delta"),
        ("stop", 0, ""),
        ("start", 1, "text"),
        *[("delta", 1, "text_delta")] * 2,
        ("stop", 1, ""),
        ("message_delta", -1, ""),
        ("message_stop", -1, ""),
    ]
    thought = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    [signature] = [
        e.delta.signature
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "signature_delta"
    ]
    assert thought == "Let me think about: a b" and signature == fake_anthropic.sign(thought)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_loop_with_thinking_sends_the_signed_block_back(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    client = gateway.anthropic()
    messages: list[dict[str, Any]] = [{"role": "user", "content": 'call get_weather {"city": "Lima"}'}]
    ask = dict(model="claude-sonnet", max_tokens=2000, thinking=THINKING, tools=[WEATHER])
    if stream:
        with client.messages.stream(messages=messages, **ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(messages=messages, **ask)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert fake_anthropic.last_request.json["thinking"] == THINKING
    [tool_use] = [block for block in message.content if block.type == "tool_use"]
    returned = [block.model_dump(exclude_none=True) for block in message.content]
    messages += [
        {"role": "assistant", "content": returned},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "foggy"}],
        },
    ]
    answer = client.messages.create(messages=messages, **ask)
    sent = fake_anthropic.last_request.json["messages"][1]
    assert sent["content"][0] == returned[0]  # the thinking block, with its signature, intact and first
    assert [block["type"] for block in sent["content"]] == ["thinking", "text", "tool_use"]
    text = answer.content[-1].text
    assert text.startswith("Tool get_weather returned: ") and "foggy" in text

    # Anthropic's own 400 reaches the client for a tampered signature.
    tampered = [{**returned[0], "thinking": "something else"}, *returned[1:]]
    with pytest.raises(anthropic.BadRequestError, match="signature"):
        client.messages.create(
            messages=[messages[0], {"role": "assistant", "content": tampered}, messages[2]], **ask
        )
    # A tool loop without the thinking (another candidate's turn, or a client that dropped it), which
    # Anthropic refuses beside thinking, is answered without thinking (tests/routing/test_claude_code).
    unthought = client.messages.create(
        messages=[messages[0], {"role": "assistant", "content": returned[1:]}, messages[2]], **ask
    )
    assert "thinking" not in fake_anthropic.last_request.json
    assert [block.type for block in unthought.content] == ["text"]


# --- OpenAI clients to Claude --------------------------------------------------------------------


def test_reasoning_effort_becomes_a_thinking_budget(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    raw = _post_raw(
        gateway,
        {
            "model": "claude-sonnet",
            "reasoning_effort": "low",
            "messages": [{"role": "user", "content": "a b"}],
        },
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert sent["max_tokens"] == anthropic_provider.DEFAULT_MAX_TOKENS + 1024  # the answer's room stays
    message = json.loads(raw)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "a b", "reasoning_content": "Let me think about: a b"}
    assert not any(word in raw for word in INTERNAL)  # no signatures for OpenAI clients

    response = gateway.openai().chat.completions.create(
        model="claude-sonnet", reasoning_effort="low", messages=[{"role": "user", "content": "a b"}]
    )
    assert response.choices[0].message.model_extra == {"reasoning_content": "Let me think about: a b"}


def test_reasoning_effort_stream_to_claude(gateway: RunningGateway) -> None:
    body = {
        "model": "claude-sonnet",
        "reasoning_effort": "high",
        "stream": True,
        "messages": [{"role": "user", "content": "a b"}],
    }
    raw = _post_raw(gateway, body)
    assert _stream_reasoning(raw) == ("Let me think about: a b", "a b")
    assert not any(word in raw for word in INTERNAL)


@pytest.mark.parametrize(
    ("effort", "max_tokens", "budget"),
    [
        ("medium", 2000, 1999),  # clamped below max_tokens, which thinking counts toward
        ("low", 1024, None),  # not even the minimum budget fits: no thinking
        ("high", 30000, 16384),
        ("minimal", 100, None),
    ],
)
def test_effort_budget_fits_max_tokens(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, effort: str, max_tokens: int, budget: int | None
) -> None:
    response = gateway.openai().chat.completions.create(
        model="claude-sonnet",
        reasoning_effort=effort,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": "a b"}],
    )
    sent = fake_anthropic.last_request.json
    assert sent["max_tokens"] == max_tokens
    assert sent.get("thinking") == ({"type": "enabled", "budget_tokens": budget} if budget else None)
    reasoning = (response.choices[0].message.model_extra or {}).get("reasoning_content")
    assert (reasoning is not None) == (budget is not None)


def test_openai_tool_loop_with_effort_leaves_thinking_out_where_claude_would_refuse(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    client = gateway.openai()
    messages: list[dict[str, Any]] = [{"role": "user", "content": 'call get_weather {"city": "Oslo"}'}]
    first = client.chat.completions.create(
        model="claude-sonnet", reasoning_effort="low", messages=messages, tools=[OPENAI_WEATHER]
    )
    assert fake_anthropic.last_request.json["thinking"]["budget_tokens"] == 1024
    [call] = first.choices[0].message.tool_calls or []
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),  # reasoning_content comes back: ignored
        {"role": "tool", "tool_call_id": call.id, "content": "snow"},
    ]
    answer = client.chat.completions.create(
        model="claude-sonnet", reasoning_effort="low", messages=messages, tools=[OPENAI_WEATHER]
    )
    # An OpenAI client cannot send the signed thinking back, so this turn goes without thinking.
    assert "thinking" not in fake_anthropic.last_request.json
    assert "snow" in (answer.choices[0].message.content or "")


# --- DeepSeek and Gemini -------------------------------------------------------------------------


def test_deepseek_reasoning_content_passes_through(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI
) -> None:
    client = gateway.openai()
    response = client.chat.completions.create(
        model="deepseek-reasoner", messages=[{"role": "user", "content": "a b"}]
    )
    assert response.choices[0].message.content == "a b"
    assert response.choices[0].message.model_extra == {"reasoning_content": "The user wants: a b"}
    reported = fake_deepseek.last_usage
    assert response.usage is not None and response.usage.completion_tokens == reported.output_tokens
    assert response.usage.completion_tokens_details.reasoning_tokens == reported.reasoning_tokens > 0
    event = gateway.sink.events[-1]
    assert (event.usage.output_tokens, event.usage.reasoning_tokens) == (
        reported.output_tokens,
        reported.reasoning_tokens,
    )
    raw = _post_raw(
        gateway,
        {"model": "deepseek-reasoner", "stream": True, "messages": [{"role": "user", "content": "a b"}]},
    )
    assert _stream_reasoning(raw) == ("The user wants: a b", "a b")


def test_anthropic_client_sees_other_vendors_reasoning_unsigned_and_it_is_never_sent_to_claude(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    client = gateway.anthropic()
    asked = [{"role": "user", "content": "a b"}]
    plain = client.messages.create(model="deepseek-reasoner", max_tokens=2000, messages=asked)
    assert [block.type for block in plain.content] == ["text"]  # no thinking asked, none shown
    message = client.messages.create(
        model="deepseek-reasoner", max_tokens=2000, thinking=THINKING, messages=asked
    )
    assert fake_deepseek.last_request.json["reasoning_effort"] == "low"  # the budget, as an effort
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "The user wants: a b"
    assert message.content[0].signature == ""
    with client.messages.stream(
        model="deepseek-reasoner", max_tokens=2000, thinking=THINKING, messages=asked
    ) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The user wants: a b"

    # Sent back, the unsigned block never reaches Claude (which would refuse its signature); DeepSeek
    # gets its text as reasoning_content, the field its thinking mode reads back.
    history = [*asked, {"role": "assistant", "content": [b.model_dump() for b in message.content]}]
    history.append({"role": "user", "content": "c d"})
    client.messages.create(model="claude-sonnet", max_tokens=2000, thinking=THINKING, messages=history)
    assert fake_anthropic.last_request.json["messages"][1]["content"] == [{"type": "text", "text": "a b"}]
    client.messages.create(model="deepseek-reasoner", max_tokens=2000, messages=history)
    assert fake_deepseek.last_request.json["messages"][1] == {
        "role": "assistant",
        "content": "a b",
        "reasoning_content": "The user wants: a b",
    }


def test_gemini_thoughts_become_reasoning_content(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    client = gateway.openai()
    response = client.chat.completions.create(
        model="gemini-flash", reasoning_effort="low", messages=[{"role": "user", "content": "a b"}]
    )
    config = fake_gemini.last_request.json["generationConfig"]
    assert config["thinkingConfig"] == {"thinkingBudget": 1024, "includeThoughts": True}
    assert response.choices[0].message.content == "a b"
    assert response.choices[0].message.model_extra == {"reasoning_content": "Thinking about: a b"}
    reported = fake_gemini.last_usage
    assert response.usage is not None and response.usage.completion_tokens == reported.output_tokens
    assert response.usage.completion_tokens_details.reasoning_tokens == reported.reasoning_tokens > 0
    raw = _post_raw(
        gateway,
        {
            "model": "gemini-flash",
            "reasoning_effort": "low",
            "stream": True,
            "messages": [{"role": "user", "content": "a b"}],
        },
    )
    assert _stream_reasoning(raw) == ("Thinking about: a b", "a b")
    message = gateway.anthropic().messages.create(
        model="gemini-flash",
        max_tokens=4000,
        thinking={"type": "enabled", "budget_tokens": 2048},
        messages=[{"role": "user", "content": "a b"}],
    )
    config = fake_gemini.last_request.json["generationConfig"]
    assert config["thinkingConfig"] == {"thinkingBudget": 2048, "includeThoughts": True}
    assert [(b.type, getattr(b, "signature", None)) for b in message.content] == [
        ("thinking", ""),
        ("text", None),
    ]


# --- the translations underneath -----------------------------------------------------------------

ANTHROPIC = Backend(name="a", type="anthropic", base_url="http://a", api_key="k")
GEMINI = Backend(name="g", type="gemini", base_url="http://g", api_key="k")
OPENAI = Backend(name="o", type="openai", base_url="http://o/v1", api_key="k")
SIGNED = {"type": "thinking", "text": "hmm", "signature": "sig"}
TOOL_TURN = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


def chat(**fields: object) -> ChatRequest:
    return msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, ChatRequest
    )


def body(request: object) -> dict[str, Any]:
    return json.loads(request.body)


def test_anthropic_request_sends_signed_reasoning_first_and_drops_unsigned() -> None:
    request = chat(
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "a",
                "reasoning_blocks": [
                    SIGNED,
                    {"type": "thinking", "text": "another vendor's", "signature": ""},
                    {"type": "redacted_thinking", "data": "opaque"},
                ],
            },
            {"role": "user", "content": "q2"},
        ],
        reasoning_budget=2048,
        max_tokens=3000,
    )
    sent = body(anthropic_provider.chat_request(ANTHROPIC, request, "claude-sonnet-4-5"))
    assert sent["messages"][1]["content"] == [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "a"},
    ]
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 2048} and sent["max_tokens"] == 3000
    count = body(anthropic_provider.count_tokens_request(ANTHROPIC, request, "claude-sonnet-4-5"))
    assert count["thinking"] == sent["thinking"] and "max_tokens" not in count


def test_anthropic_explicit_budget_is_passed_as_it_is() -> None:
    # The Anthropic client chose it: Anthropic's own 400 answers an invalid one.
    sent = body(
        anthropic_provider.chat_request(
            ANTHROPIC, chat(reasoning_budget=500, max_tokens=400), "claude-sonnet-4-5"
        )
    )
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 500} and sent["max_tokens"] == 400


@pytest.mark.parametrize(
    ("fields", "budget"),
    [
        ({"reasoning_effort": "low"}, 1024),
        ({"reasoning_effort": "medium"}, 4096),
        ({"reasoning_effort": "high", "max_tokens": 10000}, 9999),
        ({"reasoning_effort": "none"}, None),
        ({"reasoning_effort": "high", "response_format": {"type": "json_object"}}, None),  # a forced tool
        ({"reasoning_effort": "low", "messages": [{"role": "user", "content": "q"}, TOOL_TURN]}, None),
        (
            {
                "reasoning_effort": "low",
                "messages": [{"role": "user", "content": "q"}, {**TOOL_TURN, "reasoning_blocks": [SIGNED]}],
            },
            1024,
        ),
    ],
)
def test_anthropic_effort_budgets(fields: dict[str, Any], budget: int | None) -> None:
    sent = body(anthropic_provider.chat_request(ANTHROPIC, chat(**fields), "claude-sonnet-4-5"))
    assert (sent.get("thinking") or {}).get("budget_tokens") == budget


def test_anthropic_response_and_stream_carry_reasoning() -> None:
    reply = {
        "id": "msg_1",
        "content": [
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "text", "text": "hi"},
        ],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 2},
    }
    response = anthropic_provider.chat_response(json.dumps(reply).encode(), "c")
    # The thinking's 9 bytes (3 tokens at 4 bytes each), at most the 2 output tokens billed.
    assert (response.usage.reasoning_tokens, response.usage.reasoning_estimated) == (2, True)
    reply["usage"] = {"input_tokens": 1, "output_tokens": 20}
    response = anthropic_provider.chat_response(json.dumps(reply).encode(), "c")
    assert (response.usage.output_tokens, response.usage.reasoning_tokens) == (20, 3)
    message = response.choices[0].message
    assert message.reasoning_content == "hmm" and message.content == "hi"
    assert message.reasoning_blocks == [
        RedactedReasoning(data="opaque"),
        ReasoningBlock(text="hmm", signature="sig"),
    ]

    decoder = anthropic_provider.ChatStream(chat(), "c")
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "msg_1", "usage": {}}},
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "redacted_thinking", "data": "opaque"},
        },
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {"type": "content_block_delta", "index": 1, "delta": {"type": "thinking_delta", "thinking": "hm"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "signature_delta", "signature": "sig"}},
    ]
    deltas = [c.choices[0].delta for e in events for c in decoder.feed(None, json.dumps(e)) if c.choices]
    assert deltas[1:] == [
        Delta(redacted_reasoning="opaque"),
        Delta(reasoning_content="hm"),
        Delta(reasoning_signature="sig"),
    ]
    ending = [
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 20}},
        {"type": "message_stop"},
    ]
    [*_, last] = [c for e in ending for c in decoder.feed(None, json.dumps(e))]
    assert last.usage is not None and (last.usage.output_tokens, last.usage.reasoning_tokens) == (20, 2)


def test_openai_request_maps_a_budget_to_effort_and_sends_no_blocks() -> None:
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_blocks": [SIGNED]},
    ]
    sent = body(openai.chat_request(OPENAI, chat(messages=history, reasoning_budget=1024), "x"))
    assert sent["reasoning_effort"] == "low" and "reasoning_budget" not in sent
    # the signed block stays behind; its text goes as reasoning_content only where the backend takes
    # it (test_reasoning_goes_back_to_deepseek_and_kimi_or_where_configured)
    assert sent["messages"][1] == {"role": "assistant", "content": "a"}
    deepseek = Backend(name="d", type="openai", base_url="https://api.deepseek.com", api_key="k")
    sent = body(openai.chat_request(deepseek, chat(messages=history), "x"))
    assert sent["messages"][1] == {"role": "assistant", "content": "a", "reasoning_content": "hmm"}
    assert [effort_for_budget(b) for b in (1024, 1025, 8192, 8193)] == [
        "low",
        "medium",
        "medium",
        "high",
    ]
    sent = body(openai.chat_request(OPENAI, chat(reasoning_budget=20000, reasoning_effort="low"), "x"))
    assert sent["reasoning_effort"] == "low"  # the client's own effort wins


def test_gemini_thinking_config() -> None:
    config = body(gemini.chat_request(GEMINI, chat(reasoning_effort="none"), "g"))["generationConfig"]
    assert config == {"thinkingConfig": {"thinkingBudget": 0}}  # off, and no thoughts to include
    config = body(gemini.chat_request(GEMINI, chat(reasoning_budget=3000), "g"))["generationConfig"]
    assert config == {"thinkingConfig": {"thinkingBudget": 3000, "includeThoughts": True}}
    assert "generationConfig" not in body(gemini.chat_request(GEMINI, chat(), "g"))


def test_inbound_keeps_thinking_blocks_and_the_budget() -> None:
    request = msgspec.convert(
        {
            "model": "m",
            "max_tokens": 2000,
            "thinking": {"type": "enabled", "budget_tokens": 1500},
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "a"},
                    ],
                },
            ],
        },
        MessagesRequest,
    )
    canonical = to_canonical(request)
    assert canonical.reasoning_budget == 1500
    assert canonical.messages[1].reasoning_blocks == [
        ReasoningBlock(text="hmm", signature="sig"),
        RedactedReasoning(data="opaque"),
    ]
    disabled = msgspec.structs.replace(
        request, thinking=msgspec.convert({"type": "disabled"}, type(request.thinking))
    )
    assert to_canonical(disabled).reasoning_budget is None
    no_budget = msgspec.structs.replace(
        request, thinking=msgspec.convert({"type": "enabled"}, type(request.thinking))
    )
    with pytest.raises(InvalidRequest, match="budget_tokens"):
        to_canonical(no_budget)


def _response(message: AssistantMessage) -> ChatResponse:
    return ChatResponse(
        id="r", created=0, model="m", choices=[Choice(index=0, message=message, finish_reason="stop")]
    )


def test_renderings_show_reasoning_where_it_belongs() -> None:
    message = AssistantMessage(
        role="assistant",
        content="hi",
        reasoning_content="hmm",
        reasoning_blocks=[RedactedReasoning(data="opaque"), ReasoningBlock(text="hmm", signature="sig")],
    )
    assert from_canonical(_response(message), "m", thinking=True)["content"] == [
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "text", "text": "hi"},
    ]
    assert from_canonical(_response(message), "m")["content"] == [{"type": "text", "text": "hi"}]
    assert render_chat(_response(message))["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hi",
        "reasoning_content": "hmm",
    }
    chunk = ChatChunk(
        id="c",
        created=0,
        model="m",
        choices=[
            ChunkChoice(
                index=0, delta=Delta(reasoning_content="x", reasoning_signature="sig", redacted_reasoning="o")
            )
        ],
    )
    rendered = json.loads(render_chunk(chunk)[6:])
    assert rendered["choices"][0]["delta"] == {"reasoning_content": "x"}


def test_inbound_stream_renders_thinking_blocks_with_consistent_indices() -> None:
    def chunk(**delta: Any) -> ChatChunk:
        return ChatChunk(id="c", created=0, model="m", choices=[ChunkChoice(index=0, delta=Delta(**delta))])

    async def batches() -> AsyncIterator[list[ChatChunk]]:
        yield [chunk(role="assistant", content=""), chunk(redacted_reasoning="opaque")]
        yield [chunk(reasoning_content="a "), chunk(reasoning_content="b"), chunk(reasoning_signature="sig")]
        yield [chunk(reasoning_content="unsigned")]
        yield [chunk(content="hi")]

    async def collect(thinking: bool) -> list[tuple[str, dict[str, Any]]]:
        raw = b"".join([part async for part in stream_events(batches(), "m", thinking)]).decode()
        frames = [frame.split("\n") for frame in raw.strip().split("\n\n")]
        return [(lines[0][7:], json.loads(lines[1][6:])) for lines in frames]

    events = asyncio.run(collect(True))
    blocks = [
        (data["index"], data.get("content_block") or data.get("delta") or {})
        for name, data in events
        if name.startswith("content_block")
    ]
    assert blocks == [
        (0, {"type": "redacted_thinking", "data": "opaque"}),
        (0, {}),
        (1, {"type": "thinking", "thinking": "", "signature": ""}),
        (1, {"type": "thinking_delta", "thinking": "a "}),
        (1, {"type": "thinking_delta", "thinking": "b"}),
        (1, {"type": "signature_delta", "signature": "sig"}),
        (1, {}),
        (2, {"type": "thinking", "thinking": "", "signature": ""}),
        (2, {"type": "thinking_delta", "thinking": "unsigned"}),
        (2, {}),
        (3, {"type": "text", "text": ""}),
        (3, {"type": "text_delta", "text": "hi"}),
        (3, {}),
    ]
    plain = asyncio.run(collect(False))
    assert [d.get("content_block", {}).get("type") for n, d in plain if n == "content_block_start"] == [
        "text"
    ]


def test_a_cut_stream_bills_its_reasoning() -> None:
    chunk = ChatChunk(
        id="c", created=0, model="m", choices=[ChunkChoice(index=0, delta=Delta(reasoning_content="abcd"))]
    )
    assert chunk_text_bytes(chunk) == 4


def test_openai_compatible_reasoning_under_either_name() -> None:
    """vLLM 0.17+ and OpenRouter say `reasoning`, DeepSeek and older vLLM `reasoning_content`: both
    become `reasoning_content`, and OpenAI clients get that one name."""
    for name in ("reasoning", "reasoning_content"):
        body = {
            "id": "c",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "4", name: "2+2"},
                    "finish_reason": "stop",
                }
            ],
        }
        response = openai.chat_response(json.dumps(body).encode(), "m")
        assert response.choices[0].message.reasoning_content == "2+2"
        message = render_chat(response)["choices"][0]["message"]
        assert message["reasoning_content"] == "2+2" and "reasoning" not in message
        stream = openai.ChatStream(ChatRequest(model="m", messages=[]), "m")
        chunk = {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {name: "2+"}}]}
        [canonical] = stream.feed(None, json.dumps(chunk))
        assert canonical.choices[0].delta.reasoning_content == "2+"
        assert "reasoning" not in msgspec.to_builtins(canonical.choices[0].delta)
        # Sent as decoded, not as the upstream's own JSON (which says `reasoning` for vLLM 0.17+).
        assert json.loads(render_chunk(canonical)[6:])["choices"][0]["delta"] == {"reasoning_content": "2+"}


def test_streamed_reasoning_reaches_openai_clients_under_one_name(compat_gateway: RunningGateway) -> None:
    """vLLM 0.17+ streams `reasoning`: OpenAI clients get it as `reasoning_content`, as unstreamed."""
    stream = compat_gateway.openai().chat.completions.create(
        model="vllm-reasoner", messages=[{"role": "user", "content": "2+2?"}], stream=True
    )
    reasoning, content = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert "reasoning" not in extra
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("two plus two is four", "4")


def test_streamed_reasoning_keeps_the_fields_weir_does_not_model(compat_gateway: RunningGateway) -> None:
    """Renamed, a chunk of reasoning is re-encoded, not passed on as the server's JSON: its delta keeps
    what Weir does not model all the same (OpenRouter's `reasoning_details`, beside `reasoning`)."""
    stream = compat_gateway.openai().chat.completions.create(
        model="vllm-reasoner", messages=[{"role": "user", "content": "2+2?"}], stream=True
    )
    details = [
        detail["text"]
        for chunk in stream
        for choice in chunk.choices
        for detail in (choice.delta.model_extra or {}).get("reasoning_details", ())
    ]
    assert details == ["two plus two", " is four"]


# --- adaptive thinking and effort (Claude 4.6 on) ------------------------------------------------


def test_adaptive_thinking_reaches_claude_as_asked(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    message = gateway.anthropic().messages.create(
        model="claude-opus-47",
        max_tokens=2000,
        thinking={"type": "adaptive"},
        output_config={"effort": "xhigh"},
        messages=[{"role": "user", "content": "a b"}],
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "adaptive"} and sent["output_config"] == {"effort": "xhigh"}
    assert sent["max_tokens"] == 2000
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].signature  # signed by the fake: it can go back in a tool loop


def test_adaptive_thinking_for_a_budget_model_becomes_a_budget(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    message = gateway.anthropic().messages.create(
        model="claude-sonnet",  # claude-sonnet-4-5: budgets only; adaptive would be a 400
        max_tokens=8000,
        thinking={"type": "adaptive"},
        output_config={"effort": "medium"},
        messages=[{"role": "user", "content": "a b"}],
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 4096} and "output_config" not in sent
    assert message.content[0].type == "thinking"


def test_a_budget_for_an_adaptive_only_model_becomes_an_effort(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Opus 4.7 refuses budgets: a client (or a fallback) written for older Claude still thinks."""
    gateway.anthropic().messages.create(
        model="claude-opus-47",
        max_tokens=20000,
        thinking={"type": "enabled", "budget_tokens": 16000},
        messages=[{"role": "user", "content": "a b"}],
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "adaptive"} and sent["output_config"] == {"effort": "high"}
    gateway.anthropic().messages.create(
        model="claude-opus-47",
        max_tokens=200,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "a b"}],
    )
    assert "thinking" not in fake_anthropic.last_request.json  # "disabled" is a 400 there


@pytest.mark.parametrize(("model", "effort"), [("claude-opus-46", "max"), ("claude-opus-47", "xhigh")])
def test_openai_effort_to_adaptive_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, model: str, effort: str
) -> None:
    response = gateway.openai().chat.completions.create(
        model=model, reasoning_effort="xhigh", messages=[{"role": "user", "content": "a b"}]
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "adaptive"} and sent["output_config"] == {"effort": effort}
    assert sent["max_tokens"] == anthropic_provider.DEFAULT_MAX_TOKENS + 16384  # room to think
    assert response.choices[0].message.model_extra == {"reasoning_content": "Let me think about: a b"}
    gateway.openai().chat.completions.create(
        model=model, reasoning_effort="minimal", messages=[{"role": "user", "content": "a b"}]
    )
    sent = fake_anthropic.last_request.json
    assert "thinking" not in sent and sent["output_config"] == {"effort": "low"}


def test_adaptive_thinking_to_gemini_is_a_dynamic_budget(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    gateway.anthropic().messages.create(
        model="gemini-flash",
        max_tokens=2000,
        thinking={"type": "adaptive"},
        messages=[{"role": "user", "content": "a b"}],
    )
    config = fake_gemini.last_request.json["generationConfig"]
    assert config["thinkingConfig"] == {"thinkingBudget": -1, "includeThoughts": True}


def test_an_anthropic_clients_budget_above_gemini_flashs_range_is_its_most(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Claude takes budgets up to its output limit (Claude Code's 31999); 2.5 Flash takes 1 to 24576
    and refused the rest with a 400 ("The thinking budget 31999 is invalid"): it gets its most."""
    message = gateway.anthropic().messages.create(
        model="gemini-flash",
        max_tokens=40000,
        thinking={"type": "enabled", "budget_tokens": 31999},
        messages=[{"role": "user", "content": "a b"}],
    )
    config = fake_gemini.last_request.json["generationConfig"]
    assert config["thinkingConfig"] == {"thinkingBudget": 24576, "includeThoughts": True}
    assert [block.type for block in message.content] == ["thinking", "text"]


@pytest.mark.parametrize(
    ("model", "budget", "sent"),
    [
        ("gemini-2.5-pro", 0, 128),  # cannot stop thinking: its least
        ("gemini-2.5-pro", 40000, 32768),
        ("gemini-2.5-flash-lite", 100, 512),
        ("gemini-2.5-flash-lite", 0, 0),  # stops thinking
        ("gemini-2.5-flash", 0, 0),
        ("gemini-2.5-flash", -1, -1),  # dynamic, on every model
        ("gemini-2.5-pro", -1, -1),
    ],
)
def test_gemini_2_5_budgets_are_sent_within_each_models_range(model: str, budget: int, sent: int) -> None:
    config = gemini.chat_body(chat(reasoning_budget=budget), model)["generationConfig"]["thinkingConfig"]
    assert config["thinkingBudget"] == sent and ("includeThoughts" in config) is (budget != 0)
    check_thinking(model, config)  # the fake's rules, as Google's


def test_output_config_format_is_structured_output_on_any_backend(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    message = gateway.anthropic().messages.create(
        model="gpt-4o-mini",
        max_tokens=200,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "Paris"}],
    )
    sent = fake_openai.last_request.json["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["schema"] == schema
    assert set(json.loads(message.content[0].text)) == {"city"}


@pytest.mark.parametrize(
    ("model", "mode"),
    [
        ("claude-3-7-sonnet-latest", "budget"),
        ("claude-sonnet-4-5", "budget"),
        ("claude-sonnet-4-5-20250929", "budget"),
        ("claude-opus-4-1", "budget"),
        ("claude-opus-4-20250514", "budget"),
        ("claude-sonnet-4-0", "budget"),
        ("claude-haiku-4-5", "budget"),
        ("claude-opus-4-5-20251101", "budget"),
        ("claude-sonnet-4-6", "both"),
        ("claude-opus-4-6", "both"),
        ("claude-opus-4-7", "adaptive"),
        ("claude-opus-5", "adaptive"),
        ("claude-mythos-5", "adaptive"),
    ],
)
def test_thinking_mode_by_model(model: str, mode: str) -> None:
    assert anthropic_provider.thinking_mode(model) == mode


@pytest.mark.parametrize(
    ("fields", "model", "thinking", "effort"),
    [
        # an OpenAI client's effort: adaptive where the model takes it, a fitted budget where not
        ({"reasoning_effort": "medium"}, "claude-sonnet-4-6", {"type": "adaptive"}, "medium"),
        (
            {"reasoning_effort": "medium"},
            "claude-sonnet-4-5",
            {"type": "enabled", "budget_tokens": 4096},
            None,
        ),
        ({"reasoning_effort": "none"}, "claude-opus-4-7", None, "low"),
        # Anthropic would refuse thinking with a forced tool: an effort gets none there
        (
            {"reasoning_effort": "high", "response_format": {"type": "json_object"}},
            "claude-opus-4-7",
            None,
            "high",
        ),
        # an Anthropic client's own budget: as it is where the model takes budgets
        (
            {"reasoning_budget": 2048, "max_tokens": 3000},
            "claude-opus-4-6",
            {"type": "enabled", "budget_tokens": 2048},
            None,
        ),
        ({"reasoning_budget": 2048, "max_tokens": 3000}, "claude-opus-4-7", {"type": "adaptive"}, "medium"),
        # adaptive as asked where the model takes it; a budget (high by default) where not
        ({"reasoning_adaptive": True}, "claude-opus-4-6", {"type": "adaptive"}, None),
        (
            {"reasoning_adaptive": True, "max_tokens": 5000},
            "claude-haiku-4-5",
            {"type": "enabled", "budget_tokens": 4999},
            None,
        ),
        (
            {"reasoning_adaptive": True, "reasoning_effort": "low"},
            "claude-haiku-4-5",
            {"type": "enabled", "budget_tokens": 1024},
            None,
        ),
    ],
)
def test_anthropic_thinking_by_model(
    fields: dict[str, Any], model: str, thinking: dict[str, Any] | None, effort: str | None
) -> None:
    sent = body(anthropic_provider.chat_request(ANTHROPIC, chat(**fields), model))
    assert sent.get("thinking") == thinking
    assert (sent.get("output_config") or {}).get("effort") == effort


def test_openai_compatible_gets_a_known_effort() -> None:
    sent = body(openai.chat_request(OPENAI, chat(reasoning_effort="max", reasoning_adaptive=True), "m"))
    assert sent["reasoning_effort"] == "high" and "reasoning_adaptive" not in sent
    sent = body(openai.chat_request(OPENAI, chat(reasoning_adaptive=True), "m"))
    assert "reasoning_effort" not in sent and "reasoning_adaptive" not in sent


# --- DeepSeek's thinking mode wants its reasoning back in a tool loop ----------------------------

DEEPSEEK_ASK = {"role": "user", "content": 'call get_weather {"city": "Paris"}'}


def test_deepseek_tool_loop_gets_its_reasoning_back(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI
) -> None:
    client = gateway.openai()
    first = client.chat.completions.create(
        model="deepseek-reasoner", messages=[DEEPSEEK_ASK], tools=[OPENAI_WEATHER]
    )
    call = first.choices[0].message.model_dump(exclude_none=True)  # what an OpenAI SDK app appends
    assert call["reasoning_content"] and call["tool_calls"]
    result = {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "sunny"}
    second = client.chat.completions.create(
        model="deepseek-reasoner", messages=[DEEPSEEK_ASK, call, result], tools=[OPENAI_WEATHER]
    )
    assert second.choices[0].message.content == "Tool get_weather returned: sunny"
    assert fake_deepseek.last_request.json["messages"][1]["reasoning_content"] == call["reasoning_content"]

    # A client that dropped the reasoning (or a turn written by another vendor): the field is sent
    # empty, which DeepSeek accepts, rather than left out, which it refuses.
    bare = {k: v for k, v in call.items() if k != "reasoning_content"}
    client.chat.completions.create(
        model="deepseek-reasoner", messages=[DEEPSEEK_ASK, bare, result], tools=[OPENAI_WEATHER]
    )
    assert fake_deepseek.last_request.json["messages"][1]["reasoning_content"] == ""


def test_deepseek_tool_loop_from_anthropic_and_responses_clients(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI
) -> None:
    tool = {"name": "get_weather", "input_schema": OPENAI_WEATHER["function"]["parameters"]}
    client = gateway.anthropic()
    first = client.messages.create(
        model="deepseek-reasoner", max_tokens=2000, thinking=THINKING, tools=[tool], messages=[DEEPSEEK_ASK]
    )
    use = next(b for b in first.content if b.type == "tool_use")
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}
    client.messages.create(
        model="deepseek-reasoner",
        max_tokens=2000,
        thinking=THINKING,
        tools=[tool],
        messages=[DEEPSEEK_ASK, {"role": "assistant", "content": first.content}, result],
    )
    thinking = next(b for b in first.content if b.type == "thinking").thinking
    assert fake_deepseek.last_request.json["messages"][1]["reasoning_content"] == thinking

    responses = gateway.openai().responses
    ask = [{"role": "user", "content": DEEPSEEK_ASK["content"]}]
    tools = [
        {"type": "function", "name": "get_weather", "parameters": OPENAI_WEATHER["function"]["parameters"]}
    ]
    response = responses.create(model="deepseek-reasoner", input=ask, tools=tools)
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and "function_call" in kinds
    call = next(item for item in response.output if item.type == "function_call")
    later = [*ask, *[item.model_dump(exclude_none=True) for item in response.output]]
    later.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    again = responses.create(model="deepseek-reasoner", input=later, tools=tools)
    assert again.output_text == "Tool get_weather returned: sunny"
    sent = fake_deepseek.last_request.json["messages"][1]
    assert sent["reasoning_content"] == response.output[0].content[0].text and sent["tool_calls"]


def test_reasoning_goes_back_to_deepseek_and_kimi_or_where_configured() -> None:
    history = chat(
        messages=[
            {"role": "user", "content": "q"},
            {**TOOL_TURN, "reasoning_content": "why"},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ]
    )
    for url, sent in (
        ("https://api.deepseek.com/v1", True),
        ("https://api.moonshot.ai/v1", True),
        ("https://api.openai.com/v1", False),
        ("https://acme.openai.azure.com/openai/deployments/gpt-4o", False),
        ("https://api.cerebras.ai/v1", False),
        ("http://vllm:8000/v1", False),
    ):
        backend = Backend(name="o", type="openai", base_url=url, api_key="k")
        messages = body(openai.chat_request(backend, history, "m"))["messages"]
        assert ("reasoning_content" in messages[1]) is sent
    vllm = Backend(name="v", type="openai", base_url="http://vllm:8000/v1", send_reasoning=True)
    assert body(openai.chat_request(vllm, history, "m"))["messages"][1]["reasoning_content"] == "why"


# --- Gemini 3 thinks in levels ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("effort", "config"),
    [
        ("none", {"thinkingLevel": "low"}),  # 3 Pro cannot stop thinking: a budget of 0 is its 400
        ("low", {"thinkingLevel": "low", "includeThoughts": True}),
        ("medium", {"thinkingLevel": "high", "includeThoughts": True}),  # 3 Pro has only low and high
        ("high", {"thinkingLevel": "high", "includeThoughts": True}),
    ],
)
def test_openai_effort_to_gemini_3_is_a_level(
    gateway: RunningGateway, fake_gemini: FakeGemini, effort: str, config: dict[str, Any]
) -> None:
    response = gateway.openai().chat.completions.create(
        model="gemini-pro", reasoning_effort=effort, messages=[{"role": "user", "content": "a b"}]
    )
    assert fake_gemini.last_request.json["generationConfig"]["thinkingConfig"] == config
    assert response.choices[0].message.content == "a b"
    shown = (response.choices[0].message.model_extra or {}).get("reasoning_content")
    assert (shown is not None) is ("includeThoughts" in config)


def test_anthropic_thinking_to_gemini_3(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    client = gateway.anthropic()
    asked = [{"role": "user", "content": "a b"}]
    client.messages.create(model="gemini-pro", max_tokens=4000, thinking=THINKING, messages=asked)
    # an explicit budget still works on Gemini 3 (Google keeps it for compatibility)
    assert fake_gemini.last_request.json["generationConfig"]["thinkingConfig"] == {
        "thinkingBudget": 1024,
        "includeThoughts": True,
    }
    message = client.messages.create(
        model="gemini-pro", max_tokens=4000, thinking={"type": "adaptive"}, messages=asked
    )
    assert fake_gemini.last_request.json["generationConfig"]["thinkingConfig"] == {"includeThoughts": True}
    assert [block.type for block in message.content] == ["thinking", "text"]


@pytest.mark.parametrize(
    ("effort", "level", "thoughts"),
    [
        ("none", "minimal", False),
        ("minimal", "minimal", False),
        ("low", "low", True),
        ("medium", "medium", True),
        ("high", "high", True),
        ("xhigh", "high", True),
    ],
)
def test_gemini_3_flash_takes_its_own_levels(effort: str, level: str, thoughts: bool) -> None:
    """3 Flash has minimal and medium as well, which 3 Pro refuses: each effort gets its own level
    there, checked against the fake's per-model rules."""
    config = gemini.chat_body(chat(reasoning_effort=effort), "gemini-3-flash-preview")["generationConfig"]
    thinking = config["thinkingConfig"]
    assert thinking["thinkingLevel"] == level and ("includeThoughts" in thinking) is thoughts
    check_thinking("gemini-3-flash-preview", thinking)
    pro = gemini.chat_body(chat(reasoning_effort=effort), "gemini-3-pro-preview")["generationConfig"]
    check_thinking("gemini-3-pro-preview", pro["thinkingConfig"])
    with pytest.raises(Invalid, match="not supported"):
        check_thinking("gemini-3-pro-preview", {"thinkingLevel": "medium"})


def test_gemini_2_keeps_budgets() -> None:
    for effort, budget in (("none", 0), ("medium", 8192)):
        config = gemini.chat_body(chat(reasoning_effort=effort), "gemini-2.5-flash")["generationConfig"]
        assert config["thinkingConfig"]["thinkingBudget"] == budget
    assert gemini.is_gemini_3("gemini-flash-latest") and not gemini.is_gemini_3("gemma-3-27b-it")


def test_an_anthropic_clients_thinking_reaches_gemma_and_gemini_2_0_as_nothing(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Gemma and Gemini 2.0 do not think and refuse any thinkingConfig ("thinking_config is not
    supported."): Claude Code, which sends thinking on every turn, routed to Gemma got that 400 for
    every request. As OpenAI's non-reasoning models, they are sent none."""
    for thinking in (THINKING, {"type": "adaptive"}):
        message = gateway.anthropic().messages.create(
            model="gemma", max_tokens=2000, thinking=thinking, messages=[{"role": "user", "content": "a b"}]
        )
        assert [block.type for block in message.content] == ["text"]
        assert "thinkingConfig" not in fake_gemini.last_request.json.get("generationConfig", {})
    for model in ("gemini-2.0-flash", "gemini-1.5-pro"):
        assert "generationConfig" not in gemini.chat_body(chat(reasoning_budget=4096), model)
    thinks = gemini.chat_body(chat(reasoning_budget=4096), "gemini-2.0-flash-thinking-exp")
    assert thinks["generationConfig"]["thinkingConfig"]["thinkingBudget"] == 4096


@pytest.mark.parametrize("effort", ["none", "minimal"])
def test_an_effort_of_no_thinking_reaches_gemma_as_nothing(
    gateway: RunningGateway, fake_gemini: FakeGemini, effort: str
) -> None:
    """No thinking asked of a model that does not think: a budget of 0 was sent, which it refuses."""
    chat_reply = gateway.openai().chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": "a b"}],
        reasoning_effort=effort,  # type: ignore[arg-type]
    )
    assert chat_reply.choices[0].message.content == "a b"
    assert "thinkingConfig" not in fake_gemini.last_request.json.get("generationConfig", {})


def test_an_openai_clients_own_effort_to_gemma_is_a_400_naming_it(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """An OpenAI client that asks a model that does not reason for reasoning gets a 400 naming its
    `reasoning_effort` (a route passes the candidate over), not Gemini's about `thinking_config`."""
    with pytest.raises(openai_sdk.BadRequestError) as caught:
        gateway.openai().chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "a b"}], reasoning_effort="high"
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == ("reasoning_effort", "unsupported_parameter")
    assert not fake_gemini.requests


# --- structured output beside tools or thinking: Claude's own output_config.format -----------------

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "rank": {"type": "integer", "minimum": 1}},
    "required": ["city", "rank"],
}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
TREE_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
}
STRICT_TREE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "tree", "schema": TREE_SCHEMA, "strict": True},
}
STRICT_CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
}


def test_structured_output_beside_tools_is_claudes_own(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    reply = gateway.openai().chat.completions.create(
        model="claude-opus-46",
        messages=[{"role": "user", "content": "Paris"}],
        tools=[OPENAI_WEATHER],
        response_format=CITY_FORMAT,
    )
    sent = fake_anthropic.last_request.json
    assert [t["name"] for t in sent["tools"]] == ["get_weather"] and "tool_choice" not in sent
    assert sent["output_config"]["format"]["schema"] == anthropic_provider.strict_schema(CITY_SCHEMA)
    assert set(json.loads(reply.choices[0].message.content)) == {"city", "rank"}


def test_structured_output_keeps_thinking_on_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    reply = gateway.openai().chat.completions.create(
        model="claude-opus-47",
        reasoning_effort="high",
        messages=[{"role": "user", "content": "Paris"}],
        response_format=CITY_FORMAT,
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "adaptive"} and "tools" not in sent
    assert sent["output_config"] == {
        "effort": "high",
        "format": {"type": "json_schema", "schema": anthropic_provider.strict_schema(CITY_SCHEMA)},
    }
    assert set(json.loads(reply.choices[0].message.content)) == {"city", "rank"}
    assert reply.choices[0].message.model_extra["reasoning_content"]


@pytest.mark.parametrize(
    ("fields", "model", "native"),
    [
        ({"tools": [OPENAI_WEATHER]}, "claude-sonnet-4-5", True),
        ({"tools": [OPENAI_WEATHER]}, "claude-sonnet-4-0", False),  # no structured outputs: a hint
        ({}, "claude-opus-4-7", False),  # neither tools nor thinking: the forced tool serves
        ({"reasoning_effort": "none"}, "claude-opus-4-7", False),
        ({"reasoning_effort": "low"}, "claude-haiku-4-5", True),
        # strict: the schema must hold, which only Claude's own structured output makes sure of
        ({"response_format": STRICT_CITY_FORMAT}, "claude-sonnet-4-5", True),
        ({"response_format": STRICT_CITY_FORMAT}, "claude-sonnet-4-0", False),
        ({"response_format": STRICT_TREE_FORMAT}, "claude-sonnet-4-5", False),  # recursive: the tool takes it
        ({"response_format": STRICT_TREE_FORMAT, "tools": [OPENAI_WEATHER]}, "claude-sonnet-4-5", True),
    ],
)
def test_when_claudes_structured_output_is_used(fields: dict[str, Any], model: str, native: bool) -> None:
    request = chat(**{"response_format": CITY_FORMAT, **fields})
    sent = body(anthropic_provider.chat_request(ANTHROPIC, request, model))
    assert ("format" in (sent.get("output_config") or {})) is native
    assert (sent.get("tool_choice") == {"type": "tool", "name": anthropic_provider.JSON_TOOL}) is (
        not native and not fields.get("tools")
    )


def test_strict_schema() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date"},
            "code": {"type": "string", "format": "iata", "maxLength": 3},
            "tags": {
                "type": "array",
                "items": {"type": "object", "properties": {"k": {"type": "string"}}},
                "minItems": 2,
            },
            "pick": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
        },
        "additionalProperties": True,
    }
    assert anthropic_provider.strict_schema(schema) == {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date"},
            "code": {"type": "string", "description": '{format: "iata", maxLength: 3}'},
            "tags": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"k": {"type": "string"}},
                    "additionalProperties": False,
                },
                "description": "{minItems: 2}",
            },
            "pick": {"anyOf": [{"type": "integer", "description": "{minimum: 0}"}, {"type": "null"}]},
        },
        "additionalProperties": False,
    }


def test_anthropic_clients_own_output_format_stays_claudes_own(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    schema = anthropic_provider.strict_schema(CITY_SCHEMA)  # what the SDK's messages.parse sends
    message = gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=300,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "Paris"}],
    )
    sent = fake_anthropic.last_request.json
    assert (
        sent["output_config"] == {"format": {"type": "json_schema", "schema": schema}} and "tools" not in sent
    )
    assert set(json.loads(message.content[0].text)) == {"city", "rank"}
