"""Models OpenAI serves on the Responses API alone (`api: responses`), as each client sees them: chat
completions streamed and not, a tool call round trip, the usage in the ledger, an Anthropic Messages
client, a failure midway that fails over. The fake OpenAI refuses chat completions for these models
as OpenAI does, and takes POST /v1/responses in OpenAI's own wire format."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import openai
import pytest
from structlog.testing import capture_logs

from gateway.config import Backend, ConfigError, parse_config
from gateway.errors import BadGateway, UpstreamError
from gateway.providers import openai_responses
from gateway.types import (
    ChatRequest,
    FunctionCall,
    ImagePart,
    ImageURL,
    Message,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolCall,
    ToolChoiceFunction,
)
from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway, full_config_text, module_gateway

FAST = "retry: {attempts: 2, backoff: 0.02, max_backoff: 0.1}, probe_interval: null"
MODELS = """\
  - {name: o3-pro, backend: openai, api: responses, price: &o3pro {input: 20.0, cached_input: 5.0, output: 80.0}}
  - {name: o3-pro-on-chat, backend: openai, model: o3-pro, price: *o3pro}  # one price per upstream model
  - {name: codex, backend: openai-responses, model: codex-mini-latest}
"""
BACKENDS = """\
  - name: openai-responses
    type: openai
    base_url: ${OPENAI_BASE_URL}
    api_key: ${OPENAI_API_KEY}
    api: responses
"""
ROUTES = f"""\
routes:
  - {{name: pro-then-mini, candidates: [{{model: o3-pro}}, {{model: gpt-4o-mini}}], {FAST}}}
"""
HI: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one two three"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _config_text() -> str:
    text = full_config_text().replace("models:", "models:\n" + MODELS.rstrip("\n"), 1)
    return text.replace("backends:\n", "backends:\n" + BACKENDS, 1) + ROUTES


_module_gateway, gateway = module_gateway(_config_text())


def _sent(fake: FakeOpenAI) -> dict[str, Any]:
    request = fake.posts[-1]
    assert request.path == "/v1/responses"
    body: dict[str, Any] = request.json
    return body


def test_a_chat_completion_reaches_the_responses_api(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    reply = gateway.openai().chat.completions.create(model="o3-pro", messages=HI, max_completion_tokens=500)
    assert reply.choices[0].message.content == "one two three"
    assert reply.choices[0].finish_reason == "stop"
    sent = _sent(fake_openai)
    assert sent["instructions"] == "Be brief." and sent["store"] is False
    assert sent["input"] == [{"role": "user", "content": "one two three"}]
    assert sent["max_output_tokens"] == 500 and "stream" not in sent


def test_a_backend_can_serve_every_model_on_the_responses_api(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    reply = gateway.openai().chat.completions.create(model="codex", messages=HI)
    assert reply.choices[0].message.content == "one two three"
    assert _sent(fake_openai)["model"] == "codex-mini-latest"


def test_without_api_responses_weir_switches_on_openais_404(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    client = gateway.openai()
    with capture_logs() as logs:
        first = client.chat.completions.create(model="o3-pro-on-chat", messages=HI)
    assert first.choices[0].message.content == "one two three"
    [hint] = [line for line in logs if line["event"] == "model_served_on_responses_api_only"]
    assert "api: responses" in hint["hint"]
    # Asked there at once, and from then on: no 404 again.
    streamed = list(client.chat.completions.create(model="o3-pro-on-chat", messages=HI, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "one two three"
    assert [r.path for r in fake_openai.posts] == ["/v1/chat/completions", "/v1/responses", "/v1/responses"]
    assert [e.status for e in gateway.sink.events] == [404, 200, 200]


def test_a_streamed_chat_completion(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    stream = gateway.openai().chat.completions.create(
        model="o3-pro", messages=HI, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    assert _sent(fake_openai)["stream"] is True
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 3 + 192  # the text and medium reasoning
    [event] = gateway.sink.events
    assert event.usage.output_tokens == 3 + 192 and event.usage.reasoning_tokens == 192


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_by_its_output_limit_finishes_with_length(
    gateway: RunningGateway, stream: bool
) -> None:
    messages: Any = [{"role": "user", "content": "one two three four five six"}]
    client = gateway.openai()
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="o3-pro", messages=messages, max_completion_tokens=2, stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        [finish] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        reply = client.chat.completions.create(model="o3-pro", messages=messages, max_completion_tokens=2)
        text, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
    assert (text, finish) == ("one two", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(gateway: RunningGateway, fake_openai: FakeOpenAI, stream: bool) -> None:
    client = gateway.openai()
    messages: list[Any] = [{"role": "user", "content": 'call get_weather {"city": "Lima"}'}]
    if stream:
        chunks = list(
            client.chat.completions.create(model="o3-pro", messages=messages, tools=[WEATHER], stream=True)
        )
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        call_id = next(d.id for d in deltas if d.id)
        name = next(d.function.name for d in deltas if d.function and d.function.name)
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        reply = client.chat.completions.create(model="o3-pro", messages=messages, tools=[WEATHER])
        [call] = reply.choices[0].message.tool_calls or []
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
        finish = [reply.choices[0].finish_reason]
    assert (name, json.loads(arguments), finish) == ("get_weather", {"city": "Lima"}, ["tool_calls"])
    # The tool goes up in the Responses API's flat shape.
    assert _sent(fake_openai)["tools"] == [{"type": "function", **WEATHER["function"]}]

    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 24C"},
    ]
    answer = client.chat.completions.create(model="o3-pro", messages=messages, tools=[WEATHER])
    assert answer.choices[0].message.content == "Tool get_weather returned: sunny, 24C"
    assert _sent(fake_openai)["input"][1:] == [
        {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": call_id, "output": "sunny, 24C"},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_cached_and_reasoning_tokens_reach_the_ledger(gateway: RunningGateway, stream: bool) -> None:
    client = gateway.openai()
    messages = [{"role": "user", "content": "word " * 1500}]
    for _ in range(2):
        if stream:
            list(
                client.chat.completions.create(
                    model="o3-pro", messages=messages, max_completion_tokens=5, stream=True
                )
            )
        else:
            client.chat.completions.create(model="o3-pro", messages=messages, max_completion_tokens=5)
    first, again = gateway.sink.events
    assert first.usage.cached_input_tokens == 0
    assert again.usage.cached_input_tokens >= 1024
    assert again.usage.prompt_tokens == first.usage.prompt_tokens >= 1500
    assert again.usage.reasoning_tokens == 192 and again.usage.output_tokens == 5 + 192
    # Cache reads at their own price (5 USD per 1M, not the input's 20): in pico-USD per token, 1e6 a USD.
    uncached = again.usage.prompt_tokens - again.usage.cached_input_tokens
    expected = uncached * 20 + again.usage.cached_input_tokens * 5 + again.usage.output_tokens * 80
    assert again.cost_pico_usd == expected * 10**6


def test_an_anthropic_client_talks_to_a_responses_only_model(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    message = gateway.anthropic().messages.create(
        model="o3-pro",
        max_tokens=300,
        system="Be brief.",
        messages=[{"role": "user", "content": "hello over there"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert message.content[-1].type == "text" and message.content[-1].text == "hello over there"
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 3 + 64
    sent = _sent(fake_openai)
    assert sent["instructions"] == "Be brief." and sent["reasoning"] == {"effort": "low"}
    with gateway.anthropic().messages.stream(
        model="o3-pro", max_tokens=300, messages=[{"role": "user", "content": "hello over there"}]
    ) as stream:
        assert "".join(stream.text_stream) == "hello over there"


def test_an_error_event_midway_fails_over(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    # created, in_progress, the message, its part, then OpenAI's `error` event: on both attempts at o3-pro
    fake_openai.fail_next(Fault.stream_error(after=4), times=2)
    chunks = list(gateway.openai().chat.completions.create(model="pro-then-mini", messages=HI, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three"
    assert [r.path for r in fake_openai.posts] == ["/v1/responses", "/v1/responses", "/v1/chat/completions"]
    assert [e.status for e in gateway.sink.events] == [502, 502, 200]


@pytest.mark.parametrize(
    "params", [{"stop": ["three"]}, {"n": 2}, {"logprobs": True}, {"frequency_penalty": 0.5}], ids=str
)
def test_a_request_the_responses_api_cannot_take_is_refused(
    gateway: RunningGateway, fake_openai: FakeOpenAI, params: dict[str, Any]
) -> None:
    """As every adapter's refusal (`refuse_unexpressible`): a 400 `unsupported_parameter` naming it."""
    name = next(iter(params))
    with pytest.raises(openai.BadRequestError, match=f"'{name}' is not supported") as caught:
        gateway.openai().chat.completions.create(model="o3-pro", messages=HI, **params)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == name and body["code"] == "unsupported_parameter"
    assert not fake_openai.posts


@pytest.mark.parametrize(
    "params",
    [
        {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
        {"web_search_options": {}},
    ],
    ids=["modalities", "web_search_options"],
)
def test_audio_output_and_web_search_are_refused_not_dropped(
    gateway: RunningGateway, fake_openai: FakeOpenAI, params: dict[str, Any]
) -> None:
    # The Responses API answers in text alone, and searches with a tool Weir does not send.
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model="o3-pro", messages=HI, **params)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == next(iter(params))
    assert body["code"] == "unsupported_parameter"
    assert not fake_openai.posts


def test_chat_parameters_the_responses_api_shares_reach_it(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    gateway.openai().chat.completions.create(
        model="o3-pro",
        messages=HI,
        verbosity="low",
        prompt_cache_key="thread-1",
        prompt_cache_retention="24h",
        safety_identifier="user-hash-1",
        response_format={"type": "json_object"},
    )
    sent = _sent(fake_openai)
    assert sent["text"] == {"format": {"type": "json_object"}, "verbosity": "low"}
    assert sent["prompt_cache_key"] == "thread-1" and sent["prompt_cache_retention"] == "24h"
    assert sent["safety_identifier"] == "user-hash-1"


def test_only_openai_backends_take_api_responses() -> None:
    text = _config_text().replace("type: anthropic\n", "type: anthropic\n    api: responses\n", 1)
    with pytest.raises(ConfigError, match=r"backends\[\d\]\.api"):
        parse_config(
            text,
            {
                "OPENAI_BASE_URL": "x",
                "OPENAI_API_KEY": "k",
                "ANTHROPIC_API_KEY": "k",
                "GEMINI_API_KEY": "k",
                "DEEPSEEK_BASE_URL": "x",
                "DEEPSEEK_API_KEY": "k",
                "DEAD_PORT": "1",
                "WEIR_DEMO_KEY": "d",
                "WEIR_LIMITED_KEY": "l",
            },
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_client_talks_to_a_responses_only_model(
    gateway: RunningGateway, fake_openai: FakeOpenAI, stream: bool
) -> None:
    client = gateway.openai()
    asked: Any = {"model": "o3-pro", "input": "hello over there", "reasoning": {"effort": "high"}}
    if stream:
        with client.responses.stream(**asked) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**asked)
    assert response.output_text == "hello over there" and response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 512
    sent = _sent(fake_openai)
    assert sent["reasoning"] == {"effort": "high"} and sent["input"] == [
        {"role": "user", "content": "hello over there"}
    ]


# --- the translation itself, where no fake tells the difference ----------------------------------

OPENAI = Backend(name="openai", type="openai", base_url="https://api.openai.com/v1", api_key="k")


def _body(request: ChatRequest) -> dict[str, Any]:
    upstream = openai_responses.chat_request(OPENAI, request, "o3-pro")
    assert upstream.url == "https://api.openai.com/v1/responses"
    body: dict[str, Any] = json.loads(upstream.body)
    return body


def test_images_developer_turns_and_a_tool_results_image_become_input_items() -> None:
    png = "data:image/png;base64,iVBORw0KGgo="
    call = ToolCall(id="call_1", function=FunctionCall(name="shot", arguments=""))
    request = ChatRequest(
        model="o3-pro",
        messages=[
            Message(role="system", content="Be brief."),
            Message(role="user", content=[TextPart(text="look"), ImagePart(image_url=ImageURL(url=png))]),
            Message(role="assistant", content="Taking one.", tool_calls=[call]),
            Message(
                role="tool",
                tool_call_id="call_1",
                content=[TextPart(text="done"), ImagePart(image_url=ImageURL(url=png))],
            ),
            Message(role="developer", content="Answer in French."),
        ],
        reasoning_budget=20000,
        response_format=ResponseFormat(type="json_object"),
        tool_choice=NamedToolChoice(function=ToolChoiceFunction(name="shot")),
    )
    body = _body(request)
    image = {"type": "input_image", "image_url": png, "detail": "auto"}
    assert body["instructions"] == "Be brief."
    assert body["input"] == [
        {"role": "user", "content": [{"type": "input_text", "text": "look"}, image]},
        {"role": "assistant", "content": "Taking one."},
        {"type": "function_call", "call_id": "call_1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
        {"role": "user", "content": [image]},  # a tool result takes text only
        {"role": "developer", "content": "Answer in French."},
    ]
    assert body["reasoning"] == {"effort": "high"} and body["text"] == {"format": {"type": "json_object"}}
    assert body["tool_choice"] == {"type": "function", "name": "shot"} and body["store"] is False


def test_a_custom_tools_image_output_goes_back_once_as_the_client_sent_it() -> None:
    """A Responses client's custom tool result goes back to the Responses API as the client sent it,
    its image inside: moved to a user message after the results too, as a chat tool result's image
    is, the model was sent the image twice, and billed for it twice."""
    from gateway.responses_inbound import ResponsesRequest, to_canonical

    png = "data:image/png;base64,iVBORw0KGgo="
    output = [{"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": png}]
    items = [
        {"role": "user", "content": "shoot"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "shot", "input": "screen"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": output},
    ]
    request = to_canonical(msgspec.convert({"model": "o3-pro", "input": items}, ResponsesRequest))
    assert _body(request)["input"] == items


def test_a_failed_response_is_the_error_it_stands_for() -> None:
    failed = {
        "status": "failed",
        "output": [],
        "error": {"code": "rate_limit_exceeded", "message": "slow down"},
    }
    with pytest.raises(UpstreamError) as caught:
        openai_responses.chat_response(json.dumps(failed).encode(), "o3-pro")
    assert caught.value.status == 429
    stream = openai_responses.ChatStream(ChatRequest(model="o3-pro", messages=[]), "o3-pro")
    with pytest.raises(BadGateway):
        stream.feed("error", json.dumps({"type": "error", "code": "server_error", "message": "boom"}))


def test_a_stream_that_ends_before_its_response_is_complete_is_no_answer() -> None:
    stream = openai_responses.ChatStream(ChatRequest(model="o3-pro", messages=[]), "o3-pro")
    created = {"type": "response.created", "response": {"id": "resp_1", "created_at": 1, "model": "o3-pro"}}
    stream.feed("response.created", json.dumps(created))
    stream.feed(
        "response.output_text.delta", json.dumps({"type": "response.output_text.delta", "delta": "Hi"})
    )
    with pytest.raises(BadGateway, match="before the response was complete"):
        stream.close()


def test_the_empty_answer_reads_as_an_empty_answer() -> None:
    response = openai_responses.chat_response(openai_responses.empty_answer("o3-pro"), "o3-pro")
    assert response.choices[0].message.content == "" and response.choices[0].finish_reason == "stop"


def test_a_passed_through_stream_cut_mid_way_goes_on_in_the_same_message(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A Responses client on OpenAI's Responses API gets its events as they came; cut after some of
    the answer's text, the chat candidate's continuation goes on in that message (one message, its
    text whole, in the final response too), not in a second one beside an empty incomplete one."""
    words = "one two three four five six seven eight"
    # created, in_progress, the reasoning item's two events, the message's added and its part's: then
    # three words, and the break.
    fake_openai.fail_next(Fault.stream_error(after=9, code=500))
    with gateway.openai().responses.stream(model="pro-then-mini", input=words) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [post.path for post in fake_openai.posts] == ["/v1/responses", "/v1/chat/completions"]
    messages = [item for item in final.output if item.type == "message"]
    assert len(messages) == 1 and messages[0].status == "completed"
    assert final.output_text == words and final.status == "completed"
    added = [e.item.id for e in events if e.type == "response.output_item.added" and e.item.type == "message"]
    texts = {e.item_id for e in events if e.type == "response.output_text.delta"}
    assert texts == set(added) and len(added) == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_responses_clients_logprobs_and_max_tool_calls_reach_the_responses_api(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """Its output items come back as they came, logprobs and all: nothing to read back into chat's."""
    response = gateway.openai().responses.create(
        model="o3-pro",
        input="hello over there",
        include=["message.output_text.logprobs"],
        top_logprobs=3,
        max_tool_calls=4,
    )
    assert response.status == "completed" and response.output_text == "hello over there"
    sent = _sent(fake_openai)
    assert sent["include"] == ["message.output_text.logprobs"]
    assert sent["top_logprobs"] == 3 and sent["max_tool_calls"] == 4
    assert "logprobs" not in sent  # chat's own field, which the Responses API refuses
