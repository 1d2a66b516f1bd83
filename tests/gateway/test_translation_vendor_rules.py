"""Vendor rules a translated request must keep, for OpenAI and Gemini: what one vendor's client sends
within its own API's limits, translated for another vendor, is sent only in a form that vendor takes.

- OpenAI takes at most 4 stop sequences, Gemini 5 (Anthropic any number): more is a 400 of Weir's own,
  nothing sent (a route passes that candidate over). Other OpenAI-compatible servers get them all.
- Gemini is never sent a content without parts, nor an empty text part: an empty turn is left out.
- Gemini before 3 is never sent a JSON response type beside function declarations: the schema is asked
  for in words (as for Claude beside the client's tools); Gemini 3 takes both.
- An Anthropic client's thinking budget becomes `reasoning_effort` only for OpenAI's reasoning models
  (and for servers that are not OpenAI's), never for gpt-4o-mini and the like, which refuse it.

The fakes accept what these vendors refuse here (they are laxer than the APIs): the tests assert on the
body each vendor was sent, or on the client's 400 where nothing may be sent.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import openai
import pydantic
import pytest

from gateway.config import Backend
from gateway.errors import InvalidRequest
from gateway.providers import gemini
from gateway.providers import openai as openai_provider
from gateway.types import ChatRequest, Message
from tests.fakes import FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import HI, LOOKUP, RunningGateway

ANSWER_SCHEMA: Any = {"type": "object", "properties": {"a": {"type": "string"}}}
ANSWER: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
EMPTY_ASSISTANT: Any = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "second question"},
]


def _openai_body(base_url: str, model: str, **fields: Any) -> dict[str, Any]:
    """What an OpenAI-format backend at `base_url` is sent for `model`."""
    backend = Backend(name="b", type="openai", base_url=base_url, api_key="k")
    request = ChatRequest(model="public", messages=[Message(role="user", content="hi")], **fields)
    body: dict[str, Any] = json.loads(openai_provider.chat_request(backend, request, model).body)
    return body


# --- stop sequences: OpenAI 4, Gemini 5 ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "fake_name", "most", "sent_stops"),
    [
        ("gpt-4o-mini", "fake_openai", 4, lambda body: body["stop"]),
        ("gemini-flash", "fake_gemini", 5, lambda body: body["generationConfig"]["stopSequences"]),
    ],
    ids=["openai", "gemini"],
)
def test_an_anthropic_clients_stop_sequences_past_the_vendors_limit_are_never_sent(
    gateway: RunningGateway,
    request: pytest.FixtureRequest,
    model: str,
    fake_name: str,
    most: int,
    sent_stops: Any,
) -> None:
    """Anthropic takes any number of stop sequences; OpenAI at most 4 (400 "'stop': array too long.
    Expected an array with maximum length 4"), Gemini's `stopSequences` "up to 5". An Anthropic
    client's one more than that gets Weir's own 400, naming `stop`, and the vendor is sent nothing;
    as many as it takes go as they are."""
    fake = request.getfixturevalue(fake_name)
    stops = ["AAA", "BBB", "CCC", "DDD", "EEE", "FFF"][: most + 1]
    with pytest.raises(anthropic.BadRequestError) as info:
        gateway.anthropic().messages.create(model=model, max_tokens=20, stop_sequences=stops, messages=HI)
    assert f"at most {most} stop sequences" in info.value.message
    assert not fake.requests
    gateway.anthropic().messages.create(model=model, max_tokens=20, stop_sequences=stops[:most], messages=HI)
    assert sent_stops(fake.last_request.json) == stops[:most]


@pytest.mark.parametrize(
    ("base_url", "model", "sent"),
    [
        ("https://api.openai.com/v1", "gpt-4o", False),
        ("https://acme.openai.azure.com/openai/deployments/prod", "prod", False),
        ("http://10.0.0.7:4000/v1", "gpt-4.1-mini", False),  # OpenAI's model behind a proxy
        ("http://vllm.internal:8000/v1", "meta-llama/Llama-3.1-8B-Instruct", True),
        ("http://vllm.internal:8000/v1", "openai/gpt-oss-20b", True),
    ],
)
def test_more_than_four_stop_sequences_are_refused_for_openais_models_only(
    base_url: str, model: str, sent: bool
) -> None:
    """OpenAI's limit is OpenAI's (its API, Azure's, its models wherever served): a vLLM-style server
    is sent every stop sequence the client gave."""
    stops = ["a", "b", "c", "d", "e"]
    if sent:
        assert _openai_body(base_url, model, stop=stops)["stop"] == stops
    else:
        with pytest.raises(InvalidRequest) as info:
            _openai_body(base_url, model, stop=stops)
        assert info.value.param == "stop"


def test_a_backend_moved_to_another_url_gets_that_urls_rules() -> None:
    """The checks of a backend's URL are worked out once per URL (openai._host_and_path), not per
    request: a config reload that moves a backend (same name, same model) to another server gets that
    server's rules from its next request on, and back again."""
    stops = ["a", "b", "c", "d", "e"]
    moves = [
        ("http://vllm.internal:8000/v1", "max_tokens", True),  # the client's name, every stop
        ("https://api.openai.com/v1", "max_completion_tokens", False),
        ("https://api.deepseek.com/v1", "max_tokens", True),
        ("https://acme.azure.com/openai/deployments/prod", "max_completion_tokens", False),
        ("https://acme.azure.com/other/v1", "max_tokens", True),  # Azure, but not its OpenAI path
        ("http://vllm.internal:8000/v1", "max_tokens", True),
    ]
    for base_url, limit_field, all_stops in moves:
        assert limit_field in _openai_body(base_url, "house-model", max_tokens=16), base_url
        if all_stops:
            assert _openai_body(base_url, "house-model", stop=stops)["stop"] == stops
        else:
            with pytest.raises(InvalidRequest):
                _openai_body(base_url, "house-model", stop=stops)


def test_a_backends_url_is_parsed_once_not_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """urlparse cost more than the rest of the adapter's URL checks, four times on every request."""
    parsed: list[str] = []
    real = openai_provider.urlparse

    def counting(url: str) -> Any:
        parsed.append(url)
        return real(url)

    monkeypatch.setattr(openai_provider, "urlparse", counting)
    url = "http://parsed-once.internal:8000/v1"  # no other test's, so not parsed before this one
    for _ in range(3):
        _openai_body(url, "house-model", max_tokens=16)
    assert parsed == [url]


# --- Gemini: no content without parts -----------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        EMPTY_ASSISTANT,
        [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hello"}]}],
    ],
    ids=["empty-turn", "empty-part"],
)
def test_gemini_is_never_sent_a_content_without_parts(
    gateway: RunningGateway, fake_gemini: FakeGemini, messages: Any
) -> None:
    """Gemini refuses a content with no parts (400 INVALID_ARGUMENT "contents.parts must not be empty")
    and an empty text part; an OpenAI assistant turn with content "" (a stored empty reply) made one.
    The empty turn is left out and the user turns around it are one content, as two user turns are."""
    gateway.openai().chat.completions.create(model="gemini-flash", messages=messages, max_tokens=20)
    contents = fake_gemini.last_request.json["contents"]
    assert all(content["parts"] for content in contents), contents
    assert all(part.get("text") != "" for content in contents for part in content["parts"]), contents
    if messages is EMPTY_ASSISTANT:
        assert contents == [
            {"role": "user", "parts": [{"text": "first question"}, {"text": "second question"}]}
        ]


@pytest.mark.parametrize("content", ["", [{"type": "text", "text": ""}]], ids=["empty", "empty-part"])
def test_an_empty_final_user_message_is_a_400_for_gemini_not_a_model_turn_to_continue(
    gateway: RunningGateway, fake_gemini: FakeGemini, content: Any
) -> None:
    """Gemini refuses an empty text part, which is left out; the final user message's only one would
    leave the conversation ending with the model's turn, which Gemini continues (or, from 3.5, refuses):
    a 400 naming the message instead, nothing sent."""
    messages: Any = [*EMPTY_ASSISTANT[:1], {"role": "assistant", "content": "an answer"}]
    messages.append({"role": "user", "content": content})
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model="gemini-flash", messages=messages)
    body = caught.value.body
    assert isinstance(body, dict) and (body["type"], body["param"]) == (
        "invalid_request_error",
        "messages[2].content",
    )
    assert not fake_gemini.requests


def test_a_whitespace_final_user_message_reaches_gemini_as_sent(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Gemini takes a text part of whitespace (only an empty one has no data): it is sent as is."""
    messages: Any = [*EMPTY_ASSISTANT[:1], {"role": "assistant", "content": "an answer"}]
    messages.append({"role": "user", "content": " \n"})
    gateway.openai().chat.completions.create(model="gemini-flash", messages=messages, max_tokens=20)
    assert fake_gemini.last_request.json["contents"][-1] == {"role": "user", "parts": [{"text": " \n"}]}


def test_gemma_is_sent_the_system_prompt_at_the_start_of_the_first_user_turn(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Gemma, served by the Gemini API, refuses a system instruction ("Developer instruction is not
    enabled for models/gemma-3-27b-it"): every request with a system prompt was its 400. Gemma has
    no system role; the instructions open the first user turn, as Google advises for it."""
    asked: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one two"},
        {"role": "assistant", "content": "one two"},
        {"role": "user", "content": "three"},
    ]
    chat = gateway.openai().chat.completions.create(model="gemma", messages=asked)
    assert chat.choices[0].message.content == "three"
    sent = fake_gemini.last_request.json
    assert "systemInstruction" not in sent
    assert sent["contents"][0] == {"role": "user", "parts": [{"text": "Be brief."}, {"text": "one two"}]}
    message = gateway.anthropic().messages.create(
        model="gemma", max_tokens=50, system="Be brief.", messages=[{"role": "user", "content": "four"}]
    )
    assert message.content[0].type == "text" and message.content[0].text.endswith("four")
    assert fake_gemini.last_request.json["contents"] == [
        {"role": "user", "parts": [{"text": "Be brief."}, {"text": "four"}]}
    ]


def test_a_gemma_conversation_that_starts_with_the_model_gets_the_instructions_before_it() -> None:
    request = ChatRequest(
        model="gemma",
        messages=[
            Message(role="system", content="Be brief."),
            Message(role="assistant", content="Hello."),
            Message(role="user", content="Hi"),
        ],
    )
    body = gemini.chat_body(request, "gemma-3-27b-it")
    assert "systemInstruction" not in body
    assert body["contents"][0] == {"role": "user", "parts": [{"text": "Be brief."}]}
    assert "systemInstruction" in gemini.chat_body(request, "gemini-2.5-flash")


# --- Gemini before 3: structured output beside tools, in words --------------------------------------


def test_gemini_2_is_not_sent_a_json_mime_type_beside_function_declarations(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Gemini before 3 refuses structured output with function calling: 400 "Function calling with a
    response mime type: 'application/json' is unsupported". OpenAI takes tools and response_format
    together (an agent whose final answer has a schema): Gemini 2.5 keeps the tools and is asked for
    the schema in its system instruction, as Claude is beside the client's tools."""
    gateway.openai().chat.completions.create(
        model="gemini-flash", messages=HI, tools=[LOOKUP], response_format=ANSWER
    )
    sent = fake_gemini.last_request.json
    assert sent["tools"][0]["functionDeclarations"][0]["name"] == "lookup"
    config = sent.get("generationConfig") or {}
    assert "responseMimeType" not in config and "responseSchema" not in config, config
    (instruction,) = sent["systemInstruction"]["parts"]
    assert json.dumps(ANSWER_SCHEMA, separators=(",", ":")) in instruction["text"]


def test_gemini_3_and_gemini_2_without_tools_keep_the_json_mime_type(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Gemini 3 takes structured output beside function calling; without tools every Gemini takes it."""
    client = gateway.openai()
    for model, tools in (("gemini-pro", [LOOKUP]), ("gemini-flash", None)):
        extra: Any = {"tools": tools} if tools else {}
        client.chat.completions.create(model=model, messages=HI, response_format=ANSWER, **extra)
        sent = fake_gemini.last_request.json
        assert sent["generationConfig"]["responseMimeType"] == "application/json", model
        assert sent["generationConfig"]["responseSchema"] == ANSWER_SCHEMA, model
        assert "systemInstruction" not in sent, model


# --- Gemini's Schema subset: JSON Schema's nullable types, const, oneOf, allOf in its terms -------------


class Place(pydantic.BaseModel):
    city: str


class Visit(pydantic.BaseModel):
    kind: Literal["visit"]  # Pydantic's `const`
    note: str | None  # Pydantic's `anyOf` of a type and `null`
    place: Place | None  # a `$ref` beside `null`


def test_a_pydantic_response_format_with_optional_and_literal_fields_parses_from_gemini(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """The OpenAI SDK's `parse` sends an optional field as an `anyOf` with `{"type": "null"}` and a
    one-value Literal as `const`. Gemini's `responseSchema` has no `const` field (400 "Unknown name
    \"const\" ... Cannot find field."), so the request failed; its way to say null is `nullable`."""
    reply = gateway.openai().chat.completions.parse(model="gemini-flash", messages=HI, response_format=Visit)
    visit = reply.choices[0].message.parsed
    assert isinstance(visit, Visit) and visit.kind == "visit"
    sent = fake_gemini.last_request.json["generationConfig"]["responseSchema"]["properties"]
    assert sent["kind"]["enum"] == ["visit"] and "const" not in sent["kind"]
    assert (sent["note"]["type"], sent["note"]["nullable"]) == ("string", True)
    assert sent["place"]["type"] == "object" and sent["place"]["nullable"] is True
    assert sent["place"]["properties"] == {"city": {"title": "City", "type": "string"}}


# A tool as OpenAI documents strict function calling: an optional field's type a list with "null".
STRICT_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "book",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "date": {"type": ["string", "null"]},
                "seats": {"type": "integer", "enum": [1, 2]},
                "seat": {"type": ["string", "null"], "enum": ["aisle", "window", None]},
                "pay": {"oneOf": [{"type": "string"}, {"type": "number"}]},
                "who": {"allOf": [{"type": "object", "properties": {"name": {"type": "string"}}}]},
            },
            "required": ["city", "date", "seats", "seat", "pay", "who"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_strict_tools_nullable_types_oneof_and_allof_reach_gemini_in_its_schema_terms(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """`"type": ["string", "null"]` is a 400 from Gemini ("Proto field is not repeating, cannot start
    list"), as are `oneOf` and `allOf` (no such fields), an enum with null (OpenAI's optional enum)
    and an enum of numbers (its enum is a STRING's, of strings): the whole request refused for one
    optional parameter. The numbers' type is kept, their values told in the description."""
    client = gateway.openai()
    messages: Any = [{"role": "user", "content": "call book"}]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="gemini-flash", messages=messages, tools=[STRICT_TOOL], stream=True
            )
        )
        names = [c.function.name for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
    else:
        reply = client.chat.completions.create(model="gemini-flash", messages=messages, tools=[STRICT_TOOL])
        names = [call.function.name for call in reply.choices[0].message.tool_calls or ()]  # type: ignore[union-attr]
    assert names == ["book"]
    sent = fake_gemini.last_request.json["tools"][0]["functionDeclarations"][0]["parameters"]["properties"]
    assert sent["date"] == {"type": "string", "nullable": True}
    assert sent["seats"] == {"type": "integer", "description": "One of: [1,2]"}
    assert sent["seat"] == {"type": "string", "enum": ["aisle", "window"], "nullable": True}
    assert sent["pay"] == {"anyOf": [{"type": "string"}, {"type": "number"}]}
    assert sent["who"] == {"type": "object", "properties": {"name": {"type": "string"}}}


class Halt(pydantic.BaseModel):
    """An action that takes no arguments."""


class Step(pydantic.BaseModel):
    say: str
    halt: Halt


# A tool as MCP servers write them: an object with `properties` and no `type` (implicit in JSON
# Schema), and an options object with no properties.
PAGE_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "update_page",
        "parameters": {
            "type": "object",
            "properties": {
                "data": {"properties": {"page_id": {"type": "string"}}, "required": ["page_id"]},
                "options": {"type": "object", "properties": {}, "required": ["ref"]},
                "tags": {"type": "array"},
                "title": {"type": "string", "properties": {"text": {"type": "string"}}, "required": ["text"]},
            },
            "required": ["data", "ref"],  # `ref` defined nowhere, as some MCP servers' tools have it
        },
    },
}


def test_objects_without_properties_or_type_reach_gemini_as_objects(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Gemini refuses `properties` that are empty ("should be non-empty for OBJECT type": a Pydantic
    model without fields) or beside no OBJECT type ("only allowed for OBJECT type"), and a required
    name no property defines ("property is not defined"): the whole request was its 400. An empty
    object is sent as an object of any shape, an untyped one as an object, an undefined name is not
    required. So are `properties` on a string (MCP tools' slips, "only allowed for OBJECT type") and an
    array without `items` ("items: missing field"): left out, and asked as an array of strings."""
    client = gateway.openai()
    reply = client.chat.completions.parse(model="gemini-flash", messages=HI, response_format=Step)
    assert reply.choices[0].message.parsed == Step(say="one two three", halt=Halt())
    halt = fake_gemini.last_request.json["generationConfig"]["responseSchema"]["properties"]["halt"]
    assert halt["type"] == "object" and "properties" not in halt
    messages: Any = [{"role": "user", "content": "call update_page"}]
    called = client.chat.completions.create(model="gemini-flash", messages=messages, tools=[PAGE_TOOL])
    assert called.choices[0].message.tool_calls
    sent = fake_gemini.last_request.json["tools"][0]["functionDeclarations"][0]["parameters"]["properties"]
    assert sent["data"]["type"] == "object" and sent["options"] == {"type": "object"}
    assert sent["tags"] == {"type": "array", "items": {"type": "string"}} and sent["title"] == {
        "type": "string"
    }
    assert fake_gemini.last_request.json["tools"][0]["functionDeclarations"][0]["parameters"]["required"] == [
        "data"
    ]


# --- thinking as reasoning_effort, for reasoning models only ---------------------------------------


def test_an_anthropic_clients_thinking_is_not_sent_as_reasoning_effort_to_gpt_4o_mini(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """An Anthropic client (Claude Code sends `thinking` on every turn) routed to gpt-4o-mini: its
    thinking budget became `reasoning_effort`, which OpenAI's non-reasoning models refuse (400
    "Unsupported parameter: 'reasoning_effort' is not supported with this model."). gpt-4o-mini is sent
    none; gpt-5, a reasoning model, still gets the budget as an effort."""
    client = gateway.anthropic()
    thinking: Any = {"type": "enabled", "budget_tokens": 2048}
    client.messages.create(model="gpt-4o-mini", max_tokens=4000, thinking=thinking, messages=HI)
    sent = fake_openai.last_request.json
    assert sent["model"] == "gpt-4o-mini"
    assert "reasoning_effort" not in sent, sent["reasoning_effort"]
    client.messages.create(model="gpt-5", max_tokens=4000, thinking=thinking, messages=HI)
    assert fake_openai.last_request.json["reasoning_effort"] == "medium"


def test_an_anthropic_clients_effort_reaches_openais_reasoning_models_only(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """An Anthropic client's `output_config.effort` became `reasoning_effort` for gpt-4o-mini too,
    which refuses it (400 unsupported_parameter): it now follows the budget's rule, sent to gpt-5 only.
    An OpenAI client's own `reasoning_effort` is passed as it is: that client asked the model for it."""
    client = gateway.anthropic()
    effort: Any = {"output_config": {"effort": "low"}}  # the SDK has no parameter of its own for it
    client.messages.create(model="gpt-4o-mini", max_tokens=400, messages=HI, extra_body=effort)
    sent = fake_openai.last_request.json
    assert sent["model"] == "gpt-4o-mini"
    assert "reasoning_effort" not in sent, sent["reasoning_effort"]
    assert "reasoning_effort_translated" not in sent
    client.messages.create(model="gpt-5", max_tokens=400, messages=HI, extra_body=effort)
    assert fake_openai.last_request.json["reasoning_effort"] == "low"
    gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=HI, reasoning_effort="low")
    assert fake_openai.last_request.json["reasoning_effort"] == "low"


@pytest.mark.parametrize(
    ("base_url", "model", "effort"),
    [
        ("https://api.openai.com/v1", "gpt-4o", None),
        ("https://api.openai.com/v1", "o4-mini", "medium"),
        ("https://acme.openai.azure.com/openai/deployments/prod", "prod", None),
        ("http://vllm.internal:8000/v1", "Qwen/Qwen3-8B", "medium"),  # as before: not OpenAI's rules
    ],
)
def test_a_thinking_budget_becomes_an_effort_where_the_model_takes_one(
    base_url: str, model: str, effort: str | None
) -> None:
    """OpenAI's own API (and Azure's) takes `reasoning_effort` for its reasoning models only; other
    OpenAI-compatible servers are sent the budget as an effort as before."""
    assert _openai_body(base_url, model, reasoning_budget=2048).get("reasoning_effort") == effort


# --- parallel_tool_calls: false, which Gemini has no switch for ---------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_gemini_answers_a_client_that_asked_for_no_parallel_calls_with_one_call(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """Gemini has no `parallel_tool_calls` switch (nothing is sent for it) and may call several
    functions at once: a client that asked for one call at most got them all. It now gets the first."""
    fake_gemini.call_in_parallel(3)
    client = gateway.openai()
    asked: Any = {"model": "gemini-flash", "messages": [{"role": "user", "content": "call lookup"}]}
    asked["tools"] = [LOOKUP]

    def calls(**fields: Any) -> list[str]:
        if not stream:
            message = client.chat.completions.create(**asked, **fields).choices[0].message
            return [call.id for call in message.tool_calls or ()]
        deltas = [
            call
            for chunk in client.chat.completions.create(**asked, **fields, stream=True)
            for choice in chunk.choices
            for call in choice.delta.tool_calls or ()
        ]
        return [call.id for call in deltas if call.id]

    assert len(calls()) == 3  # Gemini's parallel calls, as it sent them
    (one,) = calls(parallel_tool_calls=False)
    assert one
    sent = fake_gemini.last_request.json
    assert "parallel_tool_calls" not in json.dumps(sent)


# --- OpenAI's input_audio as Gemini's inline audio ------------------------------------------------------

WAV = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA="  # a 44-byte silent WAV


def _spoken(audio_format: str) -> Any:
    audio = {"type": "input_audio", "input_audio": {"data": WAV, "format": audio_format}}
    return [{"role": "user", "content": [{"type": "text", "text": "transcribe"}, audio]}]


@pytest.mark.parametrize("audio_format", ["wav", "mp3"])
def test_openai_input_audio_reaches_gemini_as_inline_audio(
    gateway: RunningGateway, fake_gemini: FakeGemini, audio_format: str
) -> None:
    """Gemini reads audio inline (`inlineData` of audio/wav, audio/mp3): an OpenAI client's audio clip
    was Weir's 400 ("content parts of type 'input_audio' are not supported")."""
    reply = gateway.openai().chat.completions.create(model="gemini-flash", messages=_spoken(audio_format))
    assert reply.choices[0].message.content
    parts = fake_gemini.last_request.json["contents"][0]["parts"]
    assert parts == [
        {"text": "transcribe"},
        {"inlineData": {"mimeType": f"audio/{audio_format}", "data": WAV}},
    ]


def test_audio_of_a_format_gemini_does_not_read_is_refused_before_sending(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    before = fake_gemini.requests[-1] if fake_gemini.requests else None
    with pytest.raises(openai.BadRequestError) as refused:
        gateway.openai().chat.completions.create(model="gemini-flash", messages=_spoken("pcm16"))
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == (
        "unsupported_value",
        "messages[0].content[1].input_audio.format",
    )
    assert (fake_gemini.requests[-1] if fake_gemini.requests else None) is before  # nothing sent
