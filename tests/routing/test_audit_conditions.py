"""Audit of route conditions: what each inbound API (chat completions, the Anthropic Messages API, the
Responses API) feeds a route's `when:` conditions. Each test here fails on the defect it names: a
condition that sees a different request than the vendor bills or than the client sent. Real gateway in
front of the fake vendors; the official openai and anthropic SDKs as clients."""

from __future__ import annotations

import pytest

from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.gateway.conftest import RunningGateway
from tests.routing.routed import route_header

ROUTES = """\
routes:
  - {name: by-user, when: {metadata: {user_id: batch-7}}, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: by-user, candidates: [{model: claude-sonnet}], probe_interval: null}
"""
SMALL_WINDOW, LARGE_WINDOW = "gpt-4o-mini", "claude-sonnet"


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return ROUTES


@pytest.fixture
def gateway(
    _routed: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> RunningGateway:
    return _routed


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
    # Upstream each goes as before: the chat client's metadata as it sent it, the Anthropic client's
    # user id as OpenAI's `user` and no `metadata` (OpenAI takes that only with `store`).
    chat, messages = (r.json for r in fake_openai.posts)
    assert chat["metadata"] == {"user_id": "batch-7"} and "user" not in chat
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
