"""What admission reserves for a request: its prompt from its body's size, each part sent inline (an
image, a file, audio as base64) or by URL as one allowance, whatever vendor's form the body takes; its
output, its cap for every choice it asks for; its web searches, each Anthropic web search tool's
`max_uses`. The prompt's estimate is also what an attempt cut before its
usage report is billed (tests/routing/test_stream_failover.py, test_cancelled_answer_billing.py)."""

from __future__ import annotations

import base64

import msgspec
import pytest

from gateway.estimate import (
    BYTES_PER_TOKEN,
    DEFAULT_OUTPUT_ESTIMATE,
    DEFAULT_WEB_SEARCH_ESTIMATE,
    INLINE_PART_TOKENS,
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


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [{"role": "user", "content": TEXT}]},
        {"model": "m", "messages": [{"role": "user", "content": "decode this base64: aGVsbG8="}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]},
        # A data URL or a URL written as text is text; a tool's input named `data` or `url` is no part.
        {"model": "m", "messages": [{"role": "user", "content": DATA_URL}]},
        {"model": "m", "messages": [{"role": "user", "content": f"what is at {URL}?"}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {"data": B64}}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {"url": URL}}]}]},
        {"model": "m", "messages": [], "max_tokens": 100},
        {},
    ],
)
def test_a_prompt_with_nothing_inline_is_its_size_at_4_bytes_a_token(body: dict) -> None:
    encoded = msgspec.json.encode(body)
    assert prompt_tokens(encoded) == tokens(len(encoded))


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
    assert prompt_tokens(encoded) == tokens(len(encoded) - len(payload)) + INLINE_PART_TOKENS


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
    assert prompt_tokens(encoded) == tokens(len(encoded) - len(URL)) + INLINE_PART_TOKENS


def test_every_part_counts_and_a_small_one_only_its_size() -> None:
    small = "data:image/png;base64," + base64.b64encode(bytes(300)).decode()  # 422 bytes: 106 tokens
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in (DATA_URL, small, DATA_URL, URL)]
    body = msgspec.json.encode({"messages": [{"role": "user", "content": parts}]})
    rest = len(body) - 2 * len(DATA_URL) - len(small) - len(URL)
    assert prompt_tokens(body) == tokens(rest) + 3 * INLINE_PART_TOKENS + tokens(len(small))


@pytest.mark.parametrize("url", [DATA_URL, URL], ids=["inline", "by-url"])
def test_count_tokens_estimates_an_image_as_an_image(url: str) -> None:
    request = msgspec.convert(_chat({"type": "image_url", "image_url": {"url": url}}), ChatRequest)
    assert INLINE_PART_TOKENS < input_tokens(request) < INLINE_PART_TOKENS + 50


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
    assert prompt_tokens(encoded) == tokens(len(encoded) - len(FILE_ID)) + INLINE_PART_TOKENS


def test_count_tokens_estimates_a_file_sent_by_id_as_a_part() -> None:
    request = msgspec.convert(_chat({"type": "file", "file": {"file_id": FILE_ID}}), ChatRequest)
    assert INLINE_PART_TOKENS < input_tokens(request) < INLINE_PART_TOKENS + 50
