"""A route whose first candidate is Claude, which has no token log probabilities: a request asking
for them skips it (`tried=claude-sonnet:unsupported`) for the next candidate that can give them, and
is a 400 naming `logprobs` only when no candidate can. Before, the parameter was dropped for Claude,
which answered, and the client got `logprobs: null`."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.fakes import FakeAnthropic
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import route_header, routed_gateway

FAST = "retry: {attempts: 1}, probe_interval: null"
ROUTES = f"""\
routes:
  - {{name: claude-then-gemini, candidates: [{{model: claude-sonnet}}, {{model: gemini-flash}}], {FAST}}}
  - {{name: claude-then-openai, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: claudes, candidates: [{{model: claude-sonnet}}, {{model: claude-opus-46}}], {FAST}}}
"""
HI = [{"role": "user", "content": "sky is blue"}]


@pytest.fixture
def gateway(fake_vendors: FakeVendors, fresh_fakes: None) -> Iterator[RunningGateway]:
    with routed_gateway(fake_vendors, ROUTES) as running:
        yield running


@pytest.mark.parametrize(
    ("route", "served_by"), [("claude-then-gemini", "gemini-flash"), ("claude-then-openai", "gpt-4o-mini")]
)
def test_a_logprobs_request_skips_claude_for_a_candidate_that_gives_them(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, route: str, served_by: str
) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=route, messages=HI, logprobs=True, top_logprobs=1
    )  # type: ignore[arg-type]
    header = route_header(raw)
    assert header["candidate"] == served_by
    assert header["tried"] == f"claude-sonnet:unsupported,{served_by}:ok"
    content = raw.parse().choices[0].logprobs.content  # type: ignore[union-attr]
    assert [t.token for t in content] == ["sky", " is", " blue"]  # type: ignore[union-attr]
    assert not fake_anthropic.requests


def test_a_streamed_logprobs_request_skips_claude_too(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    stream = gateway.openai().chat.completions.create(
        model="claude-then-gemini", messages=HI, logprobs=True, stream=True
    )  # type: ignore[arg-type]
    tokens = [t.token for c in stream for ch in c.choices if ch.logprobs for t in ch.logprobs.content or ()]
    assert tokens == ["sky", " is", " blue"] and not fake_anthropic.requests


def test_without_logprobs_claude_answers_first_as_before(gateway: RunningGateway) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(model="claude-then-gemini", messages=HI)  # type: ignore[arg-type]
    assert route_header(raw)["candidate"] == "claude-sonnet"


def test_a_route_of_claude_models_only_is_the_400(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model="claudes", messages=HI, logprobs=True)  # type: ignore[arg-type]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "logprobs"
    assert not fake_anthropic.requests and not gateway.sink.events  # nothing sent, nothing billed
