"""/v1/responses: OpenAI's Responses API, stateless, with the official openai SDK, to every backend."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from gateway.errors import InvalidRequest
from gateway.estimate import input_tokens
from gateway.responses_inbound import ResponsesRequest, responses_param, stream_events, to_canonical
from gateway.types import (
    ChatChunk,
    ChunkChoice,
    Delta,
    FunctionCallDelta,
    ReasoningBlock,
    RedactedReasoning,
    ToolCallDelta,
)
from gateway.usage import Usage
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import DEMO_KEY, PARALLEL_CALLS, RunningGateway

MODELS = ["gpt-4o-mini", "claude-sonnet", "gemini-flash"]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL_WEATHER = 'call get_weather {"city": "Lima"}'
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()


@pytest.mark.parametrize("model", MODELS)
def test_text_response(gateway: RunningGateway, model: str) -> None:
    response = gateway.openai().responses.create(model=model, input="hello over there")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.model == model
    assert response.output_text == "hello over there"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.store is False and response.previous_response_id is None
    usage = response.usage
    assert usage is not None
    [event] = gateway.sink.events
    # input_tokens counts cache reads and writes, as OpenAI's does; cached_tokens is part of it.
    assert usage.input_tokens == event.usage.prompt_tokens > 0
    assert usage.input_tokens_details.cached_tokens == event.usage.cached_input_tokens
    assert usage.output_tokens == event.usage.output_tokens == 3
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert event.route == model


def test_cached_tokens_are_inside_input_tokens(gateway: RunningGateway) -> None:
    client = gateway.openai()
    long_prompt = "word " * 1500
    client.responses.create(model="gpt-4o-mini", input=long_prompt, max_output_tokens=5)
    again = client.responses.create(model="gpt-4o-mini", input=long_prompt, max_output_tokens=5)
    assert again.usage is not None
    assert again.usage.input_tokens_details.cached_tokens >= 1024
    assert again.usage.input_tokens == gateway.sink.events[1].usage.prompt_tokens


@pytest.mark.parametrize("model", MODELS)
def test_wire_shapes_validate_against_the_sdk_models(gateway: RunningGateway, model: str) -> None:
    # The SDK builds its objects without validation; validating strictly catches a missing field.
    body = {"model": model, "input": CALL_WEATHER, "tools": [WEATHER], "max_output_tokens": 50}
    headers = {"authorization": f"Bearer {DEMO_KEY}"}
    plain = httpx.post(f"{gateway.url}/v1/responses", json=body, headers=headers, timeout=10)
    response = Response.model_validate(plain.json())
    assert response.output[-1].type == "function_call"
    streamed = httpx.post(
        f"{gateway.url}/v1/responses", json={**body, "stream": True}, headers=headers, timeout=10
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    frames = [frame for frame in streamed.text.split("\n\n") if frame]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        event = adapter.validate_python(json.loads(data_line.removeprefix("data: ")))
        assert event_line == f"event: {event.type}"
    assert event.type == "response.completed"


@pytest.mark.parametrize("model", MODELS)
def test_instructions_and_list_input(gateway: RunningGateway, model: str) -> None:
    response = gateway.openai().responses.create(
        model=model,
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": "earlier question"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "earlier answer"}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "describe"},
                    {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}", "detail": "auto"},
                ],
            },
        ],
    )
    assert response.output_text == "describe [image]"
    assert response.instructions == "Be brief."


def test_request_reaches_openai_as_chat(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    gateway.openai().responses.create(
        model="gpt-4o-mini",
        instructions="Be brief.",
        input=[{"role": "developer", "content": "Use metric units."}, {"role": "user", "content": "hi"}],
        max_output_tokens=30,
        temperature=0.5,
        top_p=0.9,
        store=True,
        include=["message.output_text.logprobs"],
        truncation="auto",
        metadata={"team": "a"},
        extra_body={"prompt_cache_key": "k"},
    )
    sent = fake_openai.last_request.json
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "hi"},
    ]
    assert sent["max_completion_tokens"] == 30 and sent["temperature"] == 0.5 and sent["top_p"] == 0.9
    # Responses-only parameters are not chat parameters: never forwarded to a chat endpoint.
    assert not {"store", "include", "truncation", "input"} & set(sent)
    assert sent["prompt_cache_key"] == "k"  # chat's too: test_prompt_cache_and_safety_...


def test_prompt_cache_and_safety_settings_reach_a_chat_backend_too(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Chat completions takes `prompt_cache_key`, `prompt_cache_retention`, `safety_identifier` and
    `text.verbosity` (as `verbosity`) under the same names: a Responses client's reached OpenAI's Responses API but not its chat completions,
    whose prompt cache was then routed otherwise than the client asked; Claude takes the safety
    identifier as its end-user id, as it does a chat client's."""
    settings = {"prompt_cache_key": "thread-1", "prompt_cache_retention": "24h", "safety_identifier": "u-1"}
    client = gateway.openai()
    text: Any = {"verbosity": "low"}  # chat's `verbosity`: gpt-5 answered at its default length
    client.responses.create(model="gpt-4o-mini", input="hi", user="old-style", text=text, extra_body=settings)
    sent = fake_openai.last_request.json
    assert {name: sent.get(name) for name in settings} == settings
    assert sent["user"] == "old-style" and sent["verbosity"] == "low"
    client.responses.create(
        model="claude-sonnet", input="hi", user="old-style", text=text, extra_body=settings
    )
    claude = fake_anthropic.last_request.json
    assert claude["metadata"] == {"user_id": "u-1"}
    assert not {"prompt_cache_key", "prompt_cache_retention", "safety_identifier", "verbosity"} & set(claude)


def test_metadata_is_echoed_but_never_sent_upstream(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    # Responses' metadata tags the stored response. As chat's `metadata` OpenAI refuses it without
    # `store` ("The 'metadata' parameter is only allowed when 'store' is enabled."), and Mistral refuses
    # any field it does not know; Weir stores nothing, so it stays in the gateway (route conditions).
    client = gateway.openai()
    response = client.responses.create(model="gpt-4o-mini", input="hi", metadata={"team": "a"})
    assert response.metadata == {"team": "a"}
    with client.responses.stream(model="gpt-4o-mini", input="hi", metadata={"team": "b"}) as stream:
        streamed = stream.get_final_response()
    assert streamed.metadata == {"team": "b"}
    assert [request.json.get("metadata") for request in fake_openai.posts] == [None, None]


@pytest.mark.parametrize("model", MODELS)
def test_stream_event_sequence(gateway: RunningGateway, model: str) -> None:
    stream = gateway.openai().responses.create(model=model, input="stream these four words", stream=True)
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-5:] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == "stream these four words" and len(deltas) == 4
    created, completed = events[0], events[-1]
    assert created.type == "response.created" and created.response.status == "in_progress"
    assert created.response.output == []
    assert completed.type == "response.completed" and completed.response.id == created.response.id
    assert completed.response.output_text == "stream these four words"
    usage = completed.response.usage
    assert usage is not None and usage.output_tokens == 4
    [event] = gateway.sink.events
    assert usage.input_tokens == event.usage.prompt_tokens > 0


@pytest.mark.parametrize("model", MODELS)
def test_stream_helper(gateway: RunningGateway, model: str) -> None:
    with gateway.openai().responses.stream(model=model, input="the stream helper works") as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "the stream helper works"
    assert final.status == "completed"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_round_trip(gateway: RunningGateway, model: str, stream: bool) -> None:
    client = gateway.openai()
    conversation: list[Any] = [{"role": "user", "content": CALL_WEATHER}]
    if stream:
        with client.responses.stream(model=model, input=conversation, tools=[WEATHER]) as events:  # type: ignore[list-item]
            response = events.get_final_response()
    else:
        response = client.responses.create(model=model, input=conversation, tools=[WEATHER])  # type: ignore[list-item]
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lima"}
    assert call.id is not None and call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert response.output[-1] == call  # any text (Anthropic says what it will do) comes first
    # The usual loop: the response's output items go back in as they are, then the result.
    conversation += response.output
    conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": "foggy"})
    answer = client.responses.create(model=model, input=conversation, tools=[WEATHER])  # type: ignore[list-item]
    assert answer.output_text.startswith("Tool get_weather returned: ") and "foggy" in answer.output_text


def test_tool_calls_join_one_assistant_turn(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    gateway.openai().responses.create(
        model="gpt-4o-mini",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        input=[
            {"role": "user", "content": "weather in Lima and Quito?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": "Checking."},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Lima"}',
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city":"Quito"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "foggy"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "sunny"}],
            },
        ],
    )
    sent = fake_openai.last_request.json
    assert sent["tool_choice"]["function"] == {"name": "get_weather"}
    assert sent["parallel_tool_calls"] is False
    assert [tool["function"] for tool in sent["tools"]] == [
        {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER["parameters"]}
    ]
    assert sent["messages"][0] == {"role": "user", "content": "weather in Lima and Quito?"}
    _, assistant, first, second = sent["messages"]
    assert assistant["content"] == "Checking."
    assert [call["id"] for call in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert first == {"role": "tool", "tool_call_id": "call_1", "content": "foggy"}
    assert second["tool_call_id"] == "call_2" and second["content"] == [{"type": "text", "text": "sunny"}]


def test_text_after_a_call_joins_the_calls_turn(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    # A backend can write text after its call (Gemini's parts, a server's trailing text): the response
    # lists the message after the function_call, and sent back it is still the turn that made the call;
    # OpenAI refuses an assistant message between tool_calls and their tool messages.
    conversation: Any = [
        {"role": "user", "content": "weather in Lima?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Lima"}'},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call_output", "call_id": "call_1", "output": "foggy"},
    ]
    gateway.openai().responses.create(model="gpt-4o-mini", tools=[WEATHER], input=conversation)  # type: ignore[list-item]
    _, assistant, result = fake_openai.last_request.json["messages"]
    assert assistant["content"] == "Checking." and [c["id"] for c in assistant["tool_calls"]] == ["call_1"]
    assert result == {"role": "tool", "tool_call_id": "call_1", "content": "foggy"}


@pytest.mark.parametrize("model", MODELS)
def test_stream_tool_call_events(gateway: RunningGateway, model: str) -> None:
    events = list(
        gateway.openai().responses.create(
            model=model,
            input=CALL_WEATHER,
            tools=[WEATHER],  # type: ignore[list-item]
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [added] = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    [done] = [e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert added.item.status == "in_progress" and added.item.arguments == ""
    assert added.item.name == "get_weather" and done.item.id == added.item.id
    assert done.item.status == "completed" and done.output_index == added.output_index
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert {e.output_index for e in deltas} == {added.output_index}
    arguments = "".join(e.delta for e in deltas)
    assert json.loads(arguments) == {"city": "Lima"} and done.item.arguments == arguments
    # Text first (Anthropic says what it will do), then the call: the item order of the final response.
    completed = events[-1]
    assert completed.type == "response.completed"
    assert [item.type for item in completed.response.output][added.output_index :] == ["function_call"]
    assert completed.response.output[added.output_index].id == added.item.id


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_text_format(gateway: RunningGateway, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response = gateway.openai().responses.create(
        model=model,
        input="Lima",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )
    # The fakes fill the schema's strings with the user's text, or "example" (Anthropic's forced tool).
    assert json.loads(response.output_text)["city"] in ("Lima", "example")
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_max_output_tokens_makes_it_incomplete(gateway: RunningGateway, model: str, stream: bool) -> None:
    client = gateway.openai()
    words = "one two three four five"
    if stream:
        events = list(client.responses.create(model=model, input=words, max_output_tokens=2, stream=True))
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    else:
        response = client.responses.create(model=model, input=words, max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "one two" and response.output[0].status == "incomplete"
    assert response.max_output_tokens == 2


@pytest.mark.parametrize(
    ("stop_reason", "reason", "item_status"),
    [
        ("pause_turn", "pause_turn", "completed"),
        ("model_context_window_exceeded", "max_output_tokens", "incomplete"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_claudes_own_stop_reasons_make_it_incomplete(
    gateway: RunningGateway,
    fake_anthropic: FakeAnthropic,
    stop_reason: str,
    reason: str,
    item_status: str,
    stream: bool,
) -> None:
    """Claude's `pause_turn` (its server tools paused a long turn, resumed by sending the answer back)
    came out `completed`, as if the answer were whole: it is `incomplete` for the reason
    `pause_turn`, its items whole. `model_context_window_exceeded` cut the answer, as a length limit."""
    fake_anthropic.stop_next_with(stop_reason)
    client = gateway.openai()
    if stream:
        events = list(client.responses.create(model="claude-sonnet", input="Lima", stream=True))
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    else:
        response = client.responses.create(model="claude-sonnet", input="Lima")
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == reason
    assert response.output_text and response.output[-1].status == item_status


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        # Empty is no response Weir could answer from either: the same 400, not a silent fresh start.
        ({"previous_response_id": ""}, "previous_response_id"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"tools": [WEATHER, {"type": "web_search"}]}, "tools[1].type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, None),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ],
)
def test_invalid_requests_are_400_naming_the_parameter(
    gateway: RunningGateway, fake_openai: FakeOpenAI, extra: dict[str, Any], param: str | None
) -> None:
    body: dict[str, Any] = {"model": "gpt-4o-mini", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().responses.create(**body)
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert error["param"] == (param or "input[0].content[0].image_url")
    assert fake_openai.requests == []  # refused before any upstream call


def test_stateful_parameters_say_what_to_do(gateway: RunningGateway) -> None:
    with pytest.raises(openai.BadRequestError, match="send the whole conversation in `input`"):
        gateway.openai().responses.create(model="claude-sonnet", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="built-in tools run on OpenAI"):
        gateway.openai().responses.create(model="claude-sonnet", input="hi", tools=[{"type": "web_search"}])


def test_stored_response_operations_are_a_404_that_says_why(gateway: RunningGateway) -> None:
    client = gateway.openai()
    for operation in (
        lambda: client.responses.retrieve("resp_1"),
        lambda: client.responses.delete("resp_1"),
        lambda: client.responses.cancel("resp_1"),
        lambda: client.responses.input_items.list("resp_1"),
    ):
        with pytest.raises(openai.NotFoundError, match="Weir does not store responses") as caught:
            operation()
        body = caught.value.body
        assert isinstance(body, dict) and body["message"].startswith("No response found with id 'resp_1'")
        assert body["param"] == "response_id" and body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError, match="input_tokens is not supported"):
        client.responses.input_tokens.count(model="gpt-4o-mini", input="hi")
    with pytest.raises(openai.AuthenticationError):  # the key is checked first, as everywhere
        gateway.openai(api_key="sk-wrong").responses.retrieve("resp_1")


def test_unknown_model_is_404(gateway: RunningGateway) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        gateway.openai().responses.create(model="no-such-model", input="hi")
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]


@pytest.mark.parametrize(
    ("model", "fake_name", "status", "expected", "error"),
    [
        ("gpt-4o-mini", "fake_openai", 500, 502, openai.InternalServerError),
        ("gemini-flash", "fake_gemini", 500, 502, openai.InternalServerError),
        ("claude-sonnet", "fake_anthropic", 529, 503, openai.InternalServerError),
        ("claude-sonnet", "fake_anthropic", 429, 429, openai.RateLimitError),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_upstream_failure_is_an_openai_error(
    gateway: RunningGateway,
    request: pytest.FixtureRequest,
    model: str,
    fake_name: str,
    status: int,
    expected: int,
    error: type[openai.APIStatusError],
    stream: bool,
) -> None:
    request.getfixturevalue(fake_name).fail_next(status, times=3)  # whatever retries the route makes
    # A stream that fails before its first event is an HTTP error too: nothing was sent yet.
    with pytest.raises(error) as caught:
        gateway.openai().responses.create(model=model, input="hi", stream=stream)
    assert caught.value.status_code == expected
    assert isinstance(caught.value.body, dict) and set(caught.value.body) == {
        "message",
        "type",
        "param",
        "code",
    }


@pytest.mark.parametrize(
    ("model", "extra", "param"),
    [
        # OpenAI's chat API names the limit it got, `max_completion_tokens`.
        ("gpt-4o-mini", {"max_output_tokens": 10**6}, "max_output_tokens"),
        # Weir's own check of the chat messages it made (`messages[0].tool_call_id`).
        (
            "gemini-flash",
            {"input": [{"type": "function_call_output", "call_id": "zz", "output": "x"}]},
            "input",
        ),
    ],
    ids=["upstream", "weir"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_400_from_the_chat_pipeline_names_the_responses_parameter(
    gateway: RunningGateway, model: str, extra: dict[str, Any], param: str, stream: bool
) -> None:
    """A Responses request runs as a chat request, whose 400s named its parameters
    (`max_completion_tokens`, `messages[0]...`): ones a Responses client never sent."""
    body: dict[str, Any] = {"model": model, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().responses.create(**body, stream=stream)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("chat", "ours"),
    [
        ("max_tokens", "max_output_tokens"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("response_format", "text.format"),
        ("reasoning_effort", "reasoning.effort"),
        ("messages[3].content[0].image_url.url", "input"),
        ("tools[0]", "tools[0]"),  # the same in both
        ("max_tokens_to_sample", "max_tokens_to_sample"),  # a prefix of a name is not the name
        (None, None),
    ],
)
def test_chat_parameters_in_responses_words(chat: str | None, ours: str | None) -> None:
    assert responses_param(chat) == ours


@pytest.mark.parametrize(
    "fault", [Fault.cut_stream(after=2), Fault.stream_error(after=2)], ids=["cut", "error-event"]
)
def test_stream_broken_midway_ends_with_error_and_failed(
    gateway: RunningGateway, fake_gemini: FakeGemini, fault: Fault
) -> None:
    fake_gemini.fail_next(fault)
    events = list(
        gateway.openai().responses.create(
            model="gemini-flash", input="one two three four five six", stream=True
        )
    )
    kinds = [event.type for event in events]
    assert "response.output_text.delta" in kinds  # some text arrived before the failure
    assert kinds[-2:] == ["error", "response.failed"]
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == "server_error"
    # What was streamed is billed, and said: the prompt and the text before the break.
    usage = failed.response.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0
    assert [event.sequence_number for event in events] == list(range(len(events)))
    # The stream helper has no final response to give, rather than a truncated one.
    fake_gemini.fail_next(fault)
    with (
        pytest.raises(RuntimeError, match=r"response\.completed"),
        gateway.openai().responses.stream(model="gemini-flash", input="one two three four") as stream,
    ):
        stream.get_final_response()


def test_headers_match_chat(gateway: RunningGateway) -> None:
    raw = gateway.openai().responses.with_raw_response.create(model="claude-sonnet", input="hi")
    assert raw.headers["x-request-id"]
    assert "candidate=claude-sonnet" in raw.headers["x-weir-route"]


def test_cache_reads_and_writes_are_inside_input_tokens(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.set_next_usage(
        input_tokens=10,
        cached_input_tokens=20,
        cache_write_5m_tokens=30,
        cache_write_1h_tokens=5,
        output_tokens=3,
    )
    response = gateway.openai().responses.create(model="claude-sonnet", input="hi")
    usage = response.usage
    assert usage is not None and usage.input_tokens == 65 == gateway.sink.events[0].usage.prompt_tokens
    assert usage.input_tokens_details.cached_tokens == 20
    assert usage.input_tokens_details.cache_write_tokens == 35
    assert usage.total_tokens == 68


# --- the event writer, on chunks no fake produces ---------------------------------------------------


def _chunk(delta: Delta, finish: str | None = None, usage: Usage | None = None) -> ChatChunk:
    choices = [ChunkChoice(index=0, delta=delta, finish_reason=finish)]
    return ChatChunk(id="c", created=0, model="m", choices=choices, usage=usage)


def _call(index: int, arguments: str, name: str | None = None) -> Delta:
    function = FunctionCallDelta(name=name, arguments=arguments)
    call_id = f"call_{index}" if name else None
    return Delta(tool_calls=[ToolCallDelta(index=index, id=call_id, function=function)])


async def _events(chunks: list[ChatChunk]) -> list[Any]:
    async def batches() -> AsyncIterator[list[ChatChunk]]:
        for chunk in chunks:
            yield [chunk]

    request = ResponsesRequest(model="m", input="hi")
    written = b"".join([piece async for piece in stream_events(batches(), request)])
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    frames = written.strip().split(b"\n\n")
    return [adapter.validate_json(frame.split(b"\ndata: ", 1)[1]) for frame in frames]


async def test_interleaved_parallel_calls_keep_their_output_index() -> None:
    events = await _events(
        [
            _chunk(Delta(role="assistant", content="Checking")),
            _chunk(_call(0, '{"city":', name="get_weather")),
            _chunk(_call(1, '{"city": "Quito"}', name="get_weather")),
            _chunk(_call(0, ' "Lima"}')),  # a backend interleaving parallel calls
            _chunk(Delta(refusal="Not that one.")),
            _chunk(Delta(), "tool_calls", Usage(input_tokens=4, output_tokens=9)),
        ]
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    assert added == ["message", "function_call", "function_call", "message"]
    late = [event for event in events if event.type == "response.function_call_arguments.delta"][-1]
    assert late.delta == ' "Lima"}' and late.output_index == 1
    final = events[-1]
    assert final.type == "response.completed"
    output = final.response.output
    assert output[0].content[0].text == "Checking" and output[3].content[0].refusal == "Not that one."
    assert [json.loads(item.arguments)["city"] for item in output[1:3]] == ["Lima", "Quito"]
    assert [item.call_id for item in output[1:3]] == ["call_0", "call_1"]
    assert final.response.usage.input_tokens == 4 and final.response.usage.output_tokens == 9


async def test_an_empty_answer_is_still_a_message() -> None:
    events = await _events([_chunk(Delta(role="assistant"), "stop", Usage(input_tokens=1))])
    assert [event.type for event in events][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-1].response.output_text == ""


async def test_a_400_after_the_stream_started_names_the_responses_parameter() -> None:
    """A stream cut midway goes on on another candidate, whose 400 named the chat request's
    `max_completion_tokens` in the `error` event."""

    async def batches() -> AsyncIterator[list[ChatChunk]]:
        yield [_chunk(Delta(role="assistant", content="Hel"))]
        raise InvalidRequest("max_completion_tokens is too large", param="max_completion_tokens")

    written = b"".join([p async for p in stream_events(batches(), ResponsesRequest(model="m", input="hi"))])
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_json(f.split(b"\ndata: ", 1)[1]) for f in written.strip().split(b"\n\n")]
    error = events[-2]
    assert error.type == "error" and error.param == "max_output_tokens"
    assert events[-1].type == "response.failed"


def test_reasoning_comes_as_a_reasoning_item_first(gateway: RunningGateway) -> None:
    client = gateway.openai()
    plain = client.responses.create(model="deepseek-reasoner", input="a b")
    assert [item.type for item in plain.output] == ["reasoning", "message"]
    reasoning = plain.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content or []] == [("reasoning_text", "The user wants: a b")]
    assert plain.output_text == "a b"
    assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens > 0
    # Streamed: the reasoning item's events first, each valid against the SDK's models.
    headers = {"authorization": f"Bearer {DEMO_KEY}"}
    body = {"model": "deepseek-reasoner", "input": "a b", "stream": True}
    raw = httpx.post(f"{gateway.url}/v1/responses", json=body, headers=headers, timeout=10)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    events = [
        adapter.validate_python(json.loads(frame.split("\n")[1].removeprefix("data: ")))
        for frame in raw.text.split("\n\n")
        if frame
    ]
    kinds = [e.type for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "The user wants: a b"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "message"]
    assert final.response.output_text == "a b"
    with client.responses.stream(model="deepseek-reasoner", input="a b") as stream:
        helper = stream.get_final_response()  # the SDK's own accumulation of the same events
    assert [item.type for item in helper.output] == ["reasoning", "message"] and helper.output_text == "a b"


@pytest.mark.parametrize("model", ["claude-sonnet", "claude-opus-47"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_claude_keeps_thinking_through_a_tool_loop(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, model: str, stream: bool
) -> None:
    # Anthropic refuses thinking in a tool loop unless the turn that called the tool comes back with
    # its signed thinking; the signature travels in the reasoning item's encrypted_content, which
    # clients send back as is with the rest of the output.
    client = gateway.openai()
    settings: Any = {"model": model, "tools": [WEATHER], "reasoning": {"effort": "high"}}
    conversation: list[Any] = [{"role": "user", "content": "call get_weather"}]
    if stream:
        with client.responses.stream(input=conversation, **settings) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(input=conversation, **settings)
    thought, *_, call = response.output
    assert thought.type == "reasoning" and thought.encrypted_content and call.type == "function_call"
    conversation += response.output
    conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": "foggy"})
    answer = client.responses.create(input=conversation, **settings)
    sent = fake_anthropic.last_request.json
    assert sent.get("thinking") is not None  # still thinking, not switched off for the loop
    turn = sent["messages"][1]["content"]
    assert [block["type"] for block in turn] == ["thinking", "text", "tool_use"]
    assert thought.content is not None and turn[0]["thinking"] == thought.content[0].text
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    assert answer.output_text == "Tool get_weather returned: foggy"


async def test_redacted_thinking_streams_as_an_item_of_its_own() -> None:
    events = await _events(
        [
            _chunk(Delta(role="assistant", reasoning_content="Hmm")),
            _chunk(Delta(reasoning_signature="sig")),
            _chunk(Delta(redacted_reasoning="opaque")),
            _chunk(Delta(content="Hi"), "stop"),
        ]
    )
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [(item.type, item.encrypted_content) for item in done[:2]] == [
        ("reasoning", "weir.thinking.signature:sig"),
        ("reasoning", "weir.redacted_thinking:opaque"),
    ]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "reasoning", "message"]
    # Sent back, they are Anthropic's blocks again, in order, on the turn they belong to.
    request = ResponsesRequest(
        model="m", input=[{"role": "user", "content": "hi"}, *final.model_dump()["output"]]
    )
    [_, assistant] = to_canonical(request).messages
    assert assistant.reasoning_blocks == [
        ReasoningBlock(text="Hmm", signature="sig"),
        RedactedReasoning(data="opaque"),
    ]
    assert assistant.reasoning_content == "Hmm" and assistant.content == "Hi"


@pytest.mark.parametrize("model", PARALLEL_CALLS)
def test_parallel_calls_all_numbered_zero_stay_apart(compat_gateway: RunningGateway, model: str) -> None:
    # Ollama (and SGLang, Dynamo) stream every parallel call at index 0, each with its own id: a new
    # id at an index already taken is a new call, not more arguments for the last one. A call without
    # arguments (SGLang's "") has "{}" when it is done.
    tools: Any = [WEATHER, {**WEATHER, "name": "get_time"}]
    client = compat_gateway.openai()
    with client.responses.stream(model=model, input="both", tools=tools) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [
        (item.call_id, item.name, item.arguments) for item in final.output if item.type == "function_call"
    ]
    assert calls == PARALLEL_CALLS[model]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.output_index, e.arguments) for e in done] == [
        (i, arguments) for i, (_, _, arguments) in enumerate(PARALLEL_CALLS[model])
    ]


async def test_a_call_whose_id_changes_midway_stays_one_call() -> None:
    # Some servers send a new id on every delta of one call, naming the call only on the first.
    first = ToolCallDelta(
        index=0, id="call_a", function=FunctionCallDelta(name="get_weather", arguments='{"city":')
    )
    rest = ToolCallDelta(index=0, id="call_b", function=FunctionCallDelta(arguments=' "Lima"}'))
    events = await _events(
        [_chunk(Delta(tool_calls=[first])), _chunk(Delta(tool_calls=[rest]), "tool_calls")]
    )
    [call] = events[-1].response.output
    assert (call.call_id, call.name, call.arguments) == ("call_a", "get_weather", '{"city": "Lima"}')


@pytest.mark.parametrize("model", MODELS)
def test_a_call_without_arguments_streams_an_empty_object(gateway: RunningGateway, model: str) -> None:
    # Claude streams a parameterless call's input as one empty fragment: the call still has "{}", as
    # unstreamed and from every other vendor, which clients json.loads.
    clock: Any = {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}}
    with gateway.openai().responses.stream(model=model, input="call now", tools=[clock]) as stream:
        done = [e.arguments for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert done == [call.arguments] and json.loads(call.arguments) == {}


CITING = "read https://example.com/a and https://example.org/b"


def test_a_search_models_citations_are_url_citation_annotations(gateway: RunningGateway) -> None:
    """A search model's chat answer cites its sources in `message.annotations`; a Responses client
    gets them as `output_text.annotations` of type `url_citation`, indexed into that text."""
    response = gateway.openai().responses.create(model="gpt-4o-search-preview", input=CITING)
    [message] = response.output
    assert message.type == "message"
    [part] = message.content
    assert part.type == "output_text" and part.text == CITING
    cited = [(part.text[a.start_index : a.end_index], a.url, a.title) for a in part.annotations]  # type: ignore[union-attr]
    assert cited == [
        ("https://example.com/a", "https://example.com/a", "Page on example.com"),
        ("https://example.org/b", "https://example.org/b", "Page on example.org"),
    ]
    assert {a.type for a in part.annotations} == {"url_citation"}


def test_streamed_citations_are_announced_and_kept_on_the_text(gateway: RunningGateway) -> None:
    """Streamed, the citations come after the text in a delta of their own: each is an
    `output_text.annotation.added` event, and the final response's text part holds them all."""
    with gateway.openai().responses.stream(model="gpt-4o-search-preview", input=CITING) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e for e in events if e.type == "response.output_text.annotation.added"]
    assert [(e.annotation_index, e.annotation.url) for e in added] == [  # type: ignore[union-attr]
        (0, "https://example.com/a"),
        (1, "https://example.org/b"),
    ]
    kinds = [e.type for e in events]
    assert kinds.index("response.output_text.annotation.added") < kinds.index("response.output_text.done")
    [part] = final.output[0].content  # type: ignore[union-attr]
    assert part.type == "output_text" and part.text == CITING
    assert [(part.text[a.start_index : a.end_index], a.url) for a in part.annotations] == [  # type: ignore[union-attr]
        ("https://example.com/a", "https://example.com/a"),
        ("https://example.org/b", "https://example.org/b"),
    ]
    done = next(e for e in events if e.type == "response.content_part.done")
    assert len(done.part.annotations) == 2  # type: ignore[union-attr]


def test_a_file_url_is_a_400_that_says_so(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    """A file by URL is no stored file: the 400 names `file_url` and says what to send instead."""
    file = {"type": "input_file", "file_url": "https://example.com/report.pdf"}
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().responses.create(
            model="gpt-4o-mini",
            input=[{"role": "user", "content": [file, {"type": "input_text", "text": "summarise"}]}],  # type: ignore[list-item]
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "input[0].content[0].file_url"
    assert "stores no files" not in error["message"] and "file_data" in error["message"]
    assert fake_openai.requests == []


LOGPROBS: Any = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_come_on_the_output_text(
    gateway: RunningGateway, fake_openai: FakeOpenAI, stream: bool
) -> None:
    asked: Any = {"model": "gpt-4o-mini", "input": "one two three", **LOGPROBS}
    client = gateway.openai()
    if stream:
        events = list(client.responses.create(**asked, stream=True))
        deltas = [event for event in events if event.type == "response.output_text.delta"]
        assert [token.token for event in deltas for token in event.logprobs] == ["one", " two", " three"]
        [done] = [event for event in events if event.type == "response.output_text.done"]
        assert len(done.logprobs) == 3
        final = events[-1]
        assert final.type == "response.completed"
        response = final.response
    else:
        response = client.responses.create(**asked)
    sent = fake_openai.requests[-1].json
    assert sent["logprobs"] is True and sent["top_logprobs"] == 2
    part = response.output[0].content[0]
    assert part.type == "output_text"
    [first, *_] = part.logprobs
    assert first.token == "one" and first.logprob == -0.01 and first.bytes == list(b"one")
    assert [top.token for top in first.top_logprobs] == ["one", "one1"]


def test_logprobs_a_backend_cannot_give_are_a_400_naming_include(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    with pytest.raises(openai.BadRequestError, match="token log probabilities") as caught:
        gateway.openai().responses.create(model="claude-sonnet", input="hi", **LOGPROBS)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "include"
    assert error["code"] == "unsupported_parameter"
    assert fake_anthropic.requests == []


def test_max_tool_calls_is_echoed_and_holds_on_a_chat_backend(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """It counts calls of built-in tools, which a chat backend never runs: nothing to send it."""
    response = gateway.openai().responses.create(model="gpt-4o-mini", input="hi", max_tool_calls=2)
    assert response.max_tool_calls == 2 and response.status == "completed"
    assert "max_tool_calls" not in fake_openai.requests[-1].json


async def test_a_400_after_the_stream_started_fails_with_its_code_and_the_usage_streamed() -> None:
    async def batches() -> AsyncIterator[list[ChatChunk]]:
        yield [_chunk(Delta(role="assistant", content="Hello there, this is "))]
        yield [_chunk(Delta(content="more text"))]
        raise InvalidRequest("the prompt is too long", param="messages", code="context_length_exceeded")

    request = ResponsesRequest(model="m", input="hi")
    sent = to_canonical(request)
    written = b"".join([p async for p in stream_events(batches(), request, sent)])
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_json(f.split(b"\ndata: ", 1)[1]) for f in written.strip().split(b"\n\n")]
    error, failed = events[-2], events[-1].response
    assert error.type == "error" and error.code == "context_length_exceeded"
    # The request's fault, in OpenAI's words for it (the SDK's list of failure codes).
    assert failed.status == "failed" and failed.error.code == "invalid_prompt"
    assert failed.usage is not None and failed.usage.input_tokens == input_tokens(sent) > 0
    assert failed.usage.output_tokens == 8  # 30 bytes of text streamed, at 4 bytes a token
    assert failed.usage.total_tokens == failed.usage.input_tokens + 8


async def test_logprobs_of_text_held_back_come_with_the_text() -> None:
    """A backend holds back the bytes of a character not yet whole, but sends their token's logprobs."""

    def token(text: str, raw: bytes) -> dict[str, Any]:
        return {"token": text, "logprob": -0.5, "bytes": list(raw), "top_logprobs": []}

    def chunk(content: str, *tokens: dict[str, Any]) -> ChatChunk:
        choice = ChunkChoice(index=0, delta=Delta(content=content), logprobs={"content": list(tokens)})
        return ChatChunk(id="c", created=0, model="m", choices=[choice])

    events = await _events(
        [
            chunk("", token("bytes:\\xe2\\x82", b"\xe2\x82")),
            chunk("€", token("bytes:\\xac", b"\xac")),
            chunk("", token("bytes:\\xe2", b"\xe2")),  # cut before its character was whole
            _chunk(Delta(), "length", Usage(input_tokens=1, output_tokens=3)),
        ]
    )
    [delta] = [event for event in events if event.type == "response.output_text.delta"]
    assert delta.delta == "€" and [t.bytes for t in delta.logprobs] == [[0xE2, 0x82], [0xAC]]
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert len(done.logprobs) == 3
    assert len(events[-1].response.output[0].content[0].logprobs) == 3
