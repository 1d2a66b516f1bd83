"""Streams that break, through a routed gateway, with the official SDKs as clients: where a failure
counts as before the first token (fail over invisibly, or an HTTP error when every candidate fails),
a stream whose answer had already ended, and resumption on the Messages and Responses APIs and over
more than one break. For each: what the client sees, which backends were tried, what the ledger holds."""

from __future__ import annotations

import base64
import time

import openai
import pytest
from structlog.testing import capture_logs

from gateway.estimate import INLINE_PART_TOKENS
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import FAST, ROUTES, attempts, route_header, settled

HI = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
STREAM_ROUTES = f"""{ROUTES}\
  - {{name: anthropic-first-no-resume, resume: false, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: three, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}, {{model: gemini-flash}}], {FAST}}}
"""


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return STREAM_ROUTES


def test_a_failure_after_the_role_but_before_any_text_fails_over_invisibly(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Anthropic's message_start arrives before the model generated anything; an overloaded error
    after it is a failure before the first token, so even a route that forbids resuming fails over
    (the client has seen no text), on the Messages API as on any other."""
    fake_anthropic.fail_next(Fault.stream_error(after=1, code=529), times=2)
    raw = gateway.anthropic().messages.with_raw_response.create(
        model="anthropic-first-no-resume", max_tokens=100, messages=HI, stream=True
    )
    events = list(raw.parse())
    text = "".join(
        e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert text == ECHO and events[-1].type == "message_stop"
    assert [e.type for e in events].count("message_start") == 1
    route = route_header(raw)
    assert route["candidate"] == "gpt-4o-mini" and route["attempts"] == "3"
    assert fake_openai.last_request.json["messages"][-1]["role"] == "user"  # the original request, no prefill
    settled(gateway, 3)
    assert attempts(gateway) == [("anthropic", False), ("anthropic", False), ("openai", True)]
    assert all(e.cost_pico_usd == 0 for e in gateway.sink.events if not e.ok)  # nothing was generated


def test_every_candidate_failing_before_the_first_token_is_an_http_error(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Each backend announces the reply (its role) and breaks: the client gets an error status in
    the OpenAI shape, not a 200 whose stream breaks."""
    fake_openai.fail_next(Fault.cut_stream(after=1), times=2)
    fake_anthropic.fail_next(Fault.stream_error(after=1, code=529), times=2)
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().chat.completions.create(model="resilient", messages=HI, stream=True)
    assert caught.value.status_code >= 500
    assert isinstance(caught.value.body, dict) and caught.value.body.get("message")  # the OpenAI error object
    assert route_header(caught.value.response)["attempts"] == "4"
    settled(gateway, 4)
    assert attempts(gateway) == [("openai", False)] * 2 + [("anthropic", False)] * 2


def test_a_stream_cut_after_its_answer_ended_is_not_continued(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The connection drops after the finish reason (before the usage chunk and [DONE]): asking the
    next candidate to continue a finished answer would append a second answer, finish and usage to
    it. The client gets the answer once, then the error."""
    fake_openai.fail_next(Fault.cut_stream(after=8))  # role, six words, finish
    stream = gateway.openai().chat.completions.create(
        model="resilient", messages=HI, stream=True, stream_options={"include_usage": True}
    )
    chunks = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            chunks.append(chunk)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ECHO
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    assert not fake_anthropic.requests
    settled(gateway, 1)
    assert attempts(gateway) == [("openai", False)]


def test_a_continuation_that_breaks_too_continues_on_the_third_candidate(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    fake_anthropic.fail_next(Fault.cut_stream(after=5))  # its start events, " three", " four"
    with capture_logs() as logs:
        stream = gateway.openai().chat.completions.create(
            model="three", messages=HI, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        deadline = time.monotonic() + 5  # the line is written once the response's last byte is sent
        while not any(e["event"] == "request" for e in logs) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == ["assistant"]
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].usage is not None
    # Each continuation was asked to go on from all the text sent so far, by every earlier candidate.
    first_prefill = fake_anthropic.last_request.json["messages"][-1]["content"][0]["text"]
    second_prefill = fake_gemini.last_request.json["contents"][-1]["parts"][0]["text"]
    assert first_prefill == "one two" and second_prefill == "one two three four"
    # The request's log line names every attempt, not only what was known when the stream began.
    [line] = [e for e in logs if e["event"] == "request"]
    tried = "gpt-4o-mini:ok,gpt-4o-mini:cut,claude-sonnet:ok,claude-sonnet:cut,gemini-flash:ok"
    assert line["route"].endswith(f"candidate=gemini-flash; reason=fixed; attempts=3; tried={tried}")
    settled(gateway, 3)
    events = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert [(e.backend, e.ok) for e in events] == [("openai", False), ("anthropic", False), ("gemini", True)]
    # The broken attempts are billed what they generated (estimated), the last one as reported.
    assert [e.estimated for e in events] == [True, True, False]
    assert all(e.usage.output_tokens > 0 and e.cost_pico_usd > 0 for e in events)


def test_a_cut_attempt_with_an_inline_image_is_billed_an_image_not_its_base64(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A cut attempt's prompt is estimated from its body: an image sent inline (a data URL, what the
    OpenAI SDKs send for a local file) counts one image's allowance, not its base64 at 4 bytes a
    token (~30,000 tokens for this 120 kB of base64, where the vendor bills the prompt 91)."""
    image = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + bytes(90_000)).decode()
    ask = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": ECHO},
                {"type": "image_url", "image_url": {"url": image}},
            ],
        }
    ]
    # What the vendor bills this prompt: an uncut stream of the same request to the same model.
    list(gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=ask, stream=True))  # type: ignore[arg-type]
    settled(gateway, 1)
    (whole,) = gateway.sink.events
    reported = whole.usage.input_tokens
    assert not whole.estimated and 0 < reported < 1000
    gateway.sink.events.clear()

    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    stream = gateway.openai().chat.completions.create(model="resilient", messages=ask, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).startswith("one two three")
    settled(gateway, 2)
    cut = min(gateway.sink.events, key=lambda e: e.attempt)
    assert cut.backend == "openai" and cut.estimated
    # One image's allowance and the rest of the body (a short text, JSON framing) at 4 bytes a token.
    assert INLINE_PART_TOKENS < cut.usage.input_tokens < INLINE_PART_TOKENS + 200, (
        cut.usage.input_tokens,
        reported,
    )


def test_a_responses_stream_cut_mid_way_is_one_uninterrupted_response(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    with gateway.openai().responses.stream(model="resilient", input=ECHO) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == ECHO and final.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 1 and kinds.count("response.content_part.added") == 1
    assert fake_anthropic.last_request.json["messages"][-1]["role"] == "assistant"
    settled(gateway, 2)
    assert attempts(gateway) == [("openai", False), ("anthropic", True)]


def test_a_continuation_after_whitespace_is_accepted_and_not_doubled(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The text sent before the break ends in whitespace ("one "): Anthropic refuses a prefill that
    does, so the gateway sends it without and drops the whitespace the model writes again."""
    spaced = "one  two three"  # streamed as "one", " ", " two", " three"
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " "
    stream = gateway.openai().chat.completions.create(
        model="resilient", messages=[{"role": "user", "content": spaced}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == spaced
    assert fake_anthropic.last_request.json["messages"][-1]["content"][0]["text"] == "one"
    settled(gateway, 2)
    assert attempts(gateway) == [("openai", False), ("anthropic", True)]


def test_a_resumed_stream_keeps_its_model_and_creation_time_to_the_end(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The chunks a continuation on another vendor wrote carried that vendor's model and their own
    creation time: an OpenAI client saw `model` (and `created`) change mid-stream, which an unbroken
    stream never does. They carry the first chunk's now; which candidate wrote what is for the
    ledger to say."""
    fake_openai.set_latency(first_token=1.0)  # the continuation is created a second later at least
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="resilient", messages=HI, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO
    assert {(c.id, c.model, c.created) for c in chunks} == {(chunks[0].id, "gpt-4o-mini", chunks[0].created)}
    assert route_header(raw)["candidate"] == "gpt-4o-mini"  # the decision when the stream began
    settled(gateway, 2)
    events = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert [(e.backend, e.model, e.ok) for e in events] == [
        ("openai", "gpt-4o-mini", False),
        ("anthropic", "claude-sonnet-4-5", True),
    ]
    assert events[1].routing is not None and "candidate=claude-sonnet" in events[1].routing
