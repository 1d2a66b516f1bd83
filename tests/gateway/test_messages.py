"""/v1/messages: the Anthropic Messages API inbound, with the official anthropic SDK, to every backend."""

from __future__ import annotations

import base64
import json
from typing import Any

import anthropic
import pytest

from gateway.providers import openai as openai_provider
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import PARALLEL_CALLS, RunningGateway

MODELS = ["claude-sonnet", "gpt-4o-mini", "gemini-flash"]
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HI = [{"role": "user", "content": "hi"}]
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()


def final_message(
    client: anthropic.Anthropic, stream: bool, asked: dict[str, Any]
) -> anthropic.types.Message:
    """The whole message the SDK hands back for `asked`: streamed (its accumulator's final message,
    which checks the event sequence) or not."""
    if stream:
        with client.messages.stream(**asked) as events:
            return events.get_final_message()
    return client.messages.create(**asked)


@pytest.mark.parametrize("model", MODELS)
def test_message(gateway: RunningGateway, model: str) -> None:
    message = gateway.anthropic().messages.create(
        model=model,
        max_tokens=100,
        system="Be brief.",
        messages=[{"role": "user", "content": "hello over there"}],
    )
    assert message.type == "message" and message.role == "assistant" and message.model == model
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "hello over there"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 3
    assert gateway.sink.events[0].route == model


@pytest.mark.parametrize("model", MODELS)
def test_stream_event_sequence(gateway: RunningGateway, model: str) -> None:
    with gateway.anthropic().messages.stream(
        model=model, max_tokens=100, messages=[{"role": "user", "content": "stream these four words"}]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"] or kinds[:3] == [
        "message_start",
        "ping",
        "content_block_start",
    ]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == "stream these four words"  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_keeps_claudes_id_streamed_or_not(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """Claude's `msg_` id, the one Anthropic's console and support know, in both: a stream's was always
    Weir's own while the same message unstreamed kept Claude's."""
    message = final_message(
        gateway.anthropic(), stream, {"model": "claude-sonnet", "max_tokens": 20, "messages": HI}
    )
    assert [message.id] == fake_anthropic.message_ids


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_from_another_vendor_gets_an_anthropic_style_id(
    gateway: RunningGateway, stream: bool
) -> None:
    message = final_message(
        gateway.anthropic(), stream, {"model": "gpt-4o-mini", "max_tokens": 20, "messages": HI}
    )
    assert message.id.startswith("msg_") and len(message.id) == len("msg_") + 24


def _start_and_delta(events: list) -> tuple:
    start = next(e for e in events if e.type == "message_start")
    delta = next(e for e in events if e.type == "message_delta")
    return start.message.usage, delta.usage


@pytest.mark.parametrize(
    ("model", "fake_name"), [("claude-sonnet", "fake_anthropic"), ("gemini-flash", "fake_gemini")]
)
def test_message_start_reports_the_prompt_the_backend_counted_before_answering(
    gateway: RunningGateway, request: pytest.FixtureRequest, model: str, fake_name: str
) -> None:
    """Clients that take the input from message_start and only output_tokens from message_delta (the
    Vercel AI SDK, LangChain's ChatAnthropic) saw 0 input and cache tokens: message_start always said
    zeros, even where the backend had counted the prompt (Anthropic's message_start, Gemini's first
    event). The count is shown, not billed again: the ledger holds the vendor's final report."""
    request.getfixturevalue(fake_name).set_next_usage(
        input_tokens=100, cached_input_tokens=5000, output_tokens=4
    )
    events = list(
        gateway.anthropic().messages.create(
            model=model,
            max_tokens=50,
            messages=[{"role": "user", "content": "stream these four words"}],
            stream=True,
        )
    )
    start, delta = _start_and_delta(events)
    assert (start.input_tokens, start.cache_read_input_tokens, start.output_tokens) == (100, 5000, 0)
    assert (delta.input_tokens, delta.cache_read_input_tokens, delta.output_tokens) == (100, 5000, 4)
    [event] = gateway.sink.events
    assert (event.usage.input_tokens, event.usage.cached_input_tokens, event.usage.output_tokens) == (
        100,
        5000,
        4,
    )


def test_message_start_says_zeros_where_the_backend_counts_only_at_the_end(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """OpenAI-compatible backends report usage after the answer only: message_start says zeros (no
    estimate passed off as the count) and message_delta the whole usage, which the anthropic SDK (2.x)
    takes for the message's, input and cache tokens included."""
    fake_openai.set_next_usage(input_tokens=100, cached_input_tokens=5000, output_tokens=4)
    with gateway.anthropic().messages.stream(
        model="gpt-4o-mini", max_tokens=50, messages=[{"role": "user", "content": "stream these four words"}]
    ) as stream:
        start, _ = _start_and_delta(list(stream))
        final = stream.get_final_message()
    assert (start.input_tokens, start.cache_read_input_tokens) == (0, 0)
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (
        100,
        5000,
        4,
    )


def test_message_start_leaves_out_the_turn_that_asked_to_continue_a_prefill(gateway: RunningGateway) -> None:
    """Claude 4.6 takes no prefill: the rest of the answer is asked for in a user turn of Weir's own,
    which the client never sent and message_delta's prompt leaves out; message_start's does too."""
    prompt = "stream these words " + " ".join(f"w{i}" for i in range(60))
    events = list(
        gateway.anthropic().messages.create(
            model="claude-opus-46",
            max_tokens=50,
            messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": "stream"}],
            stream=True,
        )
    )
    start, delta = _start_and_delta(events)
    assert delta.input_tokens > 0
    assert start.input_tokens == delta.input_tokens


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_use_round_trip(gateway: RunningGateway, model: str, stream: bool) -> None:
    client = gateway.anthropic()
    messages: list[dict] = [{"role": "user", "content": 'call get_weather {"city": "Lima"}'}]
    asked = {"model": model, "max_tokens": 200, "messages": messages, "tools": [WEATHER]}
    message = final_message(client, stream, asked)
    assert message.stop_reason == "tool_use"
    [tool_use] = [block for block in message.content if block.type == "tool_use"]
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Lima"}
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "foggy"}],
        },
    ]
    answer = client.messages.create(model=model, max_tokens=200, messages=messages, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    text = answer.content[0].text  # type: ignore[union-attr]
    assert text.startswith("Tool get_weather returned: ") and "foggy" in text


@pytest.mark.parametrize("model", MODELS)
def test_image_blocks(gateway: RunningGateway, model: str) -> None:
    message = gateway.anthropic().messages.create(
        model=model,
        max_tokens=50,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                    {"type": "text", "text": "describe"},
                ],
            }
        ],
    )
    assert message.content[0].text == "describe [image]"  # type: ignore[union-attr]


def test_images_reach_openai_as_data_urls(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    gateway.anthropic().messages.create(
        model="gpt-4o-mini",
        max_tokens=50,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
                ],
            }
        ],
    )
    part = fake_openai.last_request.json["messages"][0]["content"][0]
    assert part == {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}


SCREENSHOT = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
SCREENSHOT_TOOL = {
    "name": "screenshot",
    "description": "Take a screenshot",
    "input_schema": {"type": "object", "properties": {}},
}


def _screenshot_loop(then_said: str | None = None) -> list[dict]:
    """A computer-use turn: the model took a screenshot, the client returns it in a tool_result."""
    said = [{"type": "text", "text": then_said}] if then_said else []
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_01",
        "content": [{"type": "text", "text": "here it is"}, SCREENSHOT],
    }
    return [
        {"role": "user", "content": "call screenshot"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_01", "name": "screenshot", "input": {}}],
        },
        {"role": "user", "content": [result, *said]},
    ]


def test_tool_result_images_reach_openai_in_a_user_message(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """OpenAI refuses an image in a tool message (the fake as the real API: "Image URLs are only
    allowed for messages with role 'user'"): the tool message keeps the text, and the image follows
    the tool results in a user message, with what the user said in that turn."""
    client = gateway.anthropic()
    answer = client.messages.create(
        model="gpt-4o-mini", max_tokens=50, messages=_screenshot_loop(), tools=[SCREENSHOT_TOOL]
    )  # type: ignore[arg-type]
    assert answer.content[0].text == "[image]"  # type: ignore[union-attr]
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    sent = fake_openai.last_request.json["messages"]  # type: ignore[union-attr]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "user"]
    assert sent[2]["content"] == [{"type": "text", "text": "here it is"}]
    assert sent[3] == {"role": "user", "content": [image]}
    client.messages.create(
        model="gpt-4o-mini", max_tokens=50, messages=_screenshot_loop("click OK"), tools=[SCREENSHOT_TOOL]
    )  # type: ignore[arg-type]
    sent = fake_openai.last_request.json["messages"]  # type: ignore[union-attr]
    assert sent[3] == {"role": "user", "content": [image, {"type": "text", "text": "click OK"}]}


@pytest.mark.parametrize("model", MODELS)
def test_an_empty_tool_result_reaches_every_vendor(
    gateway: RunningGateway, fake_openai: FakeOpenAI, model: str
) -> None:
    """A tool that returned nothing (an MCP tool in Claude Code) comes back as `content: []`, which
    OpenAI refuses in a message ("empty array. Expected an array with minimum length 1"): the
    empty result goes as an empty string."""
    messages: Any = [
        {"role": "user", "content": "call get_weather"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": []}]},
    ]
    answer = gateway.anthropic().messages.create(
        model=model, max_tokens=50, messages=messages, tools=[WEATHER]
    )
    assert answer.content[0].text.startswith("Tool get_weather returned:")  # type: ignore[union-attr]
    if model == "gpt-4o-mini":
        assert fake_openai.last_request.json["messages"][2]["content"] == ""


@pytest.mark.parametrize(
    ("model", "nested"), [("gemini-flash", False), ("gemini-pro", True)], ids=["gemini-2.5", "gemini-3"]
)
def test_tool_result_images_reach_gemini(
    gateway: RunningGateway, fake_gemini: FakeGemini, model: str, nested: bool
) -> None:
    """A functionResponse holds JSON only: Gemini 3 takes the image inside it (its multimodal
    function responses), earlier models as a part of the same user turn after it."""
    gateway.anthropic().messages.create(
        model=model, max_tokens=50, messages=_screenshot_loop(), tools=[SCREENSHOT_TOOL]
    )  # type: ignore[arg-type]
    image = {"inlineData": {"mimeType": "image/png", "data": PNG}}
    response = {"name": "screenshot", "response": {"result": "here it is"}}
    turn = fake_gemini.last_request.json["contents"][-1]  # type: ignore[union-attr]
    if nested:
        assert turn == {"role": "user", "parts": [{"functionResponse": {**response, "parts": [image]}}]}
    else:
        assert turn == {"role": "user", "parts": [{"functionResponse": response}, image]}


@pytest.mark.parametrize(
    ("sent", "flags"),
    [
        ("context-1m-2025-08-07", "context-1m-2025-08-07"),
        ("interleaved-thinking-2025-05-14", "interleaved-thinking-2025-05-14"),
        (
            "context-1m-2025-08-07, interleaved-thinking-2025-05-14,context-1m-2025-08-07",
            "context-1m-2025-08-07,interleaved-thinking-2025-05-14",
        ),
    ],
    ids=["1m-context", "interleaved-thinking", "several"],
)
def test_anthropic_beta_reaches_an_anthropic_backend(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, sent: str, flags: str
) -> None:
    """The client's `anthropic-beta` (1M context, interleaved thinking; Claude Code sends several) was
    dropped: beta features silently did not happen, and a prompt Anthropic takes only with the 1M
    context beta was refused through Weir. It goes to Anthropic with the message and with its count,
    each flag once."""
    client = gateway.anthropic()
    hi = [{"role": "user", "content": "hi"}]
    beta = {"anthropic-beta": sent}
    client.messages.create(model="claude-sonnet", max_tokens=20, messages=hi, extra_headers=beta)  # type: ignore[arg-type]
    assert fake_anthropic.last_request.headers["anthropic-beta"] == flags  # type: ignore[union-attr]
    client.messages.count_tokens(model="claude-sonnet", messages=hi, extra_headers=beta)  # type: ignore[arg-type]
    assert fake_anthropic.last_request.path == "/v1/messages/count_tokens"  # type: ignore[union-attr]
    assert fake_anthropic.last_request.headers["anthropic-beta"] == flags  # type: ignore[union-attr]


@pytest.mark.parametrize("model", ["gpt-4o-mini", "gemini-flash"])
def test_anthropic_beta_is_left_out_for_other_vendors(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini, model: str
) -> None:
    """No other vendor has Anthropic's beta switch (a route failing over from Claude to them goes on
    without it): neither the header nor a body field reaches them."""
    gateway.anthropic().messages.create(
        model=model,
        max_tokens=20,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"anthropic-beta": "context-1m-2025-08-07"},
    )
    sent = (fake_openai if model == "gpt-4o-mini" else fake_gemini).last_request
    assert sent is not None and "anthropic-beta" not in sent.headers
    assert "anthropic_beta" not in sent.json and "context-1m" not in json.dumps(sent.json)


LONG_SYSTEM = "You are a careful assistant. " * 300  # > 1024 words: cacheable


def test_cache_control_passes_through_to_anthropic_and_usage_reports_cache(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    client = gateway.anthropic()
    system = [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    tools = [{**WEATHER, "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(
        model="claude-sonnet",
        max_tokens=20,
        system=system,
        tools=tools,
        messages=[{"role": "user", "content": "hi"}],  # type: ignore[arg-type]
    )
    sent = fake_anthropic.last_request.json
    assert sent["system"] == system
    assert sent["tools"][0]["cache_control"] == {"type": "ephemeral"}
    assert first.usage.cache_creation_input_tokens > 1024
    assert (
        first.usage.cache_creation is not None and first.usage.cache_creation.ephemeral_1h_input_tokens > 1024
    )
    assert first.usage.cache_read_input_tokens == 0
    second = client.messages.create(
        model="claude-sonnet",
        max_tokens=20,
        system=system,
        tools=tools,
        messages=[{"role": "user", "content": "hey"}],  # type: ignore[arg-type]
    )
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    first_event, second_event = gateway.sink.events
    assert (
        first_event.usage.cache_write_1h_tokens + first_event.usage.cache_write_5m_tokens
        == first.usage.cache_creation_input_tokens
    )
    assert second_event.usage.cached_input_tokens == second.usage.cache_read_input_tokens
    assert second_event.cost_pico_usd < first_event.cost_pico_usd  # reads are cheaper than writes


def test_cache_control_on_messages_and_tool_results(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    breakpoint_ = {"type": "ephemeral"}
    gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=20,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "weather in Lima?", "cache_control": breakpoint_}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Lima"}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": "foggy",
                        "cache_control": breakpoint_,
                    }
                ],
            },
        ],
    )
    sent = fake_anthropic.last_request.json["messages"]
    assert sent[0]["content"][0]["cache_control"] == breakpoint_
    assert sent[2]["content"][0] == {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": "foggy",
        "cache_control": breakpoint_,
    }


def test_openai_prompt_cache_is_reported_in_anthropic_shape(gateway: RunningGateway) -> None:
    client = gateway.anthropic()
    long_prompt = "word " * 1500
    client.messages.create(
        model="gpt-4o-mini", max_tokens=5, messages=[{"role": "user", "content": long_prompt}]
    )
    again = client.messages.create(
        model="gpt-4o-mini", max_tokens=5, messages=[{"role": "user", "content": long_prompt}]
    )
    assert again.usage.cache_read_input_tokens >= 1024
    assert (
        again.usage.input_tokens + again.usage.cache_read_input_tokens
        == gateway.sink.events[1].usage.prompt_tokens
    )


def test_cache_control_is_not_sent_to_openai_or_gemini(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    client = gateway.anthropic()
    for model in ("gpt-4o-mini", "gemini-flash"):
        client.messages.create(
            model=model,
            max_tokens=5,
            system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
                }
            ],
        )
    assert "cache_control" not in fake_openai.last_request.body.decode()
    assert "cache_control" not in fake_gemini.last_request.body.decode()


def test_tool_choice_and_stop_sequences_translate(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    message = gateway.anthropic().messages.create(
        model="gpt-4o-mini",
        max_tokens=30,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        messages=[{"role": "user", "content": "anything"}],
    )
    sent = fake_openai.last_request.json
    assert sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
    assert sent["stop"] == ["END"] and sent["max_tokens"] == 30
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert message.stop_reason == "tool_use"


def test_max_tokens_stop_reason(gateway: RunningGateway) -> None:
    message = gateway.anthropic().messages.create(
        model="gemini-flash", max_tokens=2, messages=[{"role": "user", "content": "one two three"}]
    )
    assert message.stop_reason == "max_tokens"


# --- /v1/messages/count_tokens --------------------------------------------------------------------


@pytest.mark.parametrize("model", ["claude-sonnet", "gemini-flash"])
def test_count_tokens_is_what_the_message_would_bill(gateway: RunningGateway, model: str) -> None:
    client = gateway.anthropic()
    request = {
        "model": model,
        "system": "Be brief and exact.",
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "how many tokens are these seven words"}],
    }
    counted = client.messages.with_raw_response.count_tokens(**request)  # type: ignore[arg-type]
    assert counted.headers["x-weir-token-count"] == "backend"
    assert f"candidate={model}" in counted.headers["x-weir-route"]
    billed = client.messages.create(max_tokens=20, **request)  # type: ignore[arg-type]
    assert counted.parse().input_tokens == billed.usage.input_tokens > 7
    # The count is one zero-cost attempt in the ledger, beside the message's.
    count_event, message_event = gateway.sink.events
    assert count_event.status == 200 and count_event.cost_pico_usd == 0
    assert (
        count_event.usage.input_tokens == 0 and message_event.usage.input_tokens == billed.usage.input_tokens
    )


def test_count_tokens_estimates_where_the_backend_cannot_count(gateway: RunningGateway) -> None:
    client = gateway.anthropic()
    short = client.messages.with_raw_response.count_tokens(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
    )
    long = client.messages.count_tokens(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi " * 400}]
    )
    assert short.headers["x-weir-token-count"] == "estimate"
    assert 0 < short.parse().input_tokens < 40 and long.input_tokens >= 300
    assert gateway.sink.events == []  # nothing was sent upstream


def test_count_tokens_errors_come_in_anthropics_shape(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    client = gateway.anthropic()
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        client.messages.count_tokens(model="claude-sonnet", messages=[])
    with pytest.raises(anthropic.AuthenticationError):
        gateway.anthropic(api_key="sk-wrong").messages.count_tokens(
            model="claude-sonnet", messages=[{"role": "user", "content": "x"}]
        )
    # An overloaded upstream reads as it does on /v1/messages: Anthropic's 529 overloaded_error.
    fake_anthropic.fail_next(529)
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        client.messages.count_tokens(model="claude-sonnet", messages=[{"role": "user", "content": "x"}])
    assert overloaded.value.status_code == 529
    assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


def test_a_stream_whose_last_chunk_also_reports_usage_keeps_its_stop_reason(
    compat_gateway: RunningGateway,
) -> None:
    """Mistral's chunk with the finish reason (`length` here) also holds the usage: both reach the
    Anthropic client's message_delta."""
    with compat_gateway.anthropic().messages.stream(
        model="mistral-small", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        events = list(stream)
    [delta] = [e for e in events if e.type == "message_delta"]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 2


@pytest.mark.parametrize("model", PARALLEL_CALLS)
def test_parallel_calls_streamed_at_one_index_are_tool_use_blocks_apart(
    compat_gateway: RunningGateway, model: str
) -> None:
    """Ollama, SGLang and Dynamo stream every parallel call at `index: 0`, each starting with its own
    id and name: they were one tool_use block, its input the calls' arguments run together. Each is
    a block of its own now, a call without arguments (`""` from the server) with an empty input."""
    asked = {
        "model": model,
        "max_tokens": 100,
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "all of them"}],
    }
    message = final_message(compat_gateway.anthropic(), True, asked)
    blocks = [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert blocks == [(id_, name, json.loads(arguments)) for id_, name, arguments in PARALLEL_CALLS[model]]
    assert message.stop_reason == "tool_use"


def test_the_anthropic_sdk_reads_the_request_id_of_messages_streams_and_errors(
    gateway: RunningGateway,
) -> None:
    """The anthropic SDK takes a request's id from `request-id` (Anthropic's header), not `x-request-id`:
    `message._request_id` and an error's `request_id` were None through Weir, and so never reached
    a client's logs or a support ticket. Both headers now carry the id the gateway logged."""
    client = gateway.anthropic()
    hi = [{"role": "user", "content": "hi"}]
    raw = client.messages.with_raw_response.create(model="gpt-4o-mini", max_tokens=20, messages=hi)  # type: ignore[arg-type]
    assert raw.parse()._request_id == raw.headers["x-request-id"] != ""
    with client.messages.stream(model="gemini-flash", max_tokens=20, messages=hi) as stream:  # type: ignore[arg-type]
        assert stream.request_id == stream.response.headers["x-request-id"] != ""
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=20, messages=hi)  # type: ignore[arg-type]
    assert missing.value.request_id == missing.value.response.headers["x-request-id"] != ""


PDF = base64.b64encode(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n" + b"0" * 32).decode()
PDF_DOCUMENT = {
    "type": "document",
    "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
    "title": "report.pdf",
    "cache_control": {"type": "ephemeral"},
}


def _ask_about(document: dict) -> list[dict]:
    return [{"role": "user", "content": [document, {"type": "text", "text": "summarise"}]}]


def test_pdf_documents_reach_each_vendor_in_its_own_shape(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini, fake_anthropic: FakeAnthropic
) -> None:
    """A `document` block (Claude clients' PDFs) was refused with a 400 on every route, Claude's own
    included. It now goes as OpenAI's `file` part, Gemini's inline data and Anthropic's document (with
    its cache breakpoint)."""
    client = gateway.anthropic()
    for model in ("gpt-4o-mini", "gemini-flash", "claude-sonnet"):
        answer = client.messages.create(model=model, max_tokens=20, messages=_ask_about(PDF_DOCUMENT))  # type: ignore[arg-type]
        assert answer.stop_reason == "end_turn"
    file = {
        "type": "file",
        "file": {"file_data": f"data:application/pdf;base64,{PDF}", "filename": "report.pdf"},
    }
    assert fake_openai.last_request.json["messages"][0]["content"][0] == file  # type: ignore[union-attr]
    inline = {"inlineData": {"mimeType": "application/pdf", "data": PDF}}
    assert fake_gemini.last_request.json["contents"][0]["parts"][0] == inline  # type: ignore[union-attr]
    sent = fake_anthropic.last_request.json["messages"][0]["content"][0]  # type: ignore[union-attr]
    assert sent == {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
        "cache_control": {"type": "ephemeral"},
    }


def test_plain_text_documents_are_sent_as_text(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    text_document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "the memo"},
    }
    gateway.anthropic().messages.create(
        model="gpt-4o-mini", max_tokens=20, messages=_ask_about(text_document)
    )  # type: ignore[arg-type]
    sent = fake_openai.last_request.json["messages"][0]["content"]  # type: ignore[union-attr]
    assert sent == [{"type": "text", "text": "the memo"}, {"type": "text", "text": "summarise"}]


def test_documents_by_url_are_refused_naming_the_source(gateway: RunningGateway) -> None:
    by_url = {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        gateway.anthropic().messages.create(model="gpt-4o-mini", max_tokens=20, messages=_ask_about(by_url))  # type: ignore[arg-type]
    assert "base64 or text" in refused.value.message
    assert gateway.sink.events == []  # refused before any backend was asked


@pytest.mark.parametrize("model", MODELS)
def test_an_image_without_its_data_or_url_is_refused_naming_it(
    gateway: RunningGateway,
    model: str,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
) -> None:
    """An image whose source lacks what its type needs (`data` for base64, `url` for a URL) went to
    the backend as an empty image (`data:image/png;base64,`, an empty URL), each vendor refusing it in
    its own words, if at all, after an attempt billed. It is a 400 naming the field, nothing sent."""
    client = gateway.anthropic()
    for source, field in (({"type": "base64", "media_type": "image/png"}, "data"), ({"type": "url"}, "url")):
        image = {"type": "image", "source": source}
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model=model, max_tokens=20, messages=_ask_about(image))  # type: ignore[arg-type]
        assert f"messages[0].content[0].source.{field}" in refused.value.message
    fakes = (fake_openai, fake_anthropic, fake_gemini)
    assert [r for fake in fakes for r in fake.requests if r.method == "POST"] == []
    assert gateway.sink.events == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_stop_string_the_server_names_is_the_messages_stop_sequence(
    compat_gateway: RunningGateway, stream: bool
) -> None:
    """vLLM says which stop string ended the answer (`stop_reason`); an Anthropic client was told
    `end_turn` and no `stop_sequence`, as for an answer the model ended itself. It is now told
    `stop_sequence` and the string, as Claude tells it."""
    client = compat_gateway.anthropic()
    asked = {
        "model": "vllm-served",
        "max_tokens": 20,
        "stop_sequences": ["END"],
        "messages": [{"role": "user", "content": "hi"}],
    }
    message = final_message(client, stream, asked)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    assert message.content[0].text == "Hello there"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("matched", "finish", "said"),
    [("END", "stop", "END"), (151645, "stop", None), ("END", "length", None)],
    ids=["stop-string", "stop-token", "not-a-stop"],
)
def test_sglangs_matched_stop_names_the_stop_sequence_only_for_a_stop_string(
    matched: object, finish: str, said: str | None
) -> None:
    """SGLang says `matched_stop`: the stop string, or the id of the stop token (an end of turn, which
    Claude calls `end_turn`)."""
    choice = {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": finish}
    body = {"id": "c1", "created": 1, "model": "m", "choices": [{**choice, "matched_stop": matched}]}
    response = openai_provider.chat_response(json.dumps(body).encode(), "m")
    assert response.choices[0].stop_sequence == said
    assert response.choices[0].extra == {"matched_stop": matched}  # still there for OpenAI clients


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_openai_refusal_is_the_messages_refusal(
    gateway: RunningGateway, fake_openai: FakeOpenAI, stream: bool
) -> None:
    """OpenAI says a refusal (structured outputs) in `refusal`, not in the content: an Anthropic client
    got an empty message that ended as `end_turn`, as if the model had nothing to say. It now gets
    the refusal's words as text and `stop_reason` `refusal`, as Claude says one."""
    fake_openai.refuse_with("I cannot help with that.")
    client = gateway.anthropic()
    asked = {"model": "gpt-4o-mini", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        with client.messages.stream(**asked) as events:  # type: ignore[arg-type]
            assert "".join(events.text_stream) == "I cannot help with that."
            message = events.get_final_message()
    else:
        message = client.messages.create(**asked)  # type: ignore[arg-type]
    assert message.stop_reason == "refusal"
    assert [(b.type, b.text) for b in message.content] == [("text", "I cannot help with that.")]  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_forced_tool_call_from_openai_stops_for_tool_use(
    gateway: RunningGateway, fake_openai: FakeOpenAI, stream: bool
) -> None:
    """OpenAI ends a call to the tool a named tool_choice forces with finish `stop` (as the fake
    does): an Anthropic client (`tool_choice: {"type": "tool"}`, the usual way to extract structured
    data) got its tool_use block with `stop_reason` `end_turn`, and an agent loop waiting for
    `tool_use` never ran the tool. Claude says `tool_use`; so does Weir now."""
    client = gateway.anthropic()
    asked = {
        "model": "gpt-4o-mini",
        "max_tokens": 100,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": 'weather {"city": "Lima"}'}],
    }
    message = final_message(client, stream, asked)
    sent = fake_openai.last_request.json  # type: ignore[union-attr]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert [block.type for block in message.content] == ["tool_use"]
    assert message.stop_reason == "tool_use"


CLAUDE_CODE_USER = "user_" + "a1" * 32 + "_account_" + "b" * 36 + "_session_" + "c" * 36


def test_a_long_metadata_user_id_reaches_openai_as_a_digest(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """Claude Code's `metadata.user_id` (about 150 characters) went to OpenAI as `user`, which takes 64
    at most: every request was refused with a 400. Such an id now goes as a digest of itself, the same
    for the same id; a short one as it is."""
    client = gateway.anthropic()
    hi = [{"role": "user", "content": "hi"}]
    sent = []
    for user_id in (CLAUDE_CODE_USER, CLAUDE_CODE_USER, "u-42"):
        answer = client.messages.create(
            model="gpt-4o-mini", max_tokens=20, messages=hi, metadata={"user_id": user_id}
        )  # type: ignore[arg-type]
        assert answer.content[0].text == "hi"  # type: ignore[union-attr]
        sent.append(fake_openai.last_request.json["user"])  # type: ignore[union-attr]
    assert sent[0] == sent[1] != CLAUDE_CODE_USER and len(sent[0]) <= 64
    assert sent[2] == "u-42"


def test_automatic_caching_reaches_claude_and_its_cache_is_read(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """A top-level `cache_control` asks Claude to cache up to the last cacheable block (automatic
    caching): it reaches Claude as sent, and the second request reads what the first wrote."""
    client = gateway.anthropic()
    asked: dict[str, Any] = {
        "model": "claude-sonnet",
        "max_tokens": 20,
        "system": LONG_SYSTEM,
        "cache_control": {"type": "ephemeral"},
    }
    first = client.messages.create(**asked, messages=[{"role": "user", "content": "hi"}])
    assert fake_anthropic.last_request.json["cache_control"] == {"type": "ephemeral"}
    assert first.usage.cache_creation_input_tokens > 1024
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
        {"role": "user", "content": "and again"},
    ]
    second = client.messages.create(**asked, messages=history)
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    first_event, second_event = gateway.sink.events  # the ledger bills the writes and the reads
    assert first_event.usage.cache_write_tokens == first.usage.cache_creation_input_tokens
    assert second_event.usage.cached_input_tokens == second.usage.cache_read_input_tokens


@pytest.mark.parametrize("model", ["gpt-4o-mini", "gemini-flash"])
def test_automatic_caching_is_left_out_for_other_vendors(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini, model: str
) -> None:
    """OpenAI and Gemini cache prompts on their own and know no `cache_control` (OpenAI refuses
    unknown fields): a route failing over from Claude goes on without it."""
    message = gateway.anthropic().messages.create(
        model=model,
        max_tokens=20,
        cache_control={"type": "ephemeral"},
        messages=[{"role": "user", "content": "hi"}],
    )
    assert message.content[0].text == "hi"  # type: ignore[union-attr]
    sent = (fake_openai if model == "gpt-4o-mini" else fake_gemini).last_request
    assert sent is not None and "cache_control" not in json.dumps(sent.json)


def test_a_prefill_asked_for_in_a_user_turn_is_told_the_same_prompt_when_the_cache_read_it(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """OpenAI answers a prefill afresh, so the rest is asked for in a user turn of Weir's own, which
    the client never sent and is not told. That turn ends the prompt: uncached the first time, but
    the same request again is read from OpenAI's automatic cache to its end (128-token steps), and
    the turn was then taken off the uncached input alone, clamped at 0: `input_tokens: 0`, and the
    turn still told among the cache reads. The same prompt is told the same, cached or not."""
    # 1118 words, the prefill's 2 and the asking turn's 32: 1152 tokens to the fake, nine 128-steps.
    messages = [{"role": "user", "content": "w " * 1118}, {"role": "assistant", "content": "Once upon"}]
    client = gateway.anthropic()
    first, second = (
        client.messages.create(model="gpt-4o-mini", max_tokens=20, messages=messages)  # type: ignore[arg-type]
        for _ in range(2)
    )
    assert [e.usage.cached_input_tokens for e in gateway.sink.events] == [0, 1152]  # as OpenAI reported
    assert second.usage.cache_read_input_tokens > 0
    told = [m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) for m in (first, second)]
    assert told[0] == told[1] < 1152


def test_the_service_tier_served_is_in_the_usage(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_openai: FakeOpenAI
) -> None:
    """Anthropic's usage says the tier that served the request (`usage.service_tier`: `priority`
    where `auto` found priority capacity, else `standard`), which the ledger bills: it never reached
    the client, which could not tell whether its `auto` got priority capacity. An OpenAI backend's
    tier is said in Anthropic's words where it has one (`priority`; `default` is `standard`)."""
    client = gateway.anthropic()
    hi: Any = [{"role": "user", "content": "hi"}]
    fake_anthropic.serve_auto_at("priority")
    asked: dict[str, Any] = {"model": "claude-sonnet", "max_tokens": 20, "messages": hi}
    assert client.messages.create(**asked, service_tier="auto").usage.service_tier == "priority"
    with client.messages.stream(**asked, service_tier="auto") as stream:
        assert stream.get_final_message().usage.service_tier == "priority"
    assert client.messages.create(**asked, service_tier="standard_only").usage.service_tier == "standard"
    on_openai: dict[str, Any] = {**asked, "model": "gpt-4o-mini"}
    assert client.messages.create(**on_openai).usage.service_tier == "standard"
    fake_openai.serve_auto_at("priority")
    assert client.messages.create(**on_openai, service_tier="auto").usage.service_tier == "priority"
    assert [e.usage.service_tier for e in gateway.sink.events] == [
        "priority",
        "priority",
        "standard",
        "default",
        "priority",
    ]
