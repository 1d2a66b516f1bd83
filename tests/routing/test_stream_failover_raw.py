"""Routed streams that break after their first token on chunks no fake vendor sends: a refusal, and
several tokens in one chunk (as Anthropic's and Gemini's streams carry them). The first candidate is
the module's raw OpenAI-compatible backend (tests.reliability.raw_backend), which streams what a test
scripts and then drops the connection; the next is the fake OpenAI. For each inbound API: what the
client sees, what the next candidate is asked, what the client is told it used."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from tests.fakes import FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway
from tests.reliability.raw_backend import Send, Sleep, http_head
from tests.routing.routed import FAST, ROUTES, settled

ECHO = "one two three four five six seven eight nine ten eleven twelve"
ASK: Any = [{"role": "user", "content": ECHO}]
CHUNK = {"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 0, "model": "gpt-4o-mini"}
HALF_REFUSAL = "I'm sorry, but I"


def frame(delta: dict[str, Any]) -> bytes:
    """One chat.completion.chunk SSE frame holding `delta`."""
    data = {**CHUNK, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


ROLE = frame({"role": "assistant", "content": ""})
REFUSING = ROLE + frame({"refusal": "I'm sorry,"}) + frame({"refusal": " but I"})
# Five words in one chunk: 23 bytes, which the gateway's estimate of a cut stream bills as 6 tokens.
FIVE_WORDS = ROLE + frame({"content": "one two three four five"})
FIVE_WORDS_TOKENS = 6


class CutStream:
    """The raw backend's answer: a 200 event stream of `frames`, then the connection drops (no
    finish reason, no [DONE])."""

    def __init__(self) -> None:
        self.frames = b""

    def reset(self) -> None:
        self.frames = b""

    def __call__(self, send: Send, sleep: Sleep) -> None:
        send(http_head(content_type="text/event-stream") + self.frames)


@pytest.fixture(scope="module")
def raw_script() -> CutStream:
    return CutStream()


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return f"{ROUTES}  - {{name: raw-then-gpt, candidates: [{{model: raw-model}}, {{model: gpt-4o-mini}}], {FAST}}}\n"


def read(stream: Any) -> tuple[list[Any], openai.APIError | None]:
    """The chunks a client got, and the error the stream ended with (None: it ended cleanly)."""
    chunks: list[Any] = []
    try:
        for chunk in stream:
            chunks.append(chunk)
    except openai.APIError as exc:
        return chunks, exc
    return chunks, None


def cut_attempt(gateway: RunningGateway, count: int) -> Any:
    """The raw backend's usage event, once the request's `count` events are recorded."""
    settled(gateway, count)
    cut = min(gateway.sink.events, key=lambda e: e.attempt)
    assert cut.backend == "raw" and cut.estimated
    return cut


# --- a refusal cut mid-way -----------------------------------------------------------------------


def test_a_refusal_cut_mid_way_is_not_followed_by_a_fresh_answer(
    gateway: RunningGateway, raw: CutStream, fake_openai: FakeOpenAI
) -> None:
    """The model was refusing when the connection dropped. A refusal is no answer text a prefill
    could go on from, and asking the next candidate afresh would append a whole answer (`content`,
    finish_reason stop) to the half refusal in the client's one message: like a tool call under way,
    it ends with the SSE error."""
    raw.frames = REFUSING
    stream = gateway.openai().chat.completions.create(model="raw-then-gpt", messages=ASK, stream=True)
    chunks, error = read(stream)
    refusal = "".join(c.choices[0].delta.refusal or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert refusal == HALF_REFUSAL
    assert content == "", f"a fresh answer was appended to the half refusal: {content!r}"
    assert error is not None, "the cut refusal must end with an SSE error event, not finish_reason stop"
    assert not any(c.choices and c.choices[0].finish_reason for c in chunks)
    assert not fake_openai.requests
    assert cut_attempt(gateway, 1).usage.output_tokens > 0  # the half refusal is still billed


def test_a_refusal_cut_mid_way_fails_the_responses_stream(
    gateway: RunningGateway, raw: CutStream, fake_openai: FakeOpenAI
) -> None:
    """On the Responses API: `error` and `response.failed`, whose message holds the half refusal,
    incomplete; never a completed response with an answer after it."""
    raw.frames = REFUSING
    events = list(gateway.openai().responses.create(model="raw-then-gpt", input=ECHO, stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    failed = events[-1].response
    [message] = failed.output
    assert message.type == "message" and message.status == "incomplete"
    assert [(p.type, getattr(p, "refusal", None)) for p in message.content] == [("refusal", HALF_REFUSAL)]
    assert not fake_openai.requests


def test_a_refusal_cut_mid_way_ends_the_messages_stream_with_an_error(
    gateway: RunningGateway, raw: CutStream, fake_openai: FakeOpenAI
) -> None:
    """On the Messages API (which shows a refusal's words as text, `stop_reason: refusal`): the half
    refusal's text, then Anthropic's `error` event, never a message_stop, and nothing asked of the
    next candidate."""
    raw.frames = REFUSING
    seen: list[Any] = []
    stream = gateway.anthropic().messages.create(
        model="raw-then-gpt", max_tokens=100, messages=ASK, stream=True
    )
    with pytest.raises(anthropic.APIStatusError):
        for event in stream:
            seen.append(event)
    kinds = [e.type for e in seen]
    assert kinds[0] == "message_start" and "message_stop" not in kinds and "message_delta" not in kinds
    text = "".join(e.delta.text for e in seen if e.type == "content_block_delta")
    assert text == "I'm sorry, but I"  # the half refusal, not continued elsewhere
    assert not fake_openai.requests


# --- the client's output limit -------------------------------------------------------------------


def limited(gateway: RunningGateway, limit: int) -> tuple[list[Any], openai.APIError | None]:
    stream = gateway.openai().chat.completions.create(
        model="raw-then-gpt",
        messages=ASK,
        stream=True,
        max_tokens=limit,
        stream_options={"include_usage": True},
    )
    return read(stream)


def test_a_continuation_is_asked_for_what_the_output_limit_has_left(
    gateway: RunningGateway, raw: CutStream, fake_openai: FakeOpenAI
) -> None:
    """The cut attempt sent one chunk of five words, which the ledger bills as 6 output tokens (its
    estimate): of the client's max_tokens=10 the continuation may have 4, not 9 (a chunk counted as
    one token), and the client is told no more completion tokens than it allowed."""
    raw.frames = FIVE_WORDS
    limit = 10
    chunks, error = limited(gateway, limit)
    assert error is None
    cut = cut_attempt(gateway, 2)
    assert cut.usage.output_tokens == FIVE_WORDS_TOKENS
    asked = fake_openai.last_request.json
    assert (asked.get("max_completion_tokens") or asked.get("max_tokens")) == limit - FIVE_WORDS_TOKENS
    [told] = [c.usage for c in chunks if c.usage is not None]
    assert FIVE_WORDS_TOKENS < told.completion_tokens <= limit


def test_an_output_limit_the_cut_attempt_spent_ends_the_answer_at_its_length(
    gateway: RunningGateway, raw: CutStream, fake_openai: FakeOpenAI
) -> None:
    """With max_tokens=6 the same cut attempt already spent the whole limit: a continuation (asked for
    5 more, were a chunk one token) could only go past it, and the vendor would have ended the answer
    at its length a moment later. The stream ends so, cleanly, not with an error the client would
    retry (paying again) for an answer it has whole; it is told the output it was billed for."""
    raw.frames = FIVE_WORDS
    chunks, error = limited(gateway, FIVE_WORDS_TOKENS)
    assert error is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three four five"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert cut_attempt(gateway, 1).usage.output_tokens == FIVE_WORDS_TOKENS
    assert not fake_openai.posts
    [told] = [c.usage for c in chunks if c.usage is not None]
    assert told.completion_tokens == FIVE_WORDS_TOKENS


def test_an_anthropic_client_whose_limit_the_cut_attempt_spent_gets_max_tokens(
    gateway: RunningGateway, raw: CutStream, fake_openai: FakeOpenAI
) -> None:
    """The same through the Messages API: the message ends with stop_reason max_tokens and the
    output it was billed for, and the SDK's stream parser accepts the event sequence."""
    raw.frames = FIVE_WORDS
    with gateway.anthropic().messages.stream(
        model="raw-then-gpt", max_tokens=FIVE_WORDS_TOKENS, messages=ASK
    ) as stream:
        message = stream.get_final_message()
    assert "".join(b.text for b in message.content if b.type == "text") == "one two three four five"
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == FIVE_WORDS_TOKENS
    assert not fake_openai.posts


def test_a_responses_client_whose_limit_the_cut_attempt_spent_gets_an_incomplete_response(
    gateway: RunningGateway, raw: CutStream, fake_openai: FakeOpenAI
) -> None:
    """And through the Responses API: `response.incomplete` for its output limit, with the text."""
    raw.frames = FIVE_WORDS
    events = list(
        gateway.openai().responses.create(
            model="raw-then-gpt", input=ECHO, max_output_tokens=FIVE_WORDS_TOKENS, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    response = events[-1].response
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.output_text == "one two three four five"
    assert response.usage is not None and response.usage.output_tokens == FIVE_WORDS_TOKENS
    assert not fake_openai.posts
