"""A routed stream that breaks and cannot be continued (resume off; no candidate left to continue it)
tells the client which backend broke and how far it got, in the same plain words and stable code as
an unrouted one, never aiohttp's exception text."""

from __future__ import annotations

import openai
import pytest

from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway

# `gateway` is the routed gateway of tests/routing/conftest.py, with the shared routes (routed.ROUTES).
HI = [{"role": "user", "content": "one two three four five six"}]


def _broken(gateway: RunningGateway, model: str) -> openai.APIError:
    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in gateway.openai().chat.completions.create(model=model, messages=HI, stream=True):
            received.append(chunk)
    assert received  # text arrived before the break
    return caught.value


def test_a_route_that_does_not_resume_names_the_backend_that_broke(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    error = _broken(gateway, "no-resume")
    assert error.message == "the stream from backend openai ended unexpectedly after 3 events"
    assert error.code == "upstream_stream_interrupted"


def test_a_continuation_that_breaks_too_names_the_last_backend(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    fake_anthropic.fail_next(Fault.cut_stream(after=5))  # its start events, " three", " four"
    error = _broken(gateway, "resilient")
    assert error.message == "the stream from backend anthropic ended unexpectedly after 5 events"
    assert error.code == "upstream_stream_interrupted"
