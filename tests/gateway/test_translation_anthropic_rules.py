"""What Claude is sent for a request another vendor's client may send: sampling parameters, stop
sequences, thinking, empty content and tool errors fitted to the rules Anthropic's API enforces.

Clients use the official SDKs through the gateway to the fake Anthropic. Where the fake is laxer than
the API (it accepts what Anthropic refuses), the tests assert on the body Claude was sent; the model
tables are checked on the pure translation (`anthropic.chat_request`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import openai
import pytest

from gateway.config import Backend
from gateway.providers import anthropic
from gateway.types import ChatRequest
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import HI, LOOKUP, RunningGateway

ANTHROPIC = Backend(name="a", type="anthropic", base_url="http://a", api_key="k")


def sent_to(model: str, **fields: Any) -> dict[str, Any]:
    """The Messages body `model` is sent for an OpenAI-shaped request with `fields`."""
    request = msgspec.convert({"model": model, "messages": HI, **fields}, ChatRequest)
    return json.loads(anthropic.chat_request(ANTHROPIC, request, model).body)


# --- sampling parameters -----------------------------------------------------------------------


def test_temperature_and_top_p_together_are_not_both_sent_to_claude_4_5(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Sonnet 4.5, Haiku 4.5, Opus 4.1 and later refuse both at once ("`temperature` and `top_p`
    cannot both be specified for this model"), which OpenAI clients send: only the temperature goes."""
    gateway.openai().chat.completions.create(
        model="claude-sonnet", messages=HI, temperature=0.2, top_p=0.9, max_tokens=20
    )
    sent = fake_anthropic.last_request.json
    assert sent["model"] == "claude-sonnet-4-5"
    assert sent["temperature"] == 0.2
    assert "top_p" not in sent


@pytest.mark.parametrize(
    ("model", "both"),
    [
        ("claude-3-5-haiku-20241022", True),
        ("claude-sonnet-4-20250514", True),
        ("claude-opus-4-0", True),
        ("claude-opus-4-1", False),
        ("claude-haiku-4-5-20251001", False),
        ("claude-opus-4-6", False),
        ("claude-opus-5", False),  # unknown: taken to be newer
    ],
)
def test_only_claude_models_before_4_1_are_sent_temperature_beside_top_p(model: str, both: bool) -> None:
    """The model table: older models take both, and a top_p alone is always sent."""
    sent = sent_to(model, temperature=0.2, top_p=0.9)
    assert ("top_p" in sent) is both
    assert sent["temperature"] == 0.2
    assert sent_to(model, top_p=0.9)["top_p"] == 0.9


def test_a_temperature_above_claudes_range_is_sent_as_its_top() -> None:
    """Claude takes 0..1, OpenAI 0..2: above 1 is clamped to 1 rather than refused."""
    assert sent_to("claude-sonnet-4-5", temperature=1.5)["temperature"] == 1.0
    assert sent_to("claude-sonnet-4-5", temperature=0.7)["temperature"] == 0.7


def test_an_anthropic_clients_temperature_beside_thinking_is_left_out(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """With thinking Anthropic takes only temperature 1, its default ("temperature may only be set to 1
    when thinking is enabled"): another temperature is left out, the thinking kept."""
    gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=4000,
        thinking={"type": "enabled", "budget_tokens": 2048},
        messages=HI,
        extra_body={"temperature": 0.3},  # the SDK has no parameter of its own for it now
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert "temperature" not in sent


@pytest.mark.parametrize(("top_p", "sent_top_p"), [(0.5, 0.95), (0.98, 0.98)])
def test_top_k_and_a_low_top_p_beside_thinking_are_fitted_for_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, top_p: float, sent_top_p: float
) -> None:
    """With thinking Anthropic refuses `top_k` and a `top_p` under 0.95 ("thinking isn't compatible
    with temperature or top_k modifications"; "top_p may be set between 0.95 and 1"): top_k is left
    out, a lower top_p raised to 0.95, the thinking kept."""
    gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=4000,
        thinking={"type": "enabled", "budget_tokens": 2048},
        messages=HI,
        extra_body={"top_k": 40, "top_p": top_p},  # the SDK has no parameters of its own for them now
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert "top_k" not in sent
    assert sent["top_p"] == sent_top_p


def test_an_openai_clients_top_p_beside_its_effort_is_raised_for_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """An OpenAI client's effort becomes thinking: its top_p under 0.95 goes as 0.95. Without thinking
    top_k and top_p go as they are."""
    client = gateway.openai()
    client.chat.completions.create(
        model="claude-sonnet", messages=HI, reasoning_effort="low", top_p=0.3, max_tokens=4000
    )
    sent = fake_anthropic.last_request.json
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert sent["top_p"] == 0.95
    client.chat.completions.create(
        model="claude-sonnet", messages=HI, top_p=0.3, max_tokens=20, extra_body={"top_k": 5}
    )
    sent = fake_anthropic.last_request.json
    assert (sent["top_p"], sent["top_k"]) == (0.3, 5)


# --- stop sequences ------------------------------------------------------------------------------


@pytest.mark.parametrize(("stop", "kept"), [(["\n"], None), (["\n\n", "END"], ["END"]), (" ", None)])
def test_whitespace_only_stop_sequences_are_not_sent_to_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stop: Any, kept: list[str] | None
) -> None:
    """Anthropic refuses a whitespace-only stop sequence ("each stop sequence must contain
    non-whitespace"); OpenAI takes `stop: ["\\n"]`. Those are left out, and the field when none is left."""
    gateway.openai().chat.completions.create(model="claude-sonnet", messages=HI, stop=stop, max_tokens=20)
    assert fake_anthropic.last_request.json.get("stop_sequences") == kept


# --- thinking beside a forced tool ----------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_an_openai_effort_is_not_turned_into_thinking_beside_a_forced_tool_for_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, choice: Any
) -> None:
    """Anthropic: "Tool use with extended thinking only supports tool_choice auto or none". An OpenAI
    client's effort with a forced tool_choice keeps the forced tool and sends no thinking."""
    gateway.openai().chat.completions.create(
        model="claude-sonnet",
        messages=[{"role": "user", "content": "call lookup"}],
        tools=[LOOKUP],
        tool_choice=choice,
        reasoning_effort="high",
        max_tokens=20000,
    )
    sent = fake_anthropic.last_request.json
    assert sent["tool_choice"]["type"] in ("any", "tool")
    assert "thinking" not in sent


def test_an_openai_effort_beside_tool_choice_auto_still_thinks(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Only a forced tool rules thinking out: with `auto` the effort is still a thinking budget."""
    gateway.openai().chat.completions.create(
        model="claude-sonnet",
        messages=[{"role": "user", "content": "call lookup"}],
        tools=[LOOKUP],
        tool_choice="auto",
        reasoning_effort="high",
        max_tokens=20000,
    )
    assert fake_anthropic.last_request.json["thinking"] == {"type": "enabled", "budget_tokens": 16384}


# --- empty content --------------------------------------------------------------------------------


EMPTY_ASSISTANT: Any = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "second question"},
]
EMPTY_TEXT_PART: Any = [
    {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hello"}]},
]
# A stored reply of a newline alone, and a part of spaces: Anthropic refuses whitespace-only text blocks
# too ("text content blocks must contain non-whitespace text").
BLANK_ASSISTANT: Any = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "\n\n"},
    {"role": "user", "content": "second question"},
]
BLANK_TEXT_PART: Any = [
    {"role": "user", "content": [{"type": "text", "text": "  "}, {"type": "text", "text": "hello"}]},
]
MERGED_QUESTIONS: Any = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "first question"}, {"type": "text", "text": "second question"}],
    }
]


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            EMPTY_ASSISTANT,
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first question"},
                        {"type": "text", "text": "second question"},
                    ],
                }
            ],
        ),
        (EMPTY_TEXT_PART, [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]),
        (BLANK_ASSISTANT, MERGED_QUESTIONS),
        (BLANK_TEXT_PART, [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]),
    ],
    ids=["empty-turn", "empty-part", "whitespace-turn", "whitespace-part"],
)
def test_claude_is_never_sent_an_empty_message_or_empty_text_block(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, messages: Any, expected: Any
) -> None:
    """Anthropic refuses an empty turn ("all messages must have non-empty content except for the
    optional final assistant message") and empty or whitespace-only text blocks, which OpenAI takes (a
    stored empty reply): such parts are left out, a turn left empty too, and the user turns around it
    merged."""
    gateway.openai().chat.completions.create(model="claude-sonnet", messages=messages, max_tokens=20)
    assert fake_anthropic.last_request.json["messages"] == expected


# A conversation the client ends with a blank question: left out, it would end with Claude's own turn
# (which Claude continues instead of answering) or with no turn at all.
ENDS_BLANK: Any = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "an answer"},
    {"role": "user", "content": " \n"},
]
ENDS_BLANK_PART: Any = [*ENDS_BLANK[:2], {"role": "user", "content": [{"type": "text", "text": ""}]}]
ONLY_BLANK: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "\t"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (ENDS_BLANK, "messages[2].content"),
        (ENDS_BLANK_PART, "messages[2].content"),
        (ONLY_BLANK, "messages[1].content"),
    ],
    ids=["after-an-answer", "empty-part", "only-question"],
)
def test_a_final_blank_user_message_is_a_400_naming_it_not_a_prefill(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, messages: Any, param: str, stream: bool
) -> None:
    """Anthropic refuses a blank text block; Weir leaves one out, but not the final user message's
    only content: the conversation would mean something else (Claude goes on with its last answer).
    A 400 naming the message, before anything is sent."""
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model="claude-sonnet", messages=messages, stream=stream)
    body = caught.value.body
    assert isinstance(body, dict) and (body["type"], body["param"]) == ("invalid_request_error", param)
    assert "final user message" in body["message"] and "Anthropic" in body["message"]
    assert not fake_anthropic.requests


def test_a_final_blank_user_message_after_a_question_is_left_out(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """A blank message after the user's own question leaves the question last: it is left out as any
    blank turn is, and Claude answers the question."""
    messages: Any = [{"role": "user", "content": "first question"}, {"role": "user", "content": "  "}]
    gateway.openai().chat.completions.create(model="claude-sonnet", messages=messages, max_tokens=20)
    assert fake_anthropic.last_request.json["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "first question"}]}
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_ending_in_whitespace_reaches_claude_without_it(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """A conversation ending with an assistant turn asks Claude to go on from it, and Anthropic refuses
    one whose text ends in whitespace ("final assistant content cannot end with trailing whitespace"),
    which an OpenAI client's `"The answer is "` does: Claude gets it without that whitespace, and the
    client its answer, not a 400."""
    messages: Any = [
        {"role": "user", "content": "sky is blue"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Well,"}, {"type": "text", "text": "it is \n"}],
        },
    ]
    client = gateway.openai()
    if stream:
        chunks = client.chat.completions.create(model="claude-sonnet", messages=messages, stream=True)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    else:
        reply = client.chat.completions.create(model="claude-sonnet", messages=messages)
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content
    assert fake_anthropic.last_request.json["messages"][-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Well,"}, {"type": "text", "text": "it is"}],
    }


# --- an Anthropic client's tool error -------------------------------------------------------------


def send_failed_tool_result(gateway: RunningGateway, model: str) -> None:
    """An Anthropic client's turn after its `lookup` tool failed: a tool_result with `is_error`."""
    tool: Any = {"name": "lookup", "input_schema": {"type": "object", "properties": {}}}
    failed = {"type": "tool_result", "tool_use_id": "toolu_01", "content": "timeout", "is_error": True}
    gateway.anthropic().messages.create(
        model=model,
        max_tokens=100,
        tools=[tool],
        messages=[
            {"role": "user", "content": "call lookup"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_01", "name": "lookup", "input": {}}],
            },
            {"role": "user", "content": [failed]},
        ],
    )


def test_an_anthropic_clients_tool_result_error_flag_reaches_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """`is_error: true` on a tool_result tells Claude the tool failed: it reaches Claude as the flag,
    beside the client's own content (which had "Error: " put before it too: the failure said twice)."""
    send_failed_tool_result(gateway, "claude-sonnet")
    (result,) = fake_anthropic.last_request.json["messages"][-1]["content"]
    assert result == {
        "type": "tool_result",
        "tool_use_id": "toolu_01",
        "content": "timeout",
        "is_error": True,
    }


def test_an_anthropic_clients_tool_error_reaches_openai_in_words_only(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """OpenAI's tool message has no error flag (and OpenAI refuses fields it does not know): the
    failure is said in the content, the flag left out."""
    send_failed_tool_result(gateway, "gpt-4o-mini")
    result = fake_openai.last_request.json["messages"][-1]
    assert result == {"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_01"}


def test_an_anthropic_clients_tool_error_reaches_gemini_as_its_error_response(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Gemini's functionResponse says a failure under its `error` key (without one, the whole response
    is the function's output): the client's content there, not its words under `result`."""
    send_failed_tool_result(gateway, "gemini-flash")
    (part,) = fake_gemini.last_request.json["contents"][-1]["parts"]
    assert part["functionResponse"]["response"] == {"error": "timeout"}


# --- Claude's own stop reasons ----------------------------------------------------------------------


@pytest.mark.parametrize("reason", ["pause_turn", "model_context_window_exceeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_anthropic_client_gets_claudes_own_stop_reason(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, reason: str, stream: bool
) -> None:
    """Claude's `pause_turn` (a server tool's long turn, to be resumed) and
    `model_context_window_exceeded` had only OpenAI's words on the way back (`stop`, `length`): an
    Anthropic client was told `end_turn` or `max_tokens` instead. It now gets Claude's own."""
    fake_anthropic.stop_next_with(reason)
    client = gateway.anthropic()
    if stream:
        with client.messages.stream(model="claude-sonnet", max_tokens=100, messages=HI) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(model="claude-sonnet", max_tokens=100, messages=HI)
    assert message.stop_reason == reason
    assert message.content[0].type == "text"


@pytest.mark.parametrize(
    ("reason", "finish"), [("pause_turn", "stop"), ("model_context_window_exceeded", "length")]
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_openai_client_gets_the_nearest_finish_reason_for_claudes_own(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, reason: str, finish: str, stream: bool
) -> None:
    """OpenAI's finish_reason has no such values: the nearest, and nothing internal in the choice."""
    fake_anthropic.stop_next_with(reason)
    client = gateway.openai()
    if stream:
        chunks = list(
            client.chat.completions.create(model="claude-sonnet", messages=HI, max_tokens=100, stream=True)
        )
        (last,) = [choice for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        assert last.finish_reason == finish
        assert "anthropic_stop_reason" not in last.model_dump()
    else:
        response = client.chat.completions.create(model="claude-sonnet", messages=HI, max_tokens=100)
        assert response.choices[0].finish_reason == finish
        assert "anthropic_stop_reason" not in response.choices[0].model_dump()
