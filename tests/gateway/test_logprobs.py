"""Token log probabilities (`logprobs`, `top_logprobs`) through the gateway with the official OpenAI SDK.
They were in neither the Anthropic nor the Gemini parameter table, so they were dropped on the way
and the client got `logprobs: null` as if its request had been served. Gemini has them
(`generationConfig.responseLogprobs` and `logprobs`, answered in `logprobsResult`): they come back in
OpenAI's shape, streamed or not. Claude has none: a 400 naming `logprobs`, nothing sent."""

from __future__ import annotations

import openai
import pytest

from tests.fakes import FakeAnthropic, FakeGemini
from tests.fixtures.vendor_gateway import RunningGateway

HI = [{"role": "user", "content": "sky is blue"}]
WORDS = ["sky", " is", " blue"]  # the fake echoes the prompt, one token a word


def test_gemini_logprobs_are_asked_for_and_come_back_in_openais_shape(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    reply = gateway.openai().chat.completions.create(
        model="gemini-flash", messages=HI, logprobs=True, top_logprobs=2
    )  # type: ignore[arg-type]
    config = fake_gemini.last_request.json["generationConfig"]
    assert config["responseLogprobs"] is True and config["logprobs"] == 2
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.token for t in logprobs.content] == WORDS
    first = logprobs.content[0]
    # The fake is certain of the first token: Gemini then leaves logProbability out (a proto3 zero).
    assert first.logprob == 0.0 and logprobs.content[1].logprob == -0.25 and first.bytes == list(b"sky")
    assert [len(t.top_logprobs) for t in logprobs.content] == [2, 2, 2]
    assert first.top_logprobs[0].token == "sky" and first.top_logprobs[0].bytes == list(b"sky")
    assert first.top_logprobs[0].logprob >= first.top_logprobs[1].logprob


def test_gemini_logprobs_without_top_logprobs_have_no_alternatives(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    reply = gateway.openai().chat.completions.create(model="gemini-flash", messages=HI, logprobs=True)  # type: ignore[arg-type]
    config = fake_gemini.last_request.json["generationConfig"]
    assert config["responseLogprobs"] is True and "logprobs" not in config
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [t.token for t in content] == WORDS and all(t.top_logprobs == [] for t in content)  # type: ignore[union-attr]


def test_gemini_streams_logprobs_with_each_delta(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    stream = gateway.openai().chat.completions.create(
        model="gemini-flash", messages=HI, logprobs=True, top_logprobs=1, stream=True
    )  # type: ignore[arg-type]
    tokens = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                assert choice.logprobs is not None and choice.logprobs.content is not None
                assert "".join(t.token for t in choice.logprobs.content) == choice.delta.content
                assert all(len(t.top_logprobs) == 1 for t in choice.logprobs.content)
                tokens += [t.token for t in choice.logprobs.content]
    assert tokens == WORDS
    assert fake_gemini.last_request.json["generationConfig"]["responseLogprobs"] is True


def test_without_logprobs_gemini_is_not_asked_and_none_come_back(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    reply = gateway.openai().chat.completions.create(model="gemini-flash", messages=HI, logprobs=False)  # type: ignore[arg-type]
    assert "responseLogprobs" not in fake_gemini.last_request.json.get("generationConfig", {})
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_from_claude_are_a_400_naming_the_parameter(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(
            model="claude-sonnet", messages=HI, logprobs=True, top_logprobs=2, stream=stream
        )  # type: ignore[call-overload]
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "logprobs" and body["type"] == "invalid_request_error"
    assert "log probabilities" in caught.value.message
    assert not fake_anthropic.requests  # refused before anything was sent


def test_claude_serves_a_request_that_does_not_ask_for_logprobs(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    reply = gateway.openai().chat.completions.create(model="claude-sonnet", messages=HI, logprobs=False)  # type: ignore[arg-type]
    assert reply.choices[0].message.content and reply.choices[0].logprobs is None
