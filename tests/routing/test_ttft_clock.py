"""The time-to-first-token clock starts when an attempt goes upstream, not before its admission, and
stops at the stream's first output, not at the role some vendors announce before generating anything.

A request's first attempt is admitted first (stream slots, rate limits, budgets: with Redis a round
trip, and the month's spend read from the ledger the first time a budget is seen). That time is the
gateway's own: a slow admission must not read as a backend too slow for the route's `ttft_timeout`
(a 504 blamed on it, feeding its breaker, and a failover), nor start a hedge early. Each client API
(chat completions, Anthropic messages, Responses) is checked, through the real gateway, with the
admission slowed down deterministically.

What stops the clock is what `ttft_timeout` and the hedge race wait for (`gateway.types.is_output`):
text, a tool call or reasoning, not Anthropic's `message_start` or OpenAI's role chunk. The ledger's
`ttft_ms` (and the metric, the request log) and what routing learns from it (`lowest_latency`,
`hedge: {delay: p95}`) are checked against vendors that stream slowly, through the real gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import FAST, fresh, ledger, route_header, runtime, settled

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
SLOW_ADMISSION_S = 0.8  # longer than the TTFT timeout and the hedge delay below
GAP_S = 0.1  # between a slow stream's events: its role at once, its first output one gap or more later
ROUTES = f"""\
routes:
  - {{name: impatient, ttft_timeout: 0.4, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: hedged-late, hedge: {{delay: 0.5}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
"""


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return ROUTES


@pytest.fixture
def gateway(_routed: RunningGateway, fresh_fakes: None, monkeypatch: pytest.MonkeyPatch) -> RunningGateway:
    """The routed gateway whose admission (the first attempt's) takes SLOW_ADMISSION_S: a Redis slow
    to answer, or the first budget seed of the month summing the ledger."""
    pipeline = runtime(_routed).executor.pipeline
    admit = pipeline.admission
    assert admit is not None

    async def slow_admission(call: Any, target: Any, upstream: Any) -> None:
        await asyncio.sleep(SLOW_ADMISSION_S)
        await admit(call, target, upstream)

    monkeypatch.setattr(pipeline, "admission", slow_admission)
    return fresh(_routed)


def _chat_stream(gateway: RunningGateway, model: str) -> str:
    stream = gateway.openai().chat.completions.create(model=model, messages=HI, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _messages_stream(gateway: RunningGateway, model: str) -> str:
    with gateway.anthropic().messages.stream(model=model, max_tokens=100, messages=HI) as stream:  # type: ignore[arg-type]
        return "".join(stream.text_stream)


def _responses_stream(gateway: RunningGateway, model: str) -> str:
    with gateway.openai().responses.stream(model=model, input=ECHO) as stream:
        return stream.get_final_response().output_text


@pytest.mark.parametrize("ask", [_chat_stream, _messages_stream, _responses_stream])
def test_a_slow_admission_is_no_ttft_timeout_of_the_backend(
    gateway: RunningGateway, ask: Callable[[RunningGateway, str], str]
) -> None:
    """The admission takes 0.8 s, the route's TTFT timeout is 0.4 s, and the backend answers at
    once: the first candidate answers, with no 504 blamed on it and no failover."""
    assert ask(gateway, "impatient") == ECHO
    settled(gateway, 1)
    assert ledger(gateway) == [("openai", 200)]
    assert runtime(gateway).router.breakers.breakers["openai/gpt-4o-mini"].failures == 0
    # What routing learns from (lowest_latency, the p95 hedge delay) is the backend's time too.
    (event,) = gateway.sink.events
    assert event.ttft_ms is not None and event.ttft_ms < SLOW_ADMISSION_S * 1000
    assert event.latency_ms < SLOW_ADMISSION_S * 1000


def test_a_backend_slow_to_its_first_token_still_times_out_after_a_slow_admission(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """The clock still runs once the attempt is sent: a backend that sends nothing for 3 s is the
    504 `ttft_timeout` it always was, and the next candidate answers."""
    fake_openai.fail_next(Fault.delay(3), times=2)
    assert _chat_stream(gateway, "impatient") == ECHO
    settled(gateway, 3)
    assert ledger(gateway) == [("openai", 504), ("openai", 504), ("anthropic", 200)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_slow_admission_starts_no_hedge(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI, stream: bool
) -> None:
    """The hedge delay (0.5 s) counts from when the primary was sent: an admission that takes
    0.8 s, followed by a primary that answers at once, sends no hedge."""
    completions = gateway.openai().chat.completions.with_raw_response
    if stream:
        raw: Any = completions.create(model="hedged-late", messages=HI, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        raw = completions.create(model="hedged-late", messages=HI)
        text = raw.parse().choices[0].message.content
    assert text == ECHO
    route = route_header(raw)
    assert route["candidate"] == "gpt-4o-mini" and "hedged" not in route
    assert fake_deepseek.requests == []


@pytest.fixture
def prompt_gateway(_routed: RunningGateway, fresh_fakes: None) -> RunningGateway:
    """The routed gateway, its admission as quick as it is, and nothing learned yet."""
    runtime(_routed).router.stats.models.clear()
    return fresh(_routed)


def _seconds_to_first_text(gateway: RunningGateway, model: str) -> float:
    """Stream a whole chat (an answer routing learns from); seconds from the request to its first
    text, as the client saw it."""
    started, first = time.monotonic(), None
    for chunk in gateway.openai().chat.completions.create(model=model, messages=HI, stream=True):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - started
    assert first is not None
    return first


def test_ttft_is_time_to_the_first_text_not_to_message_start(
    prompt_gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Anthropic sends `message_start` (the role) at once, then the text block three events later:
    the ledger's TTFT is the text's, which the client saw no sooner, not the role's few ms."""
    fake_anthropic.fail_next(Fault.slow_stream(GAP_S))
    first_text = _seconds_to_first_text(prompt_gateway, "claude-sonnet")
    settled(prompt_gateway, 1)
    (event,) = prompt_gateway.sink.events
    assert event.status == 200 and event.ttft_ms is not None
    assert 2.5 * GAP_S * 1000 <= event.ttft_ms <= first_text * 1000


def test_what_routing_learns_is_time_to_the_first_text(
    prompt_gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """The p95 `hedge: {delay: p95}` waits and the mean `lowest_latency` ranks by: learned from the
    role's time, a p95 hedge on a Claude primary would fire at its `min_delay` on every stream."""
    for _ in range(3):
        fake_anthropic.fail_next(Fault.slow_stream(GAP_S))
        _seconds_to_first_text(prompt_gateway, "claude-sonnet")
    settled(prompt_gateway, 3)
    learned = runtime(prompt_gateway).router.stats.get("anthropic", "claude-sonnet-4-5")
    assert learned.samples == 3
    p95 = learned.p95_ttft()
    assert p95 is not None and p95 >= 2.5 * GAP_S
    assert learned.ttft_s is not None and learned.ttft_s >= 2.5 * GAP_S


TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
]


def test_a_tool_call_first_stops_the_clock(prompt_gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    """A stream whose first output is a tool call, with no text at all, has a TTFT: the tool call's,
    one gap after the role chunk, and at least one event (the finish) before the stream's end."""
    fake_openai.fail_next(Fault.slow_stream(GAP_S))
    stream = prompt_gateway.openai().chat.completions.create(
        model="gpt-4o-mini", messages=HI, stream=True, tools=TOOLS, tool_choice="required"
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert any(d.tool_calls for d in deltas) and not any(d.content for d in deltas)
    settled(prompt_gateway, 1)
    (event,) = prompt_gateway.sink.events
    assert event.status == 200 and event.ttft_ms is not None
    assert 0.9 * GAP_S * 1000 <= event.ttft_ms <= event.latency_ms - 0.9 * GAP_S * 1000


def test_reasoning_first_stops_the_clock(prompt_gateway: RunningGateway, fake_deepseek: FakeOpenAI) -> None:
    """DeepSeek's reasoner streams its reasoning before the text: the first reasoning is the first
    token, one gap after the role chunk, and at least a gap before the text."""
    fake_deepseek.fail_next(Fault.slow_stream(GAP_S))
    first_text = _seconds_to_first_text(prompt_gateway, "deepseek-reasoner")
    settled(prompt_gateway, 1)
    (event,) = prompt_gateway.sink.events
    assert event.status == 200 and event.ttft_ms is not None
    assert 0.9 * GAP_S * 1000 <= event.ttft_ms <= (first_text - 0.9 * GAP_S) * 1000


# An answer long enough to learn decode speed from (routing.stats.MIN_DECODE_TOKENS: 16 tokens).
LONG: list[ChatCompletionMessageParam] = [{"role": "user", "content": " ".join(["word"] * 24)}]


def _streamed_rate(gateway: RunningGateway, model: str) -> float:
    """Stream a whole chat; the tokens per second the client saw after the first: the words of its
    text and reasoning (one per chunk, as the fakes stream), from the first to the last."""
    times: list[float] = []
    tokens = 0
    for chunk in gateway.openai().chat.completions.create(model=model, messages=LONG, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning = (delta.model_extra or {}).get("reasoning_content") if delta is not None else None
        text = (delta.content or "") + (reasoning or "") if delta is not None else ""
        if text.split():
            tokens += len(text.split())
            times.append(time.monotonic())
    return (tokens - 1) / (times[-1] - times[0])


@pytest.mark.parametrize(
    ("model", "backend", "hidden"),
    [("gpt-5", "openai", True), ("deepseek-reasoner", "deepseek", False)],
)
def test_decode_speed_counts_the_tokens_streamed_after_the_first_token(
    prompt_gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    model: str,
    backend: str,
    hidden: bool,
) -> None:
    """gpt-5 bills 192 tokens of hidden reasoning as output, generated before its first token: over
    its 24-token answer's stream they read as some ten times its speed. DeepSeek's reasoner streams
    its reasoning after the first token: those tokens were timed, and count."""
    fake = fake_openai if backend == "openai" else fake_deepseek
    fake.fail_next(Fault.slow_stream(GAP_S / 2))
    seen = _streamed_rate(prompt_gateway, model)
    settled(prompt_gateway, 1)
    (event,) = prompt_gateway.sink.events
    assert event.reasoning_streamed is not hidden and event.usage.reasoning_tokens > 0
    learned = runtime(prompt_gateway).router.stats.get(backend, model).tokens_per_s
    assert learned is not None and 0.6 * seen <= learned <= 1.4 * seen
