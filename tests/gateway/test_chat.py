"""/v1/chat/completions with the official openai SDK, through every backend type."""

from __future__ import annotations

import base64
import json
from typing import Any

import openai
import pytest

from gateway.config import Backend
from gateway.providers import openai as openai_provider
from gateway.types import ChatRequest, Message, StreamOptions
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import PARALLEL_CALLS, RunningGateway

MODELS = ["gpt-4o-mini", "claude-sonnet", "gemini-flash", "deepseek-chat"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()


@pytest.mark.parametrize("model", MODELS)
def test_chat(gateway: RunningGateway, model: str) -> None:
    response = gateway.openai().chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello from weir"}],
    )
    assert response.choices[0].message.content == "hello from weir"
    assert response.choices[0].finish_reason == "stop"
    assert response.usage is not None and response.usage.completion_tokens == 3
    [event] = gateway.sink.events
    assert (event.route, event.tenant_id, event.status) == (model, "demo", 200)
    assert event.cost_pico_usd >= 0 and event.usage.output_tokens == 3


@pytest.mark.parametrize("model", MODELS)
def test_chat_reply_carries_the_assistant_role(gateway: RunningGateway, model: str) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}]
    )
    assert json.loads(raw.text)["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("model", MODELS)
def test_chat_stream(gateway: RunningGateway, model: str) -> None:
    stream = gateway.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": "one two three four"}], stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three four"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    assert all(c.usage is None for c in chunks)  # the client did not ask for usage...
    [event] = gateway.sink.events
    assert event.usage.output_tokens == 4  # ...but the ledger has it
    assert event.ttft_ms is not None


def test_vendor_receives_translated_parameters(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    client = gateway.openai()
    params = dict(temperature=0.2, top_p=0.9, max_tokens=50, stop=["END"], seed=7, user="u-1")
    for model in ("gpt-4o-mini", "claude-sonnet", "gemini-flash"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **params)  # type: ignore[arg-type]
    sent = fake_openai.last_request.json
    assert (
        sent["model"] == "gpt-4o-mini"
        and sent["seed"] == 7
        and sent["stop"] == ["END"]
        and sent["user"] == "u-1"
    )
    sent = fake_anthropic.last_request.json
    assert sent["model"] == "claude-sonnet-4-5"
    # Sonnet 4.5 refuses top_p beside temperature: only the temperature goes (test_translation_anthropic_rules).
    assert (sent["max_tokens"], sent["temperature"], sent.get("top_p")) == (50, 0.2, None)
    assert sent["stop_sequences"] == ["END"] and sent["metadata"] == {"user_id": "u-1"}
    assert fake_anthropic.last_request.headers["x-api-key"] == fake_anthropic.api_key
    assert fake_anthropic.last_request.headers["anthropic-version"] == "2023-06-01"
    sent = fake_gemini.last_request
    assert sent.path.endswith("/models/gemini-2.5-flash:generateContent")
    assert sent.headers["x-goog-api-key"] == fake_gemini.api_key
    config = sent.json["generationConfig"]
    assert config == {
        "temperature": 0.2,
        "topP": 0.9,
        "maxOutputTokens": 50,
        "stopSequences": ["END"],
        "seed": 7,
    }


@pytest.mark.parametrize("model", MODELS)
def test_max_tokens_and_stop(gateway: RunningGateway, model: str) -> None:
    client = gateway.openai()
    cut = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a b c d e f g"}], max_completion_tokens=3
    )
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("a b c", "length")
    stopped = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "alpha beta STOP gamma"}], stop="STOP"
    )
    assert stopped.choices[0].message.content.strip() == "alpha beta"
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_call_round_trip(gateway: RunningGateway, model: str, stream: bool) -> None:
    client = gateway.openai()
    messages: list[dict] = [{"role": "user", "content": 'call get_weather {"city": "Oslo", "unit": "c"}'}]
    if stream:
        chunks = list(
            client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], stream=True)
        )  # type: ignore[arg-type]
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        call_id = next(d.id for d in deltas if d.id)
        assert next(d for d in deltas if d.id).type == "function"  # as OpenAI: on the call's first delta
        name = next(d.function.name for d in deltas if d.function and d.function.name)
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["tool_calls"]
    else:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, tools=[WEATHER_TOOL]
        )  # type: ignore[arg-type]
        # The SDK would fill in a missing "type"; stricter clients (and OpenAI, when it comes back) do not.
        assert [c["type"] for c in json.loads(raw.text)["choices"][0]["message"]["tool_calls"]] == [
            "function"
        ]
        response = raw.parse()
        assert response.choices[0].finish_reason == "tool_calls"
        [call] = response.choices[0].message.tool_calls or []
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert name == "get_weather"
    assert json.loads(arguments) == {"city": "Oslo", "unit": "c"}
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 degrees"},
    ]
    answer = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL])  # type: ignore[arg-type]
    content = answer.choices[0].message.content or ""
    # Gemini takes tool results as objects: plain text arrives wrapped as {"result": ...}.
    assert content.startswith("Tool get_weather returned: ") and "sunny, 21 degrees" in content


def test_tool_results_reach_each_vendor_in_its_format(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    client = gateway.openai()
    for model in ("claude-sonnet", "gemini-flash"):
        client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER_TOOL], tool_choice="auto"
        )  # type: ignore[arg-type]
    sent = fake_anthropic.last_request.json
    assert sent["messages"][1] == {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Rome"}}],
    }
    assert sent["messages"][2] == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": '{"sky": "clear"}'}],
    }
    assert sent["tools"][0]["input_schema"]["required"] == ["city"] and sent["tool_choice"] == {
        "type": "auto"
    }
    sent = fake_gemini.last_request.json
    assert sent["contents"][1] == {
        "role": "model",
        "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Rome"}}}],
    }
    assert sent["contents"][2] == {
        "role": "user",
        "parts": [{"functionResponse": {"name": "get_weather", "response": {"sky": "clear"}}}],
    }
    declaration = sent["tools"][0]["functionDeclarations"][0]
    assert "additionalProperties" not in declaration["parameters"]
    assert sent["toolConfig"] == {"functionCallingConfig": {"mode": "AUTO"}}


def test_tool_message_images_reach_openai_in_a_user_message(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A client's tool message with an image (OpenAI itself refuses one; other servers and the
    Anthropic and Gemini backends take it) goes to an OpenAI-compatible backend as an Anthropic
    client's tool_result image does: the image in a user message after the tool results."""
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "radar:"}, image]},
    ]
    response = gateway.openai().chat.completions.create(
        model="gpt-4o-mini", messages=messages, tools=[WEATHER_TOOL]
    )  # type: ignore[arg-type]
    assert response.choices[0].message.content == "[image]"
    sent = fake_openai.last_request.json["messages"]  # type: ignore[union-attr]
    assert sent[2] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": [{"type": "text", "text": "radar:"}],
    }
    assert sent[3] == {"role": "user", "content": [image]}


@pytest.mark.parametrize("model", MODELS)
def test_forced_tool_choice(gateway: RunningGateway, model: str) -> None:
    response = gateway.openai().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "anything"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = response.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet", "gemini-flash"])
def test_images(gateway: RunningGateway, model: str) -> None:
    response = gateway.openai().chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                ],
            }
        ],
    )
    assert response.choices[0].message.content == "what is this [image]"


def test_images_reach_each_vendor_in_its_format(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.webp"}},
        {"type": "text", "text": "compare"},
    ]
    client = gateway.openai()
    for model in ("claude-sonnet", "gemini-flash"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}])  # type: ignore[list-item]
    blocks = fake_anthropic.last_request.json["messages"][0]["content"]
    assert blocks[0] == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": PNG},
    }
    assert blocks[1] == {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.webp"}}
    parts = fake_gemini.last_request.json["contents"][0]["parts"]
    assert parts[0] == {"inlineData": {"mimeType": "image/png", "data": PNG}}
    assert parts[1] == {"fileData": {"mimeType": "image/webp", "fileUri": "https://example.com/cat.webp"}}


JPEG = base64.b64encode(b"\xff\xd8\xff\xe0\0\x10JFIF" + b"\0" * 32).decode()
WEBP = base64.b64encode(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 32).decode()


@pytest.mark.parametrize(
    ("url", "media_type", "data"),
    [
        (f"data:image/jpg;base64,{JPEG}", "image/jpeg", JPEG),  # browsers' and pasteboards' name
        (f"data:image/png;base64,{JPEG}", "image/jpeg", JPEG),  # a screenshot tool's wrong label
        (f"data:application/octet-stream;base64,{WEBP}", "image/webp", WEBP),
        (f"data:image/jpg;base64,{PNG[:4]}", "image/jpeg", PNG[:4]),  # too short to tell: the name alone
    ],
    ids=["jpg", "mislabelled", "octet-stream", "unknown-bytes"],
)
def test_an_images_type_reaches_claude_and_gemini_as_its_bytes_say(
    gateway: RunningGateway,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    url: str,
    media_type: str,
    data: str,
) -> None:
    """OpenAI reads an image's bytes and takes any label; Anthropic takes `image/jpeg`, `image/png`,
    `image/gif` and `image/webp` alone, and refuses a label the bytes contradict ("Image does not
    match the provided media type image/png"): each vendor gets the type the bytes are, or else
    the label under its standard name."""
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]
    client = gateway.openai()
    for model in ("claude-sonnet", "gemini-flash"):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}])  # type: ignore[list-item]
        assert reply.choices[0].message.content == "what is this [image]"
    block = fake_anthropic.last_request.json["messages"][0]["content"][1]
    assert block["source"] == {"type": "base64", "media_type": media_type, "data": data}
    part = fake_gemini.last_request.json["contents"][0]["parts"][1]
    assert part == {"inlineData": {"mimeType": media_type, "data": data}}


GIF = "R0lGODlhAQABAAAAACw="  # GIF89a, a 1x1 image's start


@pytest.mark.parametrize(
    "url", [f"data:image/gif;base64,{GIF}", "https://example.com/cat.gif"], ids=["inline", "url"]
)
def test_a_gif_is_a_400_for_gemini_naming_the_part_and_nothing_is_sent(
    gateway: RunningGateway, fake_gemini: FakeGemini, url: str
) -> None:
    """Gemini reads PNG, JPEG, WebP, HEIC and HEIF, and refuses a GIF ("Unsupported MIME type:
    image/gif"), which OpenAI and Claude take: Weir's own 400 `unsupported_value` names the part, so a
    route passes Gemini over for a candidate that reads it, instead of Gemini's 400 ending the request."""
    content: Any = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(
            model="gemini-flash", messages=[{"role": "user", "content": content}]
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("unsupported_value", "messages[0].content[1]")
    assert "image/gif" in error["message"]
    assert not fake_gemini.requests


@pytest.mark.parametrize("model", MODELS)
def test_response_format_json_schema(gateway: RunningGateway, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
        "required": ["answer", "score"],
    }
    response = gateway.openai().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "rate weir"}],
        response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": schema}},
    )
    value = json.loads(response.choices[0].message.content or "")
    assert set(value) == {"answer", "score"} and isinstance(value["score"], int)
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("model", MODELS)
def test_response_format_json_object_streamed(gateway: RunningGateway, model: str) -> None:
    chunks = gateway.openai().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "reply in JSON"}],
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_n_choices_on_openai_and_gemini(gateway: RunningGateway) -> None:
    client = gateway.openai()
    for model in ("gpt-4o-mini", "gemini-flash"):
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], n=2
        )
        assert [c.index for c in response.choices] == [0, 1]


def test_unmodelled_parameters_pass_through_to_openai_compatible_servers(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    gateway.openai().chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "hi"}],
        metadata={"team": "search"},
        store=True,  # OpenAI takes metadata only beside it
        extra_body={"top_k": 5},
    )
    sent = fake_openai.last_request.json
    assert sent["top_k"] == 5 and sent["metadata"] == {"team": "search"}


# --- OpenAI-compatible servers' own ways (tests.fakes.compat) ------------------------------------


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_keeps_its_last_chunk_when_that_also_reports_usage(
    compat_gateway: RunningGateway, include_usage: bool
) -> None:
    """Mistral, Together and llama.cpp report the usage on the chunk with the finish reason. A client
    that did not ask for usage (the SDK's default) still gets that chunk, without the usage; one that
    asked gets it with the usage."""
    stream = compat_gateway.openai().chat.completions.create(
        model="mistral-small",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": include_usage},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert [u.completion_tokens for u in usages] == ([2] if include_usage else [])


def test_a_resumed_stream_keeps_the_finish_reported_with_the_usage(compat_gateway: RunningGateway) -> None:
    """A route's stream cut after "Hello" goes on on Mistral, whose last chunk holds the finish and
    the usage: the client, which did not ask for usage, gets the rest of the answer and its finish."""
    stream = compat_gateway.openai().chat.completions.create(
        model="cut-then-mistral", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    assert all(c.usage is None for c in chunks)


def test_a_whole_answer_keeps_the_fields_weir_does_not_model(compat_gateway: RunningGateway) -> None:
    """`modalities`/`audio` are forwarded to OpenAI-compatible servers (unmodelled parameters): the
    audio the client asked (and pays) for, the message's citations and the completion's
    `service_tier` come back as the server sent them, as they do in a stream."""
    completion = compat_gateway.openai().chat.completions.create(
        model="gpt-4o-audio-preview",
        messages=[{"role": "user", "content": "say hi"}],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
    )
    message = completion.choices[0].message
    assert message.audio is not None and message.audio.transcript == "Hi there"
    assert message.annotations and message.annotations[0].url_citation.url == "https://example.com/"
    assert completion.service_tier == "default"
    assert completion.object == "chat.completion" and completion.usage is not None


# vLLM's own fields beside OpenAI's (tests.fakes.compat `vllm-served`), which the SDK keeps in each
# object's `model_extra`: the choice's `stop_reason` and, asked for with `return_token_ids`, the
# choices' `token_ids` and the prompt's `prompt_token_ids`.
VLLM_IDS = {"return_token_ids": True}


def _vllm_stream_body(include_usage: bool) -> dict[str, object]:
    """A streamed request's vLLM parameters: token ids, and the usage so far on every chunk."""
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    return {**VLLM_IDS, "stream_options": options}


def test_a_whole_answer_keeps_its_choices_fields_weir_does_not_model(compat_gateway: RunningGateway) -> None:
    """As the completion's and its message's own: each choice's fields come back as vLLM sent them."""
    completion = compat_gateway.openai().chat.completions.create(
        model="vllm-served", messages=[{"role": "user", "content": "hi"}], extra_body=VLLM_IDS
    )
    [choice] = completion.choices
    assert choice.message.content == "Hello there" and choice.finish_reason == "stop"
    assert choice.model_extra == {"stop_reason": "END", "token_ids": [9906, 1070]}
    assert (completion.model_extra or {})["prompt_token_ids"] == [1, 15043]


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_re_encoded_for_its_usage_keeps_the_fields_weir_does_not_model(
    compat_gateway: RunningGateway, include_usage: bool
) -> None:
    """vLLM's `continuous_usage_stats` puts the usage so far on every chunk, so every chunk is
    re-encoded (its usage normalised, or left out for a client that did not ask for it), not passed
    on as vLLM's JSON: each keeps its chunk's and its choice's own fields all the same."""
    stream = compat_gateway.openai().chat.completions.create(
        model="vllm-served",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body=_vllm_stream_body(include_usage),
    )
    chunks = list(stream)
    answer = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in answer) == "Hello there"
    assert [c.choices[0].model_extra for c in answer] == [
        {"token_ids": []},
        {"token_ids": [9906]},
        {"token_ids": [1070]},
        {"token_ids": [], "stop_reason": "END"},
    ]
    assert [c.model_extra for c in answer] == [{"prompt_token_ids": [1, 15043]}, {}, {}, {}]
    usages = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert usages == ([0, 1, 2, 2, 2] if include_usage else [])


def test_a_resumed_stream_keeps_the_fields_weir_does_not_model(compat_gateway: RunningGateway) -> None:
    """A route's stream cut after "Hello" goes on on vLLM: its chunks, joined onto the text sent (so
    changed, and re-encoded), keep their choices' own fields."""
    stream = compat_gateway.openai().chat.completions.create(
        model="cut-then-vllm", messages=[{"role": "user", "content": "hi"}], stream=True, extra_body=VLLM_IDS
    )
    answer = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in answer) == "Hello there"
    finished = [c.choices[0] for c in answer if c.choices[0].finish_reason]
    assert [(c.finish_reason, c.model_extra) for c in finished] == [
        ("stop", {"token_ids": [], "stop_reason": "END"})
    ]


def test_a_stream_with_the_usage_on_every_chunk_times_its_first_token(compat_gateway: RunningGateway) -> None:
    """vLLM's `continuous_usage_stats`: the chunk with the first text also reports the usage so far.
    It is the first token all the same (the ledger's `ttft_ms`), not only a usage report."""
    compat_gateway.sink.events.clear()
    stream = compat_gateway.openai().chat.completions.create(
        model="vllm-served",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body=_vllm_stream_body(False),
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello there"
    [event] = compat_gateway.sink.events
    assert event.status == 200 and event.usage.output_tokens == 2
    assert event.ttft_ms is not None


def _calls(message: object) -> list[tuple[str, str, str]]:
    calls = getattr(message, "tool_calls", None) or []
    return [(call.id, call.function.name, call.function.arguments) for call in calls]


@pytest.mark.parametrize("model", PARALLEL_CALLS)
def test_parallel_calls_streamed_at_one_index_stay_apart(compat_gateway: RunningGateway, model: str) -> None:
    """Ollama, SGLang and Dynamo stream every parallel call at `index: 0`, each starting with its own
    id and name: the SDK's accumulator (as every client) groups deltas by index, and ran the calls
    together into one. Each call now has an index of its own, and one without arguments (`""` from
    the server) has "{}"."""
    with compat_gateway.openai().chat.completions.stream(
        model=model, messages=[{"role": "user", "content": "all of them"}], tools=[WEATHER_TOOL]
    ) as stream:
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message) == PARALLEL_CALLS[model]
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_whole_answers_call_without_arguments_has_an_empty_object(compat_gateway: RunningGateway) -> None:
    """SGLang answers `arguments: ""` for a call without arguments: no JSON, which a client that
    json.loads it fails on, and which some vendors refuse when it comes back the next turn."""
    completion = compat_gateway.openai().chat.completions.create(
        model="sglang-parallel", messages=[{"role": "user", "content": "all of them"}], tools=[WEATHER_TOOL]
    )
    assert _calls(completion.choices[0].message) == PARALLEL_CALLS["sglang-parallel"]


def test_a_resumed_stream_keeps_parallel_calls_streamed_at_one_index_apart(
    compat_gateway: RunningGateway,
) -> None:
    """A route's stream cut after "Hello" goes on on SGLang, which calls tools, all at index 0: the
    resumed stream's calls reach the client apart, as a plain stream's do."""
    with compat_gateway.openai().chat.completions.stream(
        model="cut-then-sglang", messages=[{"role": "user", "content": "all of them"}], tools=[WEATHER_TOOL]
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Hello"
    assert _calls(final.choices[0].message) == PARALLEL_CALLS["sglang-parallel"]


@pytest.mark.parametrize(
    ("base_url", "sent"),
    [
        ("https://api.openai.com/v1", False),
        ("https://acme.openai.azure.com/openai/deployments/gpt-4o", False),
        ("http://vllm.internal:8000/v1", True),
    ],
)
def test_continuous_usage_stats_is_left_out_for_openais_own_api_only(base_url: str, sent: bool) -> None:
    """vLLM's and SGLang's stream option; OpenAI's API refuses an option it does not know."""
    backend = Backend(name="b", type="openai", base_url=base_url, api_key="k")
    options = StreamOptions(continuous_usage_stats=True)
    request = ChatRequest(
        model="m", messages=[Message(role="user", content="hi")], stream=True, stream_options=options
    )
    body = json.loads(openai_provider.chat_request(backend, request, "gpt-4o").body)
    expected = {"include_usage": True, "continuous_usage_stats": True} if sent else {"include_usage": True}
    assert body["stream_options"] == expected


CITING = "read https://example.com/a and https://example.org/b"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_search_models_citations_reach_a_chat_client_as_it_sent_them(
    gateway: RunningGateway, stream: bool
) -> None:
    """`message.annotations` (a search model's `url_citation`s, a delta of their own when streamed)
    come to an OpenAI client as the model sent them."""
    client = gateway.openai()
    messages = [{"role": "user", "content": CITING}]
    if stream:
        chunks = list(
            client.chat.completions.create(model="gpt-4o-search-preview", messages=messages, stream=True)  # type: ignore[arg-type]
        )
        found = [a for c in chunks for ch in c.choices for a in (ch.delta.to_dict().get("annotations") or ())]
    else:
        response = client.chat.completions.create(model="gpt-4o-search-preview", messages=messages)  # type: ignore[arg-type]
        found = [a.to_dict() for a in response.choices[0].message.annotations or ()]
    assert [(CITING[a["url_citation"]["start_index"] : a["url_citation"]["end_index"]]) for a in found] == [
        "https://example.com/a",
        "https://example.org/b",
    ]
    assert {a["type"] for a in found} == {"url_citation"}
