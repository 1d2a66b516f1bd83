"""Route conditions see the same request whichever inbound API the client used (chat completions, the
Anthropic Messages API, the Responses API): its metadata as the client sent it, its prompt's length as
the vendor bills it (images included). Real gateway in front of the fake vendors; the official openai
and anthropic SDKs as clients."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from gateway.estimate import INLINE_PART_TOKENS
from gateway.types import ChatRequest, Message
from routing.plan import features
from tests.fakes import FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import route_header

ROUTES = """\
routes:
  - {name: sized, when: {max_prompt_tokens: 2000}, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: sized, candidates: [{model: claude-sonnet}], probe_interval: null}
  - {name: by-user, when: {metadata: {user_id: batch-7}}, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: by-user, candidates: [{model: claude-sonnet}], probe_interval: null}
"""
SMALL_WINDOW, LARGE_WINDOW = "gpt-4o-mini", "claude-sonnet"
# A photo-sized inline image: 40 kB of base64, which every vendor bills by its pixels (hundreds to
# ~1,600 tokens each), and which the gateway's estimate counts as INLINE_PART_TOKENS.
PHOTO = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(30_000)).decode()
PHOTOS = 3  # three photos: past the route's 2,000 tokens at any vendor's rate, whatever the text
QUESTION = "What is in these pictures?"


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return ROUTES


def _chat(gateway: RunningGateway) -> str:
    parts: list[Any] = [{"type": "text", "text": QUESTION}]
    parts += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PHOTO}"}}] * PHOTOS
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="sized", messages=[{"role": "user", "content": parts}]
    )
    raw.parse()
    return route_header(raw)["candidate"]


def _messages(gateway: RunningGateway) -> str:
    blocks: list[Any] = [{"type": "text", "text": QUESTION}]
    source = {"type": "base64", "media_type": "image/png", "data": PHOTO}
    blocks += [{"type": "image", "source": source}] * PHOTOS
    raw = gateway.anthropic().messages.with_raw_response.create(
        model="sized", max_tokens=32, messages=[{"role": "user", "content": blocks}]
    )
    raw.parse()
    return route_header(raw)["candidate"]


def _responses(gateway: RunningGateway) -> str:
    parts: list[Any] = [{"type": "input_text", "text": QUESTION}]
    parts += [{"type": "input_image", "image_url": f"data:image/png;base64,{PHOTO}"}] * PHOTOS
    raw = gateway.openai().responses.with_raw_response.create(
        model="sized", input=[{"role": "user", "content": parts}]
    )
    raw.parse()
    return route_header(raw)["candidate"]


@pytest.mark.parametrize("send", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
def test_images_count_toward_the_prompt_length_a_route_condition_sees(
    gateway: RunningGateway, send: Any
) -> None:
    """Three photos and one short question: the vendor bills thousands of input tokens, and so does
    the gateway's estimate (each inline image up to INLINE_PART_TOKENS), whichever API carried them;
    the `max_prompt_tokens: 2000` route meant for a small context window must not take it (the
    features once counted the text alone, ~7 tokens)."""
    assert PHOTOS * INLINE_PART_TOKENS > 2000
    assert send(gateway) == LARGE_WINDOW


def test_a_metadata_condition_sees_the_anthropic_requests_metadata(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """`when: {metadata: {user_id: batch-7}}` matches "entries of the request's metadata". An OpenAI
    client sending `metadata={"user_id": "batch-7"}` gets the route; an Anthropic client sending the
    very same `metadata={"user_id": "batch-7"}` (the only metadata its API takes) does not: the
    inbound translation moves it to `user`, and the condition never sees it."""
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="by-user", messages=[{"role": "user", "content": "hi"}], metadata={"user_id": "batch-7"}
    )
    raw.parse()
    assert route_header(raw)["candidate"] == SMALL_WINDOW  # the chat API: matched
    answer = gateway.anthropic().messages.with_raw_response.create(
        model="by-user",
        max_tokens=32,
        messages=[{"role": "user", "content": "hi"}],
        metadata={"user_id": "batch-7"},
    )
    answer.parse()
    assert route_header(answer)["candidate"] == SMALL_WINDOW
    # Upstream neither goes as `metadata`, which OpenAI takes only with `store` (the route read it
    # from the client's request); the Anthropic client's user id goes as OpenAI's `user`.
    chat, messages = (r.json for r in fake_openai.posts)
    assert "metadata" not in chat and "user" not in chat
    assert messages["user"] == "batch-7" and "metadata" not in messages


def test_a_metadata_condition_sees_the_responses_requests_metadata(gateway: RunningGateway) -> None:
    """The Responses API's `metadata` is the request's metadata too: the same route takes it, and
    other metadata (or none) goes to the route's other branch."""
    matched = gateway.openai().responses.with_raw_response.create(
        model="by-user", input="hi", metadata={"user_id": "batch-7"}
    )
    matched.parse()
    assert route_header(matched)["candidate"] == SMALL_WINDOW
    other = gateway.openai().responses.with_raw_response.create(
        model="by-user", input="hi", metadata={"user_id": "batch-8"}
    )
    other.parse()
    assert route_header(other)["candidate"] == LARGE_WINDOW


def test_an_anthropic_request_without_the_metadata_takes_the_other_branch(gateway: RunningGateway) -> None:
    """The condition is not met by any Anthropic request: only by the one whose `user_id` it names."""
    for metadata in ({"user_id": "batch-8"}, None):
        kwargs = {"metadata": metadata} if metadata else {}
        answer = gateway.anthropic().messages.with_raw_response.create(
            model="by-user", max_tokens=32, messages=[{"role": "user", "content": "hi"}], **kwargs
        )
        answer.parse()
        assert route_header(answer)["candidate"] == LARGE_WINDOW, metadata


def test_a_responses_requests_built_in_tools_are_tools_to_a_route() -> None:
    """Codex's `web_search` or `local_shell` alone (no function tool beside it) still makes a request
    with tools: a `when: {tools: ...}` condition and a candidate's `tools: false` see it as one, as
    they see an Anthropic client's web search."""
    asked = [Message(role="user", content=QUESTION)]
    built_in = ChatRequest(model="sized", messages=asked, responses={"tools": [{"type": "web_search"}]})
    plain = ChatRequest(model="sized", messages=asked, responses={"include": ["reasoning.encrypted_content"]})
    assert features(built_in, None, None).tools and not features(plain, None, None).tools
