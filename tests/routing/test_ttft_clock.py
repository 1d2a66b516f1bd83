"""The time-to-first-token clock starts when an attempt goes upstream, not before its admission.

A request's first attempt is admitted first (stream slots, rate limits, budgets: with Redis a round
trip, and the month's spend read from the ledger the first time a budget is seen). That time is the
gateway's own: a slow admission must not read as a backend too slow for the route's `ttft_timeout`
(a 504 blamed on it, feeding its breaker, and a failover), nor start a hedge early. Each client API
(chat completions, Anthropic messages, Responses) is checked, through the real gateway, with the
admission slowed down deterministically.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.fakes import FakeOpenAI, Fault
from tests.gateway.conftest import RunningGateway
from tests.routing.routed import FAST, fresh, ledger, route_header, runtime, settled

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
SLOW_ADMISSION_S = 0.8  # longer than the TTFT timeout and the hedge delay below
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
