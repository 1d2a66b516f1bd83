"""The pure translations, without any server: canonical <-> each vendor, and Anthropic inbound."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway.anthropic_inbound import (
    MessagesRequest,
    beta_flags,
    from_canonical,
    stream_events,
    to_canonical,
)
from gateway.api.openai import render_chat, render_chunk
from gateway.config import Backend, ConfigError, parse_config
from gateway.errors import BadGateway, InvalidRequest
from gateway.providers import anthropic, gemini, openai
from gateway.providers.base import CONTINUE_INSTRUCTION
from gateway.types import ChatChunk, ChatRequest, ChunkChoice, Delta, FunctionCallDelta, ToolCallDelta
from gateway.usage import Usage

ANTHROPIC = Backend(name="a", type="anthropic", base_url="http://a", api_key="k")
GEMINI = Backend(name="g", type="gemini", base_url="http://g", api_key="k")
OPENAI = Backend(
    name="o", type="openai", base_url="http://o/v1", api_key="k", query={"api-version": "2024-10-21"}
)


def chat(**fields: object) -> ChatRequest:
    return msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, ChatRequest
    )


def body(request: object) -> dict:
    return json.loads(request.body)  # type: ignore[attr-defined]


def test_openai_request_keeps_the_shape_and_asks_for_stream_usage() -> None:
    request = openai.chat_request(OPENAI, chat(stream=True, temperature=0.5), "gpt-x")
    assert request.url == "http://o/v1/chat/completions?api-version=2024-10-21"
    assert request.headers["authorization"] == "Bearer k"
    assert body(request) == {
        "model": "gpt-x",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
    }


def test_anthropic_request_merges_system_messages_and_needs_max_tokens() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "a"},
            {"role": "developer", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    )
    sent = body(anthropic.chat_request(ANTHROPIC, request, "claude"))
    assert sent["system"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert sent["max_tokens"] == anthropic.DEFAULT_MAX_TOKENS
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "c"}]}]


def test_anthropic_rejects_n_above_one() -> None:
    """A code for clients that tell one refusal from another, as for every parameter Weir refuses."""
    with pytest.raises(InvalidRequest) as caught:
        anthropic.chat_request(ANTHROPIC, chat(n=2), "claude")
    assert caught.value.param == "n" and caught.value.code == "unsupported_value"


def test_gemini_rejects_a_sixth_stop_sequence_as_a_value_it_lacks() -> None:
    with pytest.raises(InvalidRequest) as caught:
        gemini.chat_request(GEMINI, chat(stop=["a", "b", "c", "d", "e", "f"]), "gemini-2.5-flash")
    assert caught.value.param == "stop" and caught.value.code == "unsupported_value"


def test_invalid_tool_arguments_in_history_name_the_parameter() -> None:
    request = chat(
        messages=[
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                ],
            },
        ]
    )
    for provider, backend in ((anthropic, ANTHROPIC), (gemini, GEMINI)):
        with pytest.raises(InvalidRequest) as caught:
            provider.chat_request(backend, request, "m")  # type: ignore[attr-defined]
        assert caught.value.param == "messages[1].tool_calls[0].function.arguments"


def test_gemini_streams_with_alt_sse_and_maps_tool_choice() -> None:
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}},
    }
    request = chat(stream=True, tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    sent = gemini.chat_request(GEMINI, request, "gemini-2.5-flash")
    assert sent.url == "http://g/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
    assert body(sent)["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}
    }


def test_gemini_tool_result_for_an_unknown_call_is_400() -> None:
    request = chat(messages=[{"role": "tool", "tool_call_id": "nope", "content": "x"}])
    with pytest.raises(InvalidRequest) as caught:
        gemini.chat_request(GEMINI, request, "m")
    assert caught.value.param == "messages[0].tool_call_id"


IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def _two_screenshots() -> ChatRequest:
    """One assistant turn calling two tools whose results hold images, then the user's words."""
    calls = [{"id": name, "type": "function", "function": {"name": name, "arguments": "{}"}} for name in "ab"]
    return chat(
        messages=[
            {"role": "user", "content": "look"},
            {"role": "assistant", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "A"}, IMAGE_PART]},
            {"role": "tool", "tool_call_id": "b", "content": [IMAGE_PART]},
            {"role": "user", "content": "and now?"},
        ]
    )


def test_tool_result_images_go_to_openai_after_every_tool_result_of_the_turn() -> None:
    """A tool message takes text only; each tool result still answers its call before any user
    message (OpenAI refuses a tool message that does not follow its assistant turn's)."""
    sent = body(openai.chat_request(OPENAI, _two_screenshots(), "gpt-x"))["messages"]
    assert sent[2:] == [
        {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "A"}]},
        {"role": "tool", "tool_call_id": "b", "content": ""},
        {"role": "user", "content": [IMAGE_PART, IMAGE_PART, {"type": "text", "text": "and now?"}]},
    ]


def test_a_tool_result_of_text_alone_after_one_with_an_image_still_follows_the_turn() -> None:
    """The turn's second result is plain text: the first result's image waits after it too. Put
    before it, the user message broke the turn's results apart, which OpenAI refuses ("tool messages
    must respond to tool_calls")."""
    request = _two_screenshots()
    request.messages[3] = msgspec.structs.replace(request.messages[3], content="B")
    sent = body(openai.chat_request(OPENAI, request, "gpt-x"))["messages"]
    assert [message["role"] for message in sent] == ["user", "assistant", "tool", "tool", "user"]
    assert sent[4]["content"] == [IMAGE_PART, {"type": "text", "text": "and now?"}]


def test_tool_result_images_go_to_gemini_2_after_every_function_response_of_the_turn() -> None:
    sent = body(gemini.chat_request(GEMINI, _two_screenshots(), "gemini-2.5-flash"))["contents"]
    image = {"inlineData": {"mimeType": "image/png", "data": "AAAA"}}
    assert sent[2] == {
        "role": "user",
        "parts": [
            {"functionResponse": {"name": "a", "response": {"result": "A"}}},
            {"functionResponse": {"name": "b", "response": {}}},
            image,
            image,
            {"text": "and now?"},
        ],
    }


def test_gemini_refusing_the_gateways_key_is_its_auth_failure_not_the_requests_400() -> None:
    """Google's 400 for a wrong or expired key (as it sends it: reason API_KEY_INVALID in an ErrorInfo
    among `details`) is the gateway's credentials refused; any other 400 INVALID_ARGUMENT stays the
    request's."""
    expired = "API key expired. Please renew the API key."
    details = [
        {
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "API_KEY_INVALID",
            "domain": "googleapis.com",
        },
        {"@type": "type.googleapis.com/google.rpc.LocalizedMessage", "locale": "en-US", "message": expired},
    ]
    refused = {"error": {"code": 400, "message": expired, "status": "INVALID_ARGUMENT", "details": details}}
    error = gemini.error(400, json.dumps(refused).encode(), {})
    assert (error.status, error.code) == (502, "upstream_auth_failed")
    invalid = {
        "error": {
            "code": 400,
            "message": "Invalid value at 'generation_config'",
            "status": "INVALID_ARGUMENT",
        }
    }
    assert gemini.error(400, json.dumps(invalid).encode(), {}).status == 400


def feed(decoder: object, events: list[tuple[str | None, dict | str]]) -> list[ChatChunk]:
    chunks: list[ChatChunk] = []
    for name, data in events:
        chunks += decoder.feed(name, data if isinstance(data, str) else json.dumps(data))  # type: ignore[attr-defined]
    return chunks + decoder.close()  # type: ignore[attr-defined]


def test_anthropic_stream_decoder_turns_events_into_chunks() -> None:
    events: list[tuple[str | None, dict | str]] = [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_1",
                    "model": "claude",
                    "usage": {"input_tokens": 9, "cache_read_input_tokens": 100, "output_tokens": 1},
                },
            },
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '{"x": '},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": "1}"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 12}},
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    chunks = feed(anthropic.ChatStream(chat(), "claude"), events)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == "Hi"
    assert deltas[2].tool_calls[0].id == "toolu_1" and deltas[2].tool_calls[0].function.name == "f"  # type: ignore[index, union-attr]
    assert "".join(d.tool_calls[0].function.arguments for d in deltas[3:5]) == '{"x": 1}'  # type: ignore[index, union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage == Usage(input_tokens=9, cached_input_tokens=100, output_tokens=12)
    # message_start's count rides on the first chunk, for an Anthropic client's message_start only:
    # billed from the final report alone, and never shown to an OpenAI client.
    assert chunks[0].prompt_usage == Usage(input_tokens=9, cached_input_tokens=100)
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert "prompt_usage" not in render_chunk(chunks[0]).decode()


def test_anthropic_stream_without_message_stop_is_a_bad_gateway() -> None:
    decoder = anthropic.ChatStream(chat(), "claude")
    decoder.feed("message_start", json.dumps({"type": "message_start", "message": {"id": "m", "usage": {}}}))
    with pytest.raises(BadGateway):
        decoder.close()


def test_anthropic_overloaded_error_event_is_503() -> None:
    decoder = anthropic.ChatStream(chat(), "claude")
    with pytest.raises(Exception) as caught:
        decoder.feed(
            "error",
            json.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        )
    assert getattr(caught.value, "status", None) == 503


def test_gemini_stream_decoder_numbers_tool_calls_and_reports_usage_at_the_end() -> None:
    part = {"functionCall": {"name": "f", "args": {"x": 1}}}
    events: list[tuple[str | None, dict | str]] = [
        (
            None,
            {
                "candidates": [{"content": {"role": "model", "parts": [{"text": "ok "}]}}],
                "usageMetadata": {"promptTokenCount": 4},
            },
        ),
        (
            None,
            {
                "candidates": [{"content": {"role": "model", "parts": [part, part]}, "finishReason": "STOP"}],
                "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 6},
            },
        ),
    ]
    chunks = feed(gemini.ChatStream(chat(), "gemini"), events)
    calls = chunks[1].choices[0].delta.tool_calls or []
    assert [c.index for c in calls] == [0, 1] and calls[0].function.arguments == '{"x":1}'  # type: ignore[union-attr]
    assert chunks[1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage == Usage(input_tokens=4, output_tokens=6)


def test_gemini_stream_decoder_keeps_one_call_across_events_without_parallel_calls() -> None:
    """`parallel_tool_calls: false`, which Gemini cannot be told: its later calls, in the same event or
    a later one, are left out."""
    part = {"functionCall": {"name": "f", "args": {"x": 1}}}
    events: list[tuple[str | None, dict | str]] = [
        (None, {"candidates": [{"content": {"role": "model", "parts": [part, part]}}]}),
        (None, {"candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP"}]}),
    ]
    chunks = feed(gemini.ChatStream(chat(parallel_tool_calls=False), "gemini"), events)
    calls = [call for c in chunks for choice in c.choices for call in choice.delta.tool_calls or ()]
    assert [call.index for call in calls] == [0]
    assert [choice.finish_reason for c in chunks for choice in c.choices][-1] == "tool_calls"


# Gemini's logprobsResult as generateContent sends it: a chosen token need not be among the step's top
# candidates, and a log-probability of 0 (a certain token) is left out, as proto3 JSON leaves zeros out.
LOGPROBS_RESULT = {
    "chosenCandidates": [
        {"token": "Hi", "tokenId": 7, "logProbability": -0.5},
        {"token": "é", "tokenId": 9},
    ],
    "topCandidates": [
        {"candidates": [{"token": "Hello", "tokenId": 5, "logProbability": -0.2}]},
        {"candidates": [{"token": "é", "tokenId": 9}]},
    ],
    "logProbabilitySum": -0.5,
}
LOGPROBS_CONTENT = [
    {
        "token": "Hi",
        "logprob": -0.5,
        "bytes": [72, 105],
        "top_logprobs": [{"token": "Hello", "logprob": -0.2, "bytes": list(b"Hello")}],
    },
    {
        "token": "é",
        "logprob": 0.0,
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [{"token": "é", "logprob": 0.0, "bytes": [0xC3, 0xA9]}],
    },
]


@pytest.mark.parametrize(
    ("fields", "config"),
    [
        ({"logprobs": True, "top_logprobs": 3}, {"responseLogprobs": True, "logprobs": 3}),
        ({"logprobs": True, "top_logprobs": 0}, {"responseLogprobs": True}),
        ({"logprobs": True}, {"responseLogprobs": True}),
        ({"logprobs": False, "top_logprobs": 3}, {}),  # top_logprobs alone asks for nothing
    ],
)
def test_gemini_is_asked_for_logprobs_in_its_generation_config(fields: dict, config: dict) -> None:
    sent = body(gemini.chat_request(GEMINI, chat(**fields), "gemini-2.5-flash")).get("generationConfig", {})
    assert {k: v for k, v in sent.items() if k in ("responseLogprobs", "logprobs")} == config


def test_gemini_logprobs_result_becomes_openais_choice_logprobs() -> None:
    candidate = {
        "content": {"role": "model", "parts": [{"text": "Hié"}]},
        "finishReason": "STOP",
        "logprobsResult": LOGPROBS_RESULT,
        "avgLogprobs": -0.25,
    }
    response = gemini.chat_response(json.dumps({"candidates": [candidate]}).encode(), "gemini")
    assert response.choices[0].logprobs == {"content": LOGPROBS_CONTENT, "refusal": None}
    without = {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hi"}]}}]}
    assert gemini.chat_response(json.dumps(without).encode(), "gemini").choices[0].logprobs is None
    rendered = render_chat(response)["choices"][0]
    assert rendered["logprobs"]["content"][0]["top_logprobs"][0]["token"] == "Hello"


def test_gemini_stream_decoder_gives_each_chunk_its_own_logprobs() -> None:
    events: list[tuple[str | None, dict | str]] = [
        (
            None,
            {"candidates": [{"content": {"parts": [{"text": "Hié"}]}, "logprobsResult": LOGPROBS_RESULT}]},
        ),
        (
            None,
            {
                "candidates": [
                    {"content": {"parts": [{"text": ""}]}, "finishReason": "STOP", "logprobsResult": {}}
                ],
                "usageMetadata": {"promptTokenCount": 2, "candidatesTokenCount": 2},
            },
        ),
    ]
    chunks = feed(gemini.ChatStream(chat(logprobs=True), "gemini"), events)
    assert chunks[0].choices[0].logprobs == {"content": LOGPROBS_CONTENT, "refusal": None}
    assert chunks[1].choices[0].finish_reason == "stop" and chunks[1].choices[0].logprobs is None


def test_logprobs_for_claude_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(InvalidRequest) as caught:
        anthropic.chat_request(ANTHROPIC, chat(logprobs=True, top_logprobs=2), "claude-sonnet-4-5")
    assert caught.value.param == "logprobs" and caught.value.code == "unsupported_parameter"
    plain = body(anthropic.chat_request(ANTHROPIC, chat(logprobs=False), "claude-sonnet-4-5"))
    assert "logprobs" not in plain


def test_openai_stream_ending_without_done_or_finish_is_a_bad_gateway() -> None:
    decoder = openai.ChatStream(chat(), "gpt")
    decoder.feed(None, json.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "partial"}}]}))
    with pytest.raises(BadGateway):
        decoder.close()


ROLE = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}
FINISHED = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
START = ("message_start", {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 3}}})
EMPTY_BLOCK = [
    (
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
]
END_TURN = ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {}})
STOP = ("message_stop", {"type": "message_stop"})
DONE = (None, "[DONE]")

DECODERS = {
    "openai": lambda: openai.ChatStream(chat(), "gpt"),
    "completions": lambda: openai.CompletionStream("gpt"),
    "anthropic": lambda: anthropic.ChatStream(chat(), "claude"),
    "gemini": lambda: gemini.ChatStream(chat(), "gemini"),
    "gemini-stop-sequences": lambda: gemini.ChatStream(chat(stop=["x"]), "gemini"),
}
GEMINI_STOP_WITHOUT_PARTS: list[tuple[str | None, dict | str]] = [
    (None, {"candidates": [{"content": {"role": "model", "parts": []}, "finishReason": "STOP"}]})
]
# Streams that end cleanly with none of an answer and no finish reason, or (Gemini) a STOP before any
# of the answer where the request could not end empty: the backend's failure.
NO_ANSWER: dict[str, tuple[str, list[tuple[str | None, dict | str]]]] = {
    "openai-done-only": ("openai", [DONE]),
    "openai-role-then-done": ("openai", [(None, ROLE), DONE]),
    "openai-role-usage-done": ("openai", [(None, ROLE), (None, USAGE), DONE]),
    "openai-completions-done-only": ("completions", [DONE]),
    "anthropic-start-then-stop": ("anthropic", [START, STOP]),
    "gemini-stop-without-parts": ("gemini", GEMINI_STOP_WITHOUT_PARTS),
}
# Empty answers the model gave: a finish reason (or, for Anthropic, a content block) says so. (Gemini's
# decoder takes no stream without a finishReason for complete, nor an empty STOP unless a stop
# sequence may have ended the answer at once.)
EMPTY_ANSWER: dict[str, tuple[str, list[tuple[str | None, dict | str]]]] = {
    "openai-finish-length": ("openai", [(None, ROLE), (None, FINISHED), DONE]),
    "openai-finish-without-done": ("openai", [(None, FINISHED)]),
    "anthropic-empty-text-end-turn": ("anthropic", [START, *EMPTY_BLOCK, END_TURN, STOP]),
    "anthropic-no-block-end-turn": ("anthropic", [START, END_TURN, STOP]),
    "anthropic-empty-text-block": ("anthropic", [START, *EMPTY_BLOCK, STOP]),
    "gemini-stop-without-parts-beside-stop-sequences": ("gemini-stop-sequences", GEMINI_STOP_WITHOUT_PARTS),
}


@pytest.mark.parametrize("case", list(NO_ANSWER))
def test_a_stream_that_ends_without_an_answer_is_a_bad_gateway(case: str) -> None:
    vendor, events = NO_ANSWER[case]
    with pytest.raises(BadGateway, match="without an answer"):
        feed(DECODERS[vendor](), events)


@pytest.mark.parametrize("case", list(EMPTY_ANSWER))
def test_an_empty_answer_the_model_gave_ends_the_stream_cleanly(case: str) -> None:
    vendor, events = EMPTY_ANSWER[case]
    chunks = feed(DECODERS[vendor](), events)  # no BadGateway
    assert chunks and not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_anthropic_inbound_request_to_canonical() -> None:
    request = msgspec.convert(
        {
            "model": "m",
            "max_tokens": 10,
            "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "checking"},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "x"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "rain", "is_error": True},
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
            "tool_choice": {"type": "tool", "name": "w"},
            "top_k": 5,
        },
        MessagesRequest,
    )
    canonical = to_canonical(request)
    assert [m.role for m in canonical.messages] == ["system", "user", "assistant", "tool", "user"]
    assert canonical.messages[0].content[0].cache_control == {"type": "ephemeral"}  # type: ignore[index, union-attr]
    assert canonical.messages[2].tool_calls[0].function.arguments == '{"c":"x"}'  # type: ignore[index]
    assert canonical.messages[3].content == "rain" and canonical.messages[3].tool_call_id == "t1"
    assert canonical.messages[3].is_error
    assert canonical.tool_choice.function.name == "w"  # type: ignore[union-attr]
    assert canonical.top_k == 5 and canonical.extra == {} and canonical.max_tokens == 10


def test_anthropic_tool_error_with_content_blocks_still_says_error() -> None:
    """`is_error` with a list of blocks was dropped: the next model read a failed tool's output as
    its answer. OpenAI, which has no flag, is told in words before the blocks; Claude the flag beside
    the client's blocks as they were."""
    request = msgspec.convert(
        {
            "model": "m",
            "max_tokens": 10,
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "station offline"}],
                            "is_error": True,
                        }
                    ],
                },
            ],
        },
        MessagesRequest,
    )
    canonical = to_canonical(request)
    sent = body(openai.chat_request(OPENAI, canonical, "gpt-x"))["messages"][-1]
    assert sent["role"] == "tool" and sent["tool_call_id"] == "t1" and "is_error" not in sent
    assert [p["text"] for p in sent["content"]] == ["Error:", "station offline"]
    (result,) = body(anthropic.chat_request(ANTHROPIC, canonical, "claude"))["messages"][-1]["content"]
    assert result["is_error"] is True
    assert result["content"] == [{"type": "text", "text": "station offline"}]


async def test_anthropic_inbound_stream_events_for_text_then_tool() -> None:
    def chunk(delta: Delta, finish: str | None = None) -> ChatChunk:
        return ChatChunk(
            id="c", created=0, model="m", choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)]
        )

    async def chunks():  # type: ignore[no-untyped-def]
        yield chunk(Delta(role="assistant", content=""))
        yield chunk(Delta(content="Let me check"))
        yield chunk(
            Delta(
                tool_calls=[
                    ToolCallDelta(
                        index=0,
                        id="call_1",
                        type="function",
                        function=FunctionCallDelta(name="w", arguments=""),
                    )
                ]
            )
        )
        yield chunk(
            Delta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"c": 1}'))])
        )
        yield chunk(Delta(), "tool_calls")
        yield ChatChunk(
            id="c",
            created=0,
            model="m",
            choices=[],
            usage=Usage(input_tokens=5, cached_input_tokens=2, output_tokens=7),
        )

    async def batches():  # type: ignore[no-untyped-def]
        async for item in chunks():
            yield [item]

    written = b"".join([piece async for piece in stream_events(batches(), "m")])
    events = [json.loads(frame.split(b"\ndata: ", 1)[1]) for frame in written.strip().split(b"\n\n")]
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[5]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "w", "input": {}}
    assert events[6]["delta"] == {"type": "input_json_delta", "partial_json": '{"c": 1}'}
    assert events[8]["delta"]["stop_reason"] == "tool_use"
    assert events[8]["usage"]["cache_read_input_tokens"] == 2 and events[8]["usage"]["output_tokens"] == 7


def test_anthropic_inbound_response_from_canonical() -> None:
    response = openai.chat_response(
        json.dumps(
            {
                "id": "chatcmpl-1",
                "created": 1,
                "model": "gpt",
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {"name": "w", "arguments": '{"c": 1}'},
                                }
                            ],
                        },
                        "finish_reason": "tool_calls",
                    }
                ],
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 4},
                },
            }
        ).encode(),
        "gpt",
    )
    message = from_canonical(response, "public")
    assert message["content"] == [{"type": "tool_use", "id": "call_1", "name": "w", "input": {"c": 1}}]
    assert message["stop_reason"] == "tool_use" and message["model"] == "public"
    assert message["usage"]["input_tokens"] == 6 and message["usage"]["cache_read_input_tokens"] == 4


def test_openai_reply_fields_weir_does_not_model_go_back_to_openai_clients_only() -> None:
    """What an OpenAI-compatible server adds to its completion and message (OpenAI's `audio` and
    `service_tier`, a server's own) is kept for OpenAI clients, as are its `annotations` (modelled,
    for Responses clients); Anthropic clients' messages have no place for them."""
    message = {"role": "assistant", "content": "Hi", "annotations": [], "audio": {"id": "a1"}, "x_vendor": 1}
    reply = {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop", "stop_reason": None}],
        "service_tier": "default",
        "prompt_logprobs": None,
    }
    response = openai.chat_response(json.dumps(reply).encode(), "m")
    assert response.extra == {"service_tier": "default", "prompt_logprobs": None}
    assert response.choices[0].message.extra == {"audio": {"id": "a1"}, "x_vendor": 1}
    assert response.choices[0].message.annotations == []
    rendered = render_chat(response)
    assert rendered["service_tier"] == "default" and rendered["object"] == "chat.completion"
    assert rendered["choices"][0]["message"] == message
    assert "extra" not in rendered and "extra" not in rendered["choices"][0]["message"]
    anthropic_message = from_canonical(response, "m")
    assert anthropic_message["content"] == [{"type": "text", "text": "Hi"}]
    assert not {"service_tier", "extra", "audio"} & anthropic_message.keys()


def test_anthropic_beta_flags_join_the_backends_own_each_once() -> None:
    """Several `anthropic-beta` headers read as one list; a backend's configured betas (its `headers`,
    in any case) are kept beside the client's, in one header."""
    beta = beta_flags(["context-1m-2025-08-07, interleaved-thinking-2025-05-14", "context-1m-2025-08-07"])
    assert beta == ["context-1m-2025-08-07", "interleaved-thinking-2025-05-14"]
    assert beta_flags([]) is None
    configured = msgspec.structs.replace(
        ANTHROPIC, headers={"Anthropic-Beta": "files-api-2025-04-14,context-1m-2025-08-07"}
    )
    for request in (
        anthropic.chat_request(configured, chat(anthropic_beta=beta), "claude"),
        anthropic.count_tokens_request(configured, chat(anthropic_beta=beta), "claude"),
    ):
        assert [name for name in request.headers if name.lower() == "anthropic-beta"] == ["anthropic-beta"]
        assert request.headers["anthropic-beta"] == (
            "files-api-2025-04-14,context-1m-2025-08-07,interleaved-thinking-2025-05-14"
        )
    alone = anthropic.chat_request(configured, chat(), "claude")
    assert alone.headers["Anthropic-Beta"] == "files-api-2025-04-14,context-1m-2025-08-07"
    assert "anthropic-beta" not in anthropic.chat_request(ANTHROPIC, chat(), "claude").headers
    assert "anthropic_beta" not in body(openai.chat_request(OPENAI, chat(anthropic_beta=beta), "gpt-x"))


def test_tool_choice_without_tools_is_not_sent_to_anthropic_or_gemini() -> None:
    request = chat(tool_choice="none", parallel_tool_calls=False)
    assert "tool_choice" not in body(anthropic.chat_request(ANTHROPIC, request, "claude"))
    assert "toolConfig" not in body(gemini.chat_request(GEMINI, request, "gemini"))


# --- continuing an unfinished answer --------------------------------------------------------------

PARTIAL = [{"role": "user", "content": "count to four"}, {"role": "assistant", "content": "one two"}]


def test_an_unfinished_answer_is_continued_the_way_each_vendor_can() -> None:
    """`continue_final_message` (a resumed stream, an Anthropic prefill): Claude up to 4.5 continues a
    trailing assistant message; Claude 4.6 on refuses one and OpenAI answers it afresh, so they get a
    user turn asking for the rest; vLLM and the engine take the flag itself."""
    request = chat(messages=PARTIAL, continue_final_message=True)
    instruction = {"role": "user", "content": CONTINUE_INSTRUCTION}

    sent = body(openai.chat_request(OPENAI, request, "gpt-4o"))
    assert sent["messages"][-2:] == [PARTIAL[1], instruction] and "continue_final_message" not in sent
    engine = Backend(name="e", type="engine", url="http://e")
    vllm = Backend(name="v", type="openai", base_url="http://v/v1", continuation="continue_final_message")
    for backend in (engine, vllm):
        sent = body(openai.chat_request(backend, request, "m"))
        assert sent["messages"][-1] == PARTIAL[1]
        assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (True, False)

    old = body(anthropic.chat_request(ANTHROPIC, request, "claude-sonnet-4-5"))
    assert old["messages"][-1] == {"role": "assistant", "content": [{"type": "text", "text": "one two"}]}
    for model in ("claude-opus-4-6", "claude-opus-4-7", "claude-sonnet-5"):
        new = body(anthropic.chat_request(ANTHROPIC, request, model))
        assert new["messages"][-1] == {
            "role": "user",
            "content": [{"type": "text", "text": CONTINUE_INSTRUCTION}],
        }

    contents = body(gemini.chat_request(GEMINI, request, "gemini-2.5-flash"))["contents"]
    assert contents[-1] == {"role": "model", "parts": [{"text": "one two"}]}
    for model in ("gemini-3.5-flash-lite", "gemini-3.6-flash"):  # they refuse a trailing model turn
        contents = body(gemini.chat_request(GEMINI, request, model))["contents"]
        assert (contents[-2]["role"], contents[-1]["parts"][0]["text"]) == ("model", CONTINUE_INSTRUCTION)
    # Without the flag a trailing assistant message goes as it is, everywhere.
    assert body(openai.chat_request(OPENAI, chat(messages=PARTIAL), "gpt-4o"))["messages"][-1] == PARTIAL[1]


def test_an_anthropic_prefill_is_an_answer_to_continue_on_any_vendor() -> None:
    def canonical(messages: list[dict[str, str]]) -> ChatRequest:
        request = msgspec.convert({"model": "m", "max_tokens": 10, "messages": messages}, MessagesRequest)
        return to_canonical(request)

    assert canonical(PARTIAL).continue_final_message is True
    assert canonical(PARTIAL[:1]).continue_final_message is None


def test_continue_final_message_needs_an_answer_to_continue() -> None:
    with pytest.raises(msgspec.ValidationError, match="continue_final_message"):
        chat(continue_final_message=True)  # the conversation ends with the user's turn
    with pytest.raises(ConfigError, match="continuation"):
        parse_config(
            "backends: [{name: a, type: anthropic, base_url: 'http://a', continuation: continue_final_message}]\n"
            "models: []\n"
        )
