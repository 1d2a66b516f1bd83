"""A candidate the route declares without `tools` or `vision` is skipped, on every policy, for a
request that has them: sent anyway, the vendor's 400 ended the request (a 400 never fails over),
although the next candidate could have answered. Only when no candidate can take it does the client
get a 400, from the gateway, and nothing goes upstream."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import route_header, routed_gateway

FAST = "retry: {attempts: 1}, probe_interval: null"
ROUTES = f"""\
routes:
  - {{name: eyes, candidates: [{{model: gpt-4o-mini, vision: false}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: hands, policy: weighted, candidates: [{{model: gpt-4o-mini, tools: false}}, {{model: claude-sonnet, weight: 1.0e-9}}], {FAST}}}
  - {{name: blind, candidates: [{{model: gpt-4o-mini, vision: false}}, {{model: claude-sonnet, vision: false}}], {FAST}}}
"""
IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
WITH_IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": IMAGE}},
        ],
    }
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def gateway(fake_vendors: FakeVendors, fresh_fakes: None) -> Iterator[RunningGateway]:
    with routed_gateway(fake_vendors, ROUTES) as running:
        yield running


def test_an_image_skips_the_candidate_declared_without_vision(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    client = gateway.openai()
    raw = client.chat.completions.with_raw_response.create(model="eyes", messages=WITH_IMAGE)  # type: ignore[arg-type]
    header = route_header(raw)
    assert header["candidate"] == "claude-sonnet"
    assert header["tried"] == "gpt-4o-mini:unsupported,claude-sonnet:ok"
    assert fake_openai.requests == [] and len(fake_anthropic.requests) == 1
    # without an image the first candidate answers as before
    raw = client.chat.completions.with_raw_response.create(model="eyes", messages=HI)  # type: ignore[arg-type]
    assert route_header(raw)["candidate"] == "gpt-4o-mini"


def test_tools_skip_the_candidate_declared_without_them_on_any_policy(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """`weighted` would send everything to gpt-4o-mini (claude-sonnet has weight 1e-9)."""
    client = gateway.openai()
    raw = client.chat.completions.with_raw_response.create(model="hands", messages=HI, tools=TOOLS)  # type: ignore[arg-type]
    assert route_header(raw)["candidate"] == "claude-sonnet"
    assert fake_openai.requests == []
    raw = client.chat.completions.with_raw_response.create(model="hands", messages=HI)  # type: ignore[arg-type]
    assert route_header(raw)["candidate"] == "gpt-4o-mini"


def test_no_candidate_able_is_a_400_from_the_gateway_and_nothing_goes_upstream(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(model="blind", messages=WITH_IMAGE)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "messages" and "images" in body["message"]
    assert fake_openai.requests == [] and fake_anthropic.requests == []
    assert gateway.sink.events == []  # no attempt was made
