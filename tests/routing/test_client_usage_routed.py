"""The usage a client is told on a routed response, beside what the ledger bills, on the three APIs
(chat completions with `stream_options.include_usage`, Anthropic's Messages, OpenAI's Responses),
through a routed gateway with the official SDKs as clients.

The rule (docs/routing-policies.md, the executor): a response's usage describes that response, as
OpenAI's and Anthropic's do: the prompt the client sent and the answer it got, with the cache reads,
writes and reasoning the answering vendor reported. The ledger bills every attempt; what failing
over cost beyond the answer (a hedge that lost, a cut attempt's prompt, the prefill a continuation
reads again) is in the ledger and not in the response.

- A stream cut and continued on another candidate reported the continuation's usage alone: its
  prompt counted the prefilled text, which the client never sent, and its output only the rest of
  the answer. It now reports the client's prompt and the whole answer: the output is what the ledger
  bills as output for the attempts that wrote it.
- The request's log line (and the request metrics' backend) named a non-streaming hedge's loser,
  with its zero usage, when the loser was recorded after the winner.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from structlog.testing import capture_logs

from gateway.providers.base import CONTINUE_INSTRUCTION
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import FAST, ROUTES, fresh, route_header, settled

ECHO = "one two three four five six"
HI: Any = [{"role": "user", "content": ECHO}]
USAGE_ROUTES = f"""{ROUTES}\
  - {{name: three, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}, {{model: gemini-flash}}], {FAST}}}
  - {{name: reasoner-first, candidates: [{{model: deepseek-reasoner}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: openai-twice, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
"""
APIS = ["chat", "messages", "responses"]


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return USAGE_ROUTES


@dataclass(frozen=True)
class Told:
    """The usage a client read, in one shape for the three APIs."""

    prompt: int  # every prompt token, cached and written included
    cached: int
    cache_write: int
    output: int  # reasoning included
    reasoning: int | None  # None: the API has no field for it (Anthropic's)
    text: str


def streamed(gateway: RunningGateway, api: str, model: str, text: str = ECHO) -> tuple[Told, Any]:
    """One streamed request on `api`: the usage the client was told, and the raw response (headers)."""
    messages: Any = [{"role": "user", "content": text}]
    raw: Any
    if api == "chat":
        raw = gateway.openai().chat.completions.with_raw_response.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(raw.parse())
        reports = [c.usage for c in chunks if c.usage is not None]
        assert len(reports) == 1 and chunks[-1].usage is not None
        u = reports[0]
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        details = u.prompt_tokens_details
        told = Told(
            u.prompt_tokens,
            (details.cached_tokens or 0) if details else 0,
            (getattr(details, "cache_write_tokens", None) or 0) if details else 0,
            u.completion_tokens,
            u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else 0,
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        )
        return told, raw
    if api == "messages":
        raw = gateway.anthropic().messages.with_raw_response.create(
            model=model, max_tokens=100, messages=messages, stream=True
        )
        events: list[Any] = list(raw.parse())
        [delta] = [e for e in events if e.type == "message_delta"]
        m = delta.usage
        reads, writes = m.cache_read_input_tokens or 0, m.cache_creation_input_tokens or 0
        told = Told(
            (m.input_tokens or 0) + reads + writes,
            reads,
            writes,
            m.output_tokens,
            None,
            "".join(
                e.delta.text
                for e in events
                if e.type == "content_block_delta" and e.delta.type == "text_delta"
            ),
        )
        return told, raw
    raw = gateway.openai().responses.with_raw_response.create(model=model, input=text, stream=True)
    events = list(raw.parse())
    [final] = [e.response for e in events if e.type == "response.completed"]
    r = final.usage
    assert r is not None and r.total_tokens == r.input_tokens + r.output_tokens
    told = Told(
        r.input_tokens,
        r.input_tokens_details.cached_tokens,
        getattr(r.input_tokens_details, "cache_write_tokens", None) or 0,
        r.output_tokens,
        r.output_tokens_details.reasoning_tokens,
        final.output_text,
    )
    return told, raw


def request_line(logs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The request's log line, written once the response's last byte is sent."""
    deadline = time.monotonic() + 5
    while not any(e["event"] == "request" for e in logs) and time.monotonic() < deadline:
        time.sleep(0.01)
    [line] = [e for e in logs if e["event"] == "request"]
    return line


@pytest.mark.parametrize("api", APIS)
def test_a_resumed_stream_reports_the_prompt_sent_and_the_whole_answer(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, api: str
) -> None:
    """gpt-4o-mini breaks after "one two"; claude-sonnet continues from that prefill. The client sent
    6 tokens and got 6: an unbroken stream says 6 and 6, and so must this one (it said 8 and 4: the
    continuation's prompt with the 2 prefilled tokens, and its output alone)."""
    clean, _ = streamed(gateway, api, "resilient")
    fresh(gateway)
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    with capture_logs() as logs:
        told, raw = streamed(gateway, api, "resilient")
        line = request_line(logs)
    assert told.text == ECHO and route_header(raw)["candidate"] == "gpt-4o-mini"
    assert fake_anthropic.last_request.json["messages"][-1]["role"] == "assistant"  # it was resumed
    assert (told.prompt, told.output) == (clean.prompt, clean.output) == (6, 6)
    settled(gateway, 2)
    cut, answered = sorted(gateway.sink.events, key=lambda e: e.attempt)
    # The ledger is unchanged: the cut attempt its estimate, the continuation what Anthropic reported
    # (the prefill in its prompt).
    assert (cut.backend, cut.estimated, cut.usage.output_tokens) == ("openai", True, 2)
    assert (answered.backend, answered.estimated) == ("anthropic", False)
    assert (answered.usage.prompt_tokens, answered.usage.output_tokens) == (8, 4)
    # The answer's output is what the ledger bills as output for the attempts that wrote it.
    assert told.output == cut.usage.output_tokens + answered.usage.output_tokens
    # The log line says what the client was told, with the final decision.
    assert (line["input_tokens"], line["output_tokens"], line["backend"]) == (6, 6, "anthropic")
    assert line["route"].endswith("tried=gpt-4o-mini:ok,gpt-4o-mini:cut,claude-sonnet:ok")


def test_a_stream_resumed_twice_counts_every_part_of_the_answer(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    fake_anthropic.fail_next(Fault.cut_stream(after=5))  # its start events, " three", " four"
    told, _ = streamed(gateway, "chat", "three")
    assert told.text == ECHO
    assert fake_gemini.last_request.json["contents"][-1]["parts"][0]["text"] == "one two three four"
    settled(gateway, 3)
    events = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert [e.backend for e in events] == ["openai", "anthropic", "gemini"]
    assert (events[-1].usage.prompt_tokens, events[-1].usage.output_tokens) == (10, 2)  # Gemini's report
    # Three attempts wrote the answer: its output is what each is billed for (the cut ones estimated,
    # "one two" 2, " three four" 3 at 4 bytes a token); the prompt is Gemini's less the 18-byte
    # prefill's estimated 5 tokens: 12 tokens in all, as Gemini counted the conversation.
    assert told.output == sum(e.usage.output_tokens for e in events) == 7
    assert (told.prompt, told.prompt + told.output) == (5, 12)


def test_a_continuation_asked_for_in_a_user_turn_leaves_that_turn_out_of_the_prompt(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """gpt-4o-mini breaks after "one two"; deepseek-chat (OpenAI-compatible: no prefill) is asked
    for the rest in a user turn. The client is told its own prompt: the continuation's, less the estimated tokens of the
    partial answer and of that turn (4 bytes a token each), which the client never sent."""
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    told, _ = streamed(gateway, "chat", "openai-twice")
    assert told.text == ECHO
    sent = fake_deepseek.last_request.json["messages"]
    assert sent[-2:] == [
        {"role": "assistant", "content": "one two"},
        {"role": "user", "content": CONTINUE_INSTRUCTION},
    ]
    settled(gateway, 2)
    answered = max(gateway.sink.events, key=lambda e: e.attempt)
    added = 2 + -(-len(CONTINUE_INSTRUCTION.encode()) // 4)  # "one two": 7 bytes, 2 tokens
    assert answered.usage.prompt_tokens == 6 + 2 + len(CONTINUE_INSTRUCTION.split())  # the fake's words
    assert told.prompt == max(0, answered.usage.prompt_tokens - added)
    assert told.output == 6


@pytest.mark.parametrize("api", APIS)
def test_a_continuations_cache_tokens_are_reported_as_its_vendor_reported_them(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, api: str
) -> None:
    """Cache reads and writes are the answering vendor's counts, on every API; only the prefill leaves
    the uncached prompt (it sits after every cached prefix)."""
    fake_openai.fail_next(Fault.cut_stream(after=3))
    fake_anthropic.set_next_usage(
        input_tokens=40, cached_input_tokens=1000, cache_write_5m_tokens=300, output_tokens=4
    )
    told, _ = streamed(gateway, api, "resilient")
    assert told.text == ECHO
    assert (told.cached, told.cache_write) == (1000, 300)
    assert told.prompt == 40 - 2 + 1000 + 300
    assert told.output == 2 + 4


def test_reasoning_a_cut_attempt_streamed_is_part_of_the_answers_output(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """deepseek-reasoner streams its reasoning, then breaks in the answer; claude-sonnet continues
    (without reasoning). The output the client is told covers what the ledger bills for both."""
    fake_deepseek.fail_next(Fault.cut_stream(after=12))  # role, 9 words of reasoning, "one", " two"
    told, _ = streamed(gateway, "chat", "reasoner-first")
    assert told.text == ECHO
    assert fake_anthropic.last_request.json["messages"][-1]["content"][0]["text"] == "one two"
    settled(gateway, 2)
    cut, answered = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert cut.backend == "deepseek" and cut.estimated and answered.backend == "anthropic"
    assert told.output == cut.usage.output_tokens + answered.usage.output_tokens
    assert told.reasoning == cut.usage.reasoning_tokens + answered.usage.reasoning_tokens
    assert told.prompt == 6  # the client's prompt, without the prefill


@pytest.mark.parametrize("api", APIS)
def test_after_retries_and_a_failover_the_answering_vendors_usage_is_reported(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, api: str
) -> None:
    """Anthropic overloaded twice, then gpt-4o-mini answers with cache reads and reasoning: the client
    gets OpenAI's counts in its own API's shape, and the failed attempts bill nothing."""
    fake_anthropic.fail_next(529, times=2)
    fake_openai.set_next_usage(
        input_tokens=10, cached_input_tokens=1024, output_tokens=70, reasoning_tokens=64
    )
    told, raw = streamed(gateway, api, "anthropic-first")
    assert route_header(raw)["tried"] == "claude-sonnet:503,claude-sonnet:503,gpt-4o-mini:ok"
    assert (told.prompt, told.cached, told.cache_write, told.output) == (1034, 1024, 0, 70)
    assert told.reasoning in (64, None)
    settled(gateway, 3)
    assert [
        (e.backend, e.cost_pico_usd > 0) for e in sorted(gateway.sink.events, key=lambda e: e.attempt)
    ] == [
        ("anthropic", False),
        ("anthropic", False),
        ("openai", True),
    ]


def test_a_hedged_answer_reports_and_logs_the_winner_alone(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """gpt-4o-mini is slow, the hedge (deepseek-chat) answers. The client is told deepseek's usage; the
    loser is billed in the ledger (499), and the request's log line must name the answer, not the
    loser recorded after it (it said backend=openai, 0 tokens)."""
    fake_openai.set_latency(first_token=1.0)
    fake_deepseek.set_next_usage(input_tokens=6, cached_input_tokens=64, output_tokens=6)
    with capture_logs() as logs:
        raw = gateway.openai().chat.completions.with_raw_response.create(model="hedged", messages=HI)
        usage = raw.parse().usage
        line = request_line(logs)
    assert route_header(raw)["hedged"] == "deepseek-chat"
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (70, 6)
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 64
    settled(gateway, 2)
    assert {e.backend: e.status for e in gateway.sink.events} == {"deepseek": 200, "openai": 499}
    assert line["backend"] == "deepseek" and line["status"] == 200 and line["error"] is None
    assert (line["input_tokens"], line["cached_input_tokens"], line["output_tokens"]) == (6, 64, 6)
