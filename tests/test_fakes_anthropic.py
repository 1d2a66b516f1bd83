"""The fake Anthropic server, driven by the official `anthropic` SDK."""

from __future__ import annotations

import base64
import json

import anthropic
import httpx
import pytest

from tests.fakes import FakeAnthropic, Fault

MODEL = "claude-sonnet-4-5"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def client(fake_anthropic: FakeAnthropic) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=fake_anthropic.base_url, api_key=fake_anthropic.api_key, max_retries=0, timeout=5
    )


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_message_echoes_with_full_usage(client: anthropic.Anthropic, fake_anthropic: FakeAnthropic) -> None:
    message = client.messages.create(
        model=MODEL, max_tokens=100, system="be brief", messages=user("hello there")
    )
    assert message.type == "message" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "hello there"
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 2)
    assert message.usage.cache_read_input_tokens == message.usage.cache_creation_input_tokens == 0
    recorded = fake_anthropic.last_request
    key = recorded.headers.get("x-api-key") or recorded.headers["authorization"].removeprefix("Bearer ")
    assert key == fake_anthropic.api_key and "anthropic-version" in recorded.headers


def test_stream_event_sequence(fake_anthropic: FakeAnthropic) -> None:
    with httpx.stream(
        "POST",
        f"{fake_anthropic.base_url}/v1/messages",
        headers={"x-api-key": fake_anthropic.api_key, "anthropic-version": "2023-06-01"},
        json={"model": MODEL, "max_tokens": 50, "stream": True, "messages": user("one two")},
    ) as response:
        assert response.headers["request-id"].startswith("req_")
        frames = [f for f in response.read().decode().split("\n\n") if f]
    events = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert events == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert data[0]["message"]["usage"]["input_tokens"] == 2
    assert [d["delta"]["text"] for d in data if d["type"] == "content_block_delta"] == ["one", " two"]
    assert data[6]["delta"]["stop_reason"] == "end_turn" and data[6]["usage"]["output_tokens"] == 2


def test_sdk_stream_helper_assembles_text_and_tool_use(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=100, messages=user("a b c")) as stream:
        assert "".join(stream.text_stream) == "a b c"
    with client.messages.stream(
        model=MODEL,
        max_tokens=100,
        tools=[WEATHER_TOOL],
        messages=user('call get_weather {"location": "Oslo"}'),
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert (final.content[1].name, final.content[1].input) == ("get_weather", {"location": "Oslo"})
    assert final.stop_reason == "tool_use"


def test_tool_choice_and_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    forced = client.messages.create(
        model=MODEL,
        max_tokens=100,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "any"},
        messages=user("weather?"),
    )
    use = forced.content[-1]
    assert use.type == "tool_use" and use.input == {"location": "example"}
    follow_up = client.messages.create(
        model=MODEL,
        max_tokens=100,
        tools=[WEATHER_TOOL],
        messages=[
            *user("weather?"),
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in forced.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]},
        ],
    )
    assert follow_up.content[0].text == "Tool get_weather returned: rain"
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        client.messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
                }
            ],
        )


def test_max_tokens_stop_sequences_and_images(client: anthropic.Anthropic) -> None:
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=user("a b c d"))
    assert (cut.content[0].text, cut.stop_reason) == ("a b", "max_tokens")
    stopped = client.messages.create(
        model=MODEL, max_tokens=50, stop_sequences=["STOP"], messages=user("x y STOP z")
    )
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == (
        "stop_sequence",
        "STOP",
        "x y ",
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    seen = client.messages.create(
        model=MODEL,
        max_tokens=50,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "what"}]}],
    )
    assert seen.content[0].text == "what [image]" and seen.usage.input_tokens == 1 + 1600


def test_cache_control_writes_then_reads_split_by_ttl(client: anthropic.Anthropic) -> None:
    tools_block = {**WEATHER_TOOL, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    system = [
        {
            "type": "text",
            "text": " ".join(f"s{i}" for i in range(1200)),
            "cache_control": {"type": "ephemeral"},
        },
    ]
    first = client.messages.create(
        model=MODEL, max_tokens=5, tools=[tools_block], system=system, messages=user("q one")
    )
    tool_tokens = (
        client.messages.count_tokens(model=MODEL, tools=[WEATHER_TOOL], messages=user("x")).input_tokens - 1
    )
    u = first.usage
    # the tool breakpoint is under the 1024-token minimum, so the 1h breakpoint is ignored
    assert (u.cache_read_input_tokens, u.cache_creation.ephemeral_5m_input_tokens) == (0, tool_tokens + 1200)
    assert u.cache_creation.ephemeral_1h_input_tokens == 0 and u.input_tokens == 2
    second = client.messages.create(
        model=MODEL, max_tokens=5, tools=[tools_block], system=system, messages=user("q two")
    )
    assert (second.usage.cache_read_input_tokens, second.usage.cache_creation_input_tokens) == (
        tool_tokens + 1200,
        0,
    )
    assert second.usage.input_tokens == 2


def test_multi_turn_breakpoint_reads_earlier_prefix_and_writes_the_rest(
    client: anthropic.Anthropic, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.min_cache_tokens = 10
    doc = " ".join(f"d{i}" for i in range(20))
    turn1 = [
        {
            "role": "user",
            "content": [{"type": "text", "text": doc, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        }
    ]
    first = client.messages.create(model=MODEL, max_tokens=5, messages=turn1)
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == 20
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "more words here", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=5, messages=turn2)
    assert second.usage.cache_read_input_tokens == 20
    assert second.usage.cache_creation.ephemeral_5m_input_tokens == 4  # "ok" + "more words here"
    assert second.usage.input_tokens == 0


def test_thinking_block_and_signature(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model=MODEL,
        max_tokens=2000,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=user("a b"),
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (
        message.content[0].signature and message.usage.output_tokens == 6 + 2
    )  # "Let me think about: a b" + "a b"
    with client.messages.stream(
        model=MODEL,
        max_tokens=2000,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=user("a b"),
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == "Let me think about: a b"


def test_thinking_sent_back_is_checked(client: anthropic.Anthropic, fake_anthropic: FakeAnthropic) -> None:
    ask = {"model": MODEL, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    first = client.messages.create(
        **ask, tools=[WEATHER_TOOL], tool_choice={"type": "auto"}, messages=user("weather? call get_weather")
    )
    thinking, *rest = [b.model_dump(exclude_none=True) for b in first.content]
    assert thinking["signature"] == fake_anthropic.sign(thinking["thinking"])
    use = first.content[-1]
    assert use.type == "tool_use"
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]}

    def follow_up(assistant: list[dict]) -> anthropic.types.Message:
        return client.messages.create(
            **ask,
            tools=[WEATHER_TOOL],
            messages=[*user("weather?"), {"role": "assistant", "content": assistant}, result],
        )

    assert follow_up([thinking, *rest]).content[-1].text == "Tool get_weather returned: rain"
    assert follow_up([{"type": "redacted_thinking", "data": "opaque"}, *rest]).stop_reason == "end_turn"
    for bad in (
        {**thinking, "signature": "forged"},
        {**thinking, "thinking": "edited"},
        {"type": "thinking", "thinking": "x"},
    ):
        with pytest.raises(anthropic.BadRequestError, match="Invalid `signature`"):
            follow_up([bad, *rest])
    with pytest.raises(anthropic.BadRequestError, match="must start with a thinking block"):
        follow_up(rest)


def test_errors_use_anthropic_shape(client: anthropic.Anthropic, fake_anthropic: FakeAnthropic) -> None:
    bad = anthropic.Anthropic(base_url=fake_anthropic.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=MODEL, max_tokens=5, messages=user("x"))
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-9", max_tokens=5, messages=user("x"))
    raw = httpx.post(
        f"{fake_anthropic.base_url}/v1/messages",
        headers={"x-api-key": fake_anthropic.api_key, "anthropic-version": "2023-06-01"},
        json={"model": MODEL, "messages": user("x")},
    )
    assert raw.status_code == 400 and raw.json()["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }
    fake_anthropic.fail_next(Fault.status(529))
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(model=MODEL, max_tokens=5, messages=user("x"))
    assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
    fake_anthropic.fail_next(Fault.status(429, retry_after=7))
    with pytest.raises(anthropic.RateLimitError) as err:
        client.messages.create(model=MODEL, max_tokens=5, messages=user("x"))
    assert err.value.response.headers["retry-after"] == "7"


def test_error_event_mid_stream(client: anthropic.Anthropic, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.fail_next(Fault.stream_error(after=4, code=529))
    received: list[str] = []
    with (
        pytest.raises(anthropic.APIStatusError, match="Overloaded"),
        client.messages.stream(model=MODEL, max_tokens=50, messages=user("a b c d")) as stream,
    ):
        for text in stream.text_stream:
            received.append(text)
    assert received == ["a"]


def test_stream_cut_raises_in_sdk(client: anthropic.Anthropic, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.fail_next(Fault.cut_stream(after=5))
    # the SDK does not wrap errors raised while iterating a stream
    with (
        pytest.raises(Exception, match="incomplete chunked read"),
        client.messages.stream(model=MODEL, max_tokens=50, messages=user("a b c d")) as stream,
    ):
        for _ in stream.text_stream:
            pass


def test_set_next_usage_renders_anthropic_fields(
    client: anthropic.Anthropic, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.set_next_usage(
        input_tokens=10, cached_input_tokens=2000, cache_write_1h_tokens=300, output_tokens=42
    )
    with client.messages.stream(model=MODEL, max_tokens=50, messages=user("x")) as stream:
        usage = stream.get_final_message().usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (
        10,
        2000,
        300,
    )
    assert usage.cache_creation.ephemeral_1h_input_tokens == 300 and usage.output_tokens == 42
    assert fake_anthropic.last_usage.prompt_tokens == 2310


def test_count_tokens_and_models(client: anthropic.Anthropic) -> None:
    assert client.messages.count_tokens(model=MODEL, messages=user("a b c")).input_tokens == 3
    assert MODEL in [m.id for m in client.models.list().data]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens: Extra inputs are not permitted"):
        client.messages.count_tokens(model=MODEL, messages=user("a"), extra_body={"max_tokens": 5})


def test_rejects_what_anthropic_rejects(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="maximum allowed number of output tokens"):
        client.messages.create(model=MODEL, max_tokens=100_000, messages=user("x"))
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(
            model=MODEL,
            max_tokens=500,
            thinking={"type": "enabled", "budget_tokens": 512},
            messages=user("x"),
        )
    with pytest.raises(anthropic.BadRequestError, match=r"greater than `thinking\.budget_tokens`"):
        client.messages.create(
            model=MODEL,
            max_tokens=1500,
            thinking={"type": "enabled", "budget_tokens": 2048},
            messages=user("x"),
        )
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(
            model=MODEL, max_tokens=10, messages=user("x"), extra_body={"temperature": 1.5}
        )
    marked = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks with cache_control"):
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": marked}])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ([{"type": "text", "text": ""}], "must be non-empty"),
        ([{"type": "text", "text": " \n"}], "must contain non-whitespace text"),
        ("\n", "must contain non-whitespace text"),
    ],
    ids=["empty-block", "blank-block", "blank-string"],
)
def test_rejects_empty_and_blank_text_blocks(
    client: anthropic.Anthropic, content: object, error: str
) -> None:
    """As Anthropic does ("messages: text content blocks must contain non-whitespace text"), in any turn."""
    messages = [*user("hi"), {"role": "assistant", "content": content}, *user("again")]
    with pytest.raises(anthropic.BadRequestError, match=error):
        client.messages.create(model=MODEL, max_tokens=10, messages=messages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("media_type", "error"),
    [("image/jpg", "Input should be 'image/jpeg'"), ("image/jpeg", "does not match the provided media type")],
)
def test_rejects_an_image_type_anthropic_does_not_take(
    client: anthropic.Anthropic, media_type: str, error: str
) -> None:
    """As Anthropic does: four type names alone, and the one the bytes are (here a PNG's)."""
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 8).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": png}}
    with pytest.raises(anthropic.BadRequestError, match=error):
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [image]}])  # type: ignore[list-item]


def test_prefill_is_continued(client: anthropic.Anthropic) -> None:
    messages = [*user("alpha beta gamma"), {"role": "assistant", "content": "alpha"}]
    with client.messages.stream(model=MODEL, max_tokens=50, messages=messages) as stream:
        assert "".join(stream.text_stream) == " beta gamma"
