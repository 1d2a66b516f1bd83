"""What admission reserves for a request: its prompt from its body's size and a chat template's
allowance, each part sent inline (an image, a file, audio as base64) or by URL as one allowance,
whatever vendor's form the body takes; its output, its cap for every choice it asks for; its web
searches, each Anthropic web search tool's `max_uses`. The prompt's estimate is also what an attempt
cut before its usage report is billed (tests/routing/test_stream_failover.py,
test_cancelled_answer_billing.py) and the prompt's length to routing (`input_tokens`)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from engine.tokenizer import Tokenizer
from gateway.estimate import (
    BYTES_PER_TOKEN,
    CHAT_TOKENS,
    DEFAULT_OUTPUT_ESTIMATE,
    DEFAULT_WEB_SEARCH_ESTIMATE,
    INLINE_PART_TOKENS,
    MESSAGE_TOKENS,
    input_tokens,
    output_estimate,
    prompt_tokens,
    web_search_estimate,
)
from gateway.types import ChatRequest


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"model": "m", "max_tokens": 100}, 100),
        ({"model": "m", "max_completion_tokens": 80, "max_tokens": 100}, 80),
        ({"model": "m", "max_tokens": 100, "n": 4}, 400),  # OpenAI: every choice is billed
        ({"model": "m", "n": 3}, 3 * DEFAULT_OUTPUT_ESTIMATE),
        ({"generationConfig": {"maxOutputTokens": 50, "candidateCount": 2}}, 100),  # Gemini
        ({"model": "m", "max_tokens": 64, "messages": []}, 64),  # Anthropic
        ({"model": "m"}, DEFAULT_OUTPUT_ESTIMATE),
        ({"model": "m", "max_tokens": 10, "n": 0}, 10),
        # A legacy completion: `best_of` candidates generated (and billed) to return the best `n`,
        # and `n` (or `best_of`) for each prompt of a list.
        ({"model": "m", "prompt": "p", "max_tokens": 10, "n": 2, "best_of": 5}, 50),
        ({"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 10, "n": 2}, 60),
        ({"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 10, "best_of": 3}, 60),
        ({"model": "m", "prompt": [1, 2, 3], "max_tokens": 10, "n": 2}, 20),  # one prompt of token ids
        ({"model": "m", "prompt": {"id": "pmpt_1"}, "max_output_tokens": 10}, 10),  # a Responses prompt
    ],
)
def test_the_output_reserved_covers_every_choice(body: dict, tokens: int) -> None:
    assert output_estimate(msgspec.json.encode(body)) == tokens


SEARCH = {"type": "web_search_20250305", "name": "web_search"}
SEARCHED = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}


@pytest.mark.parametrize(
    ("tools", "searches"),
    [
        ([{**SEARCH, "max_uses": 8}], 8),  # Claude Code's WebSearch
        ([SEARCH], DEFAULT_WEB_SEARCH_ESTIMATE),  # no cap of the tool's own
        ([{**SEARCH, "type": "web_search_20260209", "max_uses": 50}], 50),  # a later version
        ([{"name": "get_weather", "input_schema": {}}, {**SEARCH, "max_uses": 3}], 3),
        ([{"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 5}], 0),  # no fee per use
        ([{"type": "web_search"}, {"type": "web_search_preview"}, {"type": "web_search_2025_08_26"}], 0),
        ([], 0),
    ],
)
def test_the_web_searches_reserved_are_the_tools_max_uses(tools: list[dict], searches: int) -> None:
    """Anthropic's web search tools (`web_search_` and a date) count their `max_uses`; OpenAI's
    built-in `web_search` tools, billed on no count Weir reads, and every other tool count none."""
    body = {"model": "m", "max_tokens": 10, "tools": tools, "messages": [{"role": "user", "content": "x"}]}
    assert web_search_estimate(msgspec.json.encode(body)) == searches


def test_a_past_search_without_the_tool_reserves_none() -> None:
    """A conversation that searched before, its `web_search_tool_result` sent back, can search no more
    without the tool; an unreadable body reserves none (its vendor refuses it, billing nothing)."""
    turns = [{"role": "assistant", "content": [SEARCHED]}, {"role": "user", "content": "thanks"}]
    assert web_search_estimate(msgspec.json.encode({"model": "m", "messages": turns})) == 0
    assert web_search_estimate(b'{"tools": [{"type": "web_search_20250305"') == 0


def test_an_unreadable_body_reserves_the_default() -> None:
    assert output_estimate(b"not json") == DEFAULT_OUTPUT_ESTIMATE
    assert output_estimate(b'{"max_tokens": "lots"}') == DEFAULT_OUTPUT_ESTIMATE


# --- the prompt -------------------------------------------------------------------------------------

B64 = base64.b64encode(bytes(60_000)).decode()  # 80 kB of base64: 20,000 tokens at 4 bytes each
DATA_URL = f"data:image/png;base64,{B64}"
TEXT = "what is in this picture?"
URL = "https://example.com/photos/a-cat-on-a-mat.png"


def tokens(size: int) -> int:
    return -(-size // BYTES_PER_TOKEN)


def template(messages: int) -> int:
    """The chat template's allowance for a chat of `messages` messages (none without messages)."""
    return CHAT_TOKENS + MESSAGE_TOKENS * messages if messages else 0


ONE_TURN = template(1)  # every body below with a part is a chat of one user turn


@pytest.mark.parametrize(
    ("body", "messages"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": TEXT}]}, 1),
        ({"model": "m", "messages": [{"role": "user", "content": "decode this base64: aGVsbG8="}]}, 1),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]}, 1),
        # A data URL or a URL written as text is text; a tool's input named `data` or `url` is no part.
        ({"model": "m", "messages": [{"role": "user", "content": DATA_URL}]}, 1),
        ({"model": "m", "messages": [{"role": "user", "content": f"what is at {URL}?"}]}, 1),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {"data": B64}}]}]}, 1),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {"url": URL}}]}]}, 1),
        ({"model": "m", "messages": [], "max_tokens": 100}, 0),
        ({}, 0),
    ],
)
def test_a_prompt_with_nothing_inline_is_its_size_at_4_bytes_a_token_and_its_template(
    body: dict, messages: int
) -> None:
    encoded = msgspec.json.encode(body)
    assert prompt_tokens(encoded) == tokens(len(encoded)) + template(messages)


def test_an_unreadable_body_is_its_size() -> None:
    for body in (b"", b"not json", b'{"input_audio": {"data": "AAAA"'):
        assert prompt_tokens(body) == tokens(len(body))


def _chat(part: dict) -> dict:
    """An OpenAI or Anthropic body whose user turn is a text and `part`."""
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}, part]}]}


def _gemini(part: dict) -> dict:
    return {"contents": [{"role": "user", "parts": [{"text": TEXT}, part]}]}


def _responses(part: dict) -> dict:
    return {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": TEXT}, part]}],
    }


ANTHROPIC_SOURCE = {"type": "base64", "media_type": "image/png", "data": B64}


@pytest.mark.parametrize(
    ("body", "payload"),
    [
        (_chat({"type": "image_url", "image_url": {"url": DATA_URL, "detail": "high"}}), DATA_URL),
        (_chat({"type": "file", "file": {"filename": "a.pdf", "file_data": DATA_URL}}), DATA_URL),
        (_chat({"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}), B64),
        (_chat({"type": "image", "source": ANTHROPIC_SOURCE}), B64),
        (_chat({"type": "document", "source": {**ANTHROPIC_SOURCE, "media_type": "application/pdf"}}), B64),
        (_gemini({"inlineData": {"mimeType": "image/png", "data": B64}}), B64),
        (_gemini({"inline_data": {"mime_type": "image/png", "data": B64}}), B64),
        (_responses({"type": "input_image", "image_url": DATA_URL}), DATA_URL),
        (_responses({"type": "input_file", "filename": "a.pdf", "file_data": DATA_URL}), DATA_URL),
    ],
    ids=[
        "openai-image",
        "openai-file",
        "openai-audio",
        "anthropic-image",
        "anthropic-document",
        "gemini",
        "gemini-snake-case",
        "responses-image",
        "responses-file",
    ],
)
def test_a_part_sent_inline_counts_one_allowance_not_its_base64(body: dict, payload: str) -> None:
    encoded = msgspec.json.encode(body)
    assert prompt_tokens(encoded) == tokens(len(encoded) - len(payload)) + INLINE_PART_TOKENS + ONE_TURN


@pytest.mark.parametrize(
    "body",
    [
        _chat({"type": "image_url", "image_url": {"url": URL, "detail": "high"}}),
        _chat({"type": "image", "source": {"type": "url", "url": URL}}),
        _chat({"type": "document", "source": {"type": "url", "url": URL}}),
        _gemini({"fileData": {"mimeType": "image/png", "fileUri": URL}}),
        _gemini({"file_data": {"mime_type": "image/png", "file_uri": URL}}),
        _responses({"type": "input_image", "image_url": URL}),
    ],
    ids=[
        "openai-image",
        "anthropic-image",
        "anthropic-document",
        "gemini",
        "gemini-snake-case",
        "responses-image",
    ],
)
def test_a_part_sent_by_url_counts_one_allowance_as_one_sent_inline(body: dict) -> None:
    """Its vendor fetches it and bills it as the same part sent inline: not its URL's 12 tokens."""
    encoded = msgspec.json.encode(body)
    assert prompt_tokens(encoded) == tokens(len(encoded) - len(URL)) + INLINE_PART_TOKENS + ONE_TURN


def test_every_part_counts_and_a_small_one_only_its_size() -> None:
    small = "data:image/png;base64," + base64.b64encode(bytes(300)).decode()  # 422 bytes: 106 tokens
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in (DATA_URL, small, DATA_URL, URL)]
    body = msgspec.json.encode({"messages": [{"role": "user", "content": parts}]})
    rest = len(body) - 2 * len(DATA_URL) - len(small) - len(URL)
    assert prompt_tokens(body) == tokens(rest) + 3 * INLINE_PART_TOKENS + tokens(len(small)) + ONE_TURN


@pytest.mark.parametrize("url", [DATA_URL, URL], ids=["inline", "by-url"])
def test_count_tokens_estimates_an_image_as_an_image(url: str) -> None:
    request = msgspec.convert(_chat({"type": "image_url", "image_url": {"url": url}}), ChatRequest)
    assert INLINE_PART_TOKENS + ONE_TURN < input_tokens(request) < INLINE_PART_TOKENS + ONE_TURN + 50


FILE_ID = "file-6F2ksmvXxt4VdoqmHRw6kL"


@pytest.mark.parametrize(
    "body",
    [
        _chat({"type": "file", "file": {"file_id": FILE_ID}}),
        _chat({"type": "document", "source": {"type": "file", "file_id": FILE_ID}}),
        _chat({"type": "image", "source": {"type": "file", "file_id": FILE_ID}}),
        _responses({"type": "input_file", "file_id": FILE_ID}),
        _responses({"type": "input_image", "file_id": FILE_ID, "detail": "auto"}),
    ],
    ids=["openai-file", "anthropic-document", "anthropic-image", "responses-file", "responses-image"],
)
def test_a_part_sent_by_file_id_counts_one_allowance_as_one_sent_inline(body: dict) -> None:
    """Its vendor reads the uploaded file and bills it as the same part sent inline: not its id's 7
    tokens, which is all the body's size said of it."""
    encoded = msgspec.json.encode(body)
    assert prompt_tokens(encoded) == tokens(len(encoded) - len(FILE_ID)) + INLINE_PART_TOKENS + ONE_TURN


def test_count_tokens_estimates_a_file_sent_by_id_as_a_part() -> None:
    request = msgspec.convert(_chat({"type": "file", "file": {"file_id": FILE_ID}}), ChatRequest)
    assert INLINE_PART_TOKENS + ONE_TURN < input_tokens(request) < INLINE_PART_TOKENS + ONE_TURN + 50


# --- the chat template ------------------------------------------------------------------------------


def _turns(count: int) -> list[dict[str, str]]:
    """A conversation of `count` short turns, user and assistant in turn."""
    return [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}: ok"} for i in range(count)]


@pytest.mark.parametrize(
    "form",
    [
        lambda turns: {"model": "m", "messages": turns},  # OpenAI's and Anthropic's
        lambda turns: {"contents": [{"role": t["role"], "parts": [{"text": t["content"]}]} for t in turns]},
        lambda turns: {"model": "m", "input": turns},  # the Responses API's
    ],
    ids=["messages", "gemini", "responses"],
)
def test_each_message_adds_the_per_message_allowance_in_every_form(
    form: Callable[[list[dict[str, str]]], dict[str, Any]],
) -> None:
    """A chat is its JSON at 4 bytes a token, CHAT_TOKENS once (the reply's priming, a default system
    turn) and MESSAGE_TOKENS for each message (its role markers), whatever vendor's form it takes."""
    for count in (1, 2, 5):
        body = msgspec.json.encode(form(_turns(count)))
        assert prompt_tokens(body) == tokens(len(body)) + CHAT_TOKENS + MESSAGE_TOKENS * count


def test_a_conversation_grows_by_its_turns_and_the_per_message_allowance() -> None:
    short, long = (msgspec.convert({"model": "m", "messages": _turns(n)}, ChatRequest) for n in (1, 6))
    # Five more turns, each its JSON (`{"role":"assistant","content":"turn 1: ok",...}`) and its allowance.
    added_json = len(msgspec.json.encode(long.messages)) - len(msgspec.json.encode(short.messages))
    grown = input_tokens(long) - input_tokens(short)
    assert tokens(added_json) - 1 <= grown - 5 * MESSAGE_TOKENS <= tokens(added_json) + 1


def test_a_role_written_in_text_is_no_message_and_a_prompt_without_messages_has_no_template() -> None:
    chat = msgspec.json.encode({"messages": [{"role": "user", "content": 'what does "role": "user" mean?'}]})
    assert prompt_tokens(chat) == tokens(len(chat)) + template(1)  # the quotes are escaped in JSON
    for body in ({"model": "m", "prompt": "Once upon a time"}, {"model": "m", "input": ["a", "b"]}):
        encoded = msgspec.json.encode(body)  # a completion, embeddings: no template wraps them
        assert prompt_tokens(encoded) == tokens(len(encoded))


def test_a_key_named_role_that_holds_no_role_is_no_message() -> None:
    """A tool schema's property named `role` (an object) and a tool call's argument so named (an object
    in Anthropic's and Gemini's forms) are no message: counted as one each, a request sending a tool
    with such a property was a message's allowance high for every tool, at every turn."""
    schema = {"type": "object", "properties": {"role": {"type": "string", "enum": ["admin", "viewer"]}}}
    tools = [{"name": f"grant_{i}", "input_schema": schema} for i in range(3)]
    call = {"type": "tool_use", "id": "toolu_1", "name": "grant_0", "input": {"role": "admin"}}
    turns = [{"role": "user", "content": "Grant it."}, {"role": "assistant", "content": [call]}]
    body = msgspec.json.encode({"model": "m", "max_tokens": 10, "tools": tools, "messages": turns})
    assert prompt_tokens(body) == tokens(len(body)) + template(2)


def test_a_message_role_counts_with_whitespace_in_its_json() -> None:
    """Bodies Weir sends are compact JSON, but the count does not depend on it."""
    body = json.dumps(
        {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]}
    )
    assert prompt_tokens(body.encode()) == tokens(len(body)) + template(2)


def _tool_result_turns(result: list[dict[str, Any]]) -> ChatRequest:
    from gateway.anthropic_inbound import MessagesRequest, to_canonical

    call = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}
    body = {
        "model": "m",
        "max_tokens": 10,
        "messages": [
            {"role": "user", "content": "Read it."},
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}],
            },
        ],
    }
    return to_canonical(msgspec.convert(body, MessagesRequest))


def test_a_tool_result_kept_as_the_client_sent_it_counts_its_text_once() -> None:
    """A tool result holding a `tool_reference` is kept as the client sent it beside its parts (for
    Claude): counted as both, its text was twice its length to context-window fit and route
    conditions (4,000 bytes: about 1,000 tokens more)."""
    text = [{"type": "text", "text": "x" * 4000}]
    reference = {"type": "tool_reference", "tool_name": "grep"}
    plain, referenced = _tool_result_turns(text), _tool_result_turns([*text, reference])
    assert referenced.messages[-1].anthropic_content is not None  # the case at hand
    extra = input_tokens(referenced) - input_tokens(plain)
    # The reference and a little framing (the client's blocks' JSON, not the parts'), not the text again.
    assert tokens(len(msgspec.json.encode(reference))) <= extra < tokens(4000) // 10


def _responses_loop(*held: dict[str, Any]) -> ChatRequest:
    """A Responses client's tool loop: a call with 4,000 bytes of arguments and its result, after the
    `held` items (none, or OpenAI's encrypted reasoning, which makes the turn one sent as it came)."""
    from gateway.responses_inbound import ResponsesRequest, to_canonical

    call = {"type": "function_call", "call_id": "call_1", "name": "write", "arguments": "x" * 4000}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "done"}
    items = [{"role": "user", "content": "Write it."}, *held, call, output]
    return to_canonical(msgspec.convert({"model": "m", "input": items}, ResponsesRequest))


def test_a_responses_turn_kept_as_the_client_sent_it_counts_its_calls_once() -> None:
    """A Responses client's turn with OpenAI's encrypted reasoning keeps its input items as sent (for
    OpenAI's Responses API) beside its tool calls (for every other backend): counted as both, its
    call's arguments were twice their length to context-window fit and route conditions."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA" + "e" * 395}
    plain, sent_as_is = _responses_loop(), _responses_loop(reasoning)
    assert sent_as_is.messages[1].responses_items is not None  # the case at hand
    extra = input_tokens(sent_as_is) - input_tokens(plain)
    # The reasoning item and the items' framing (about 30 tokens), not the 4,000 bytes of arguments again.
    held = tokens(len(msgspec.json.encode(reasoning)))
    assert held <= extra < held + 50


def test_weir_signed_reasoning_counts_its_text_once() -> None:
    """A Responses client's reasoning item with a signature Weir handed out goes back as the turn's
    `reasoning_content` (for OpenAI-compatible backends) and as a signed thinking block (for Claude):
    counted as both, its text was twice its length to routing. Each backend is sent one of them."""
    text = "r" * 4000
    signed = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": "weir.thinking.signature:" + "s" * 400,
    }
    plain, reasoned = _responses_loop(), _responses_loop(signed)
    turn = reasoned.messages[1]
    assert turn.reasoning_content == text and turn.reasoning_blocks  # the case at hand
    extra = input_tokens(reasoned) - input_tokens(plain)
    # The text and the signature (1,100 tokens) and the block's framing, not the 4,000 bytes again.
    assert tokens(4400) <= extra < tokens(4400) + 30


def test_claude_thinking_sent_back_counts_its_text_once() -> None:
    """An Anthropic client's thinking block comes back as the turn's signed blocks alone (no
    `reasoning_content` beside them): its text counts once."""
    from gateway.anthropic_inbound import MessagesRequest, to_canonical

    thinking = {"type": "thinking", "thinking": "r" * 4000, "signature": "s" * 400}
    answer = {"type": "text", "text": "ok"}

    def chat(*blocks: dict[str, Any]) -> ChatRequest:
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [*blocks, answer]}]
        body = {"model": "m", "max_tokens": 10, "messages": [*turns, {"role": "user", "content": "and?"}]}
        return to_canonical(msgspec.convert(body, MessagesRequest))

    plain, reasoned = chat(), chat(thinking)
    assert reasoned.messages[1].reasoning_blocks and reasoned.messages[1].reasoning_content is None
    extra = input_tokens(reasoned) - input_tokens(plain)
    assert tokens(4400) <= extra < tokens(4400) + 30


def _anthropic_tools(*tools: dict[str, Any]) -> ChatRequest:
    from gateway.anthropic_inbound import MessagesRequest, to_canonical

    body = {"model": "m", "max_tokens": 10, "messages": _turns(1), "tools": list(tools)}
    return to_canonical(msgspec.convert(body, MessagesRequest))


def test_tools_of_anthropics_own_api_count_once() -> None:
    """Anthropic's server tools and the client tools its tool search loads (`defer_loading`) are kept
    as the client sent them (`anthropic_tools`), not as function tools: left out, a request with a
    hundred deferred tools was estimated as one with none, though Claude bills each definition."""
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "description": "x" * 300}}}
    deferred = {"name": "grep", "description": "Search files.", "input_schema": schema, "defer_loading": True}
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    plain, typed = _anthropic_tools(), _anthropic_tools(deferred, search)
    assert typed.tools is None and typed.anthropic_tools  # the case at hand: both kept as sent, alone
    definitions = tokens(len(msgspec.json.encode([deferred, search])))  # about 120 tokens
    assert definitions - 1 <= input_tokens(typed) - input_tokens(plain) <= definitions + 1


def _responses_tools(*tools: dict[str, Any]) -> ChatRequest:
    from gateway.responses_inbound import ResponsesRequest, to_canonical

    body = {"model": "m", "input": _turns(1), "tools": list(tools)}
    return to_canonical(msgspec.convert(body, ResponsesRequest))


def test_a_responses_clients_built_in_tools_count_once() -> None:
    """OpenAI's built-in tools (web search, file search, an MCP server...) are kept as the Responses
    client sent them, for OpenAI's Responses API alone, and OpenAI bills their definitions as input:
    left out, a request with them was estimated as one without. Its function and custom tools are in
    `tools` (as functions) and in what it sent: they count once."""
    search = {"type": "web_search", "search_context_size": "high", "user_location": {"type": "approximate"}}
    files = {"type": "file_search", "vector_store_ids": ["vs_" + "v" * 40], "max_num_results": 20}
    mcp = {
        "type": "mcp",
        "server_label": "docs",
        "server_url": "https://mcp.example/sse",
        "require_approval": "never",
    }
    schema = {"type": "object", "properties": {"path": {"type": "string", "description": "x" * 300}}}
    function = {"type": "function", "name": "read", "description": "Read a file.", "parameters": schema}
    patch = {"type": "custom", "name": "apply_patch", "description": "y" * 300}
    plain, own = _responses_tools(), _responses_tools(function, patch)
    built_in = _responses_tools(function, search, patch, files, mcp)
    assert built_in.tools == own.tools and built_in.responses  # the case at hand: kept as sent, alone
    canonical = tokens(len(msgspec.json.encode(own.tools)))  # function and custom: counted once
    assert canonical - 1 <= input_tokens(own) - input_tokens(plain) <= canonical + 1
    definitions = tokens(len(msgspec.json.encode([search, files, mcp])))  # about 90 tokens
    assert definitions - 1 <= input_tokens(built_in) - input_tokens(own) <= definitions + 1


def test_tool_definitions_still_count_beside_the_template() -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city, in degrees Celsius and words.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    bare = {"model": "m", "messages": _turns(1)}
    plain, with_tools = (msgspec.convert(b, ChatRequest) for b in (bare, {**bare, "tools": [weather] * 3}))
    tools_json = tokens(len(msgspec.json.encode(with_tools.tools)))  # 3 definitions, about 150 tokens
    assert tools_json - 1 <= input_tokens(with_tools) - input_tokens(plain) <= tools_json + 1


SHORT_CHATS = {
    "question": [{"role": "user", "content": "What is the capital of France?"}],
    "greeting": [{"role": "user", "content": "hi"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "conversation": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
    "long": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 40}],
}


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    """The bundled SmolLM2's tokenizer and chat template (from its GGUF's metadata: no weights)."""
    from engine import registry
    from engine.weights import gguf_metadata, open_gguf

    return Tokenizer.from_gguf_metadata(gguf_metadata(open_gguf(registry.pull("smollm2-135m", quiet=True))))


@pytest.mark.slow
@pytest.mark.parametrize("name", SHORT_CHATS)
def test_a_chats_estimate_is_at_least_what_smollm2_reads_and_not_far_above(
    smollm2: Tokenizer, name: str
) -> None:
    """The estimate holds what SmolLM2's template writes around the messages ("What is the capital of
    France?" is 37 tokens to it: 17 from its JSON alone), so the room left for output in its window
    fits; high by at most about the default system turn a chat with its own does not get."""
    messages = SHORT_CHATS[name]
    real = len(smollm2.encode(smollm2.apply_chat_template(messages)))
    estimate = input_tokens(msgspec.convert({"model": "m", "messages": messages}, ChatRequest))
    assert real <= estimate <= 2.5 * real
