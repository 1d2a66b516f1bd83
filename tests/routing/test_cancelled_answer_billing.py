"""A whole (non-streamed) answer not read to its end: cancelled after its status line arrived, before
its body was read, or with its body broken off mid-read, through a real routed gateway with the
official OpenAI SDK as client (docs/reliability.md, "Answers cut short: what gets billed").

The status line of a non-streamed answer comes once the vendor generated all of it, which it bills.
A hedge race's loser cancelled then (its partner took the race a moment earlier), or an attempt whose
client left, was billed nothing: 0 tokens, not estimated. It is billed its vendor's own report when
the body comes within a moment (`CUT_ANSWER_WAIT`), else an estimate, marked `estimated`: the output
from the answer's size less its vendor's envelope (an answer with no text), capped by the request's
output limit. An answer whose body broke off mid-read (the client's 502) is billed that estimate too,
and a hedge race's winner answers without waiting for its loser to end.

The loser is a raw backend (tests/reliability/raw_backend.py) that sends its headers at once and its
body only once the router abandons it, once the test releases it, or never: the hedge (the fake
OpenAI) wins the race after the hedge delay, and the cancellation lands while the loser waits for its
body, whatever the scheduler.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from structlog.testing import capture_logs

from gateway import pipeline
from gateway.config import Timeouts, parse_config
from gateway.errors import BadGateway, GatewayTimeout
from gateway.estimate import (
    BYTES_PER_TOKEN,
    CHAT_TOKENS,
    DEFAULT_OUTPUT_ESTIMATE,
    INLINE_PART_TOKENS,
    MESSAGE_TOKENS,
)
from gateway.pipeline import CUT_ANSWER_WAIT, Call, RequestInfo, _cut_answer
from gateway.providers import PROVIDERS, gemini
from gateway.providers.base import UpstreamRequest
from gateway.runtime import Gateway
from gateway.transport import MAX_RESPONSE_BODY, Transport, body_size
from gateway.usage import Usage
from routing import execute
from routing.execute import SpendCap
from tests.fakes import FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway, fakes_env
from tests.reliability.raw_backend import RawBackend, Send, Sleep, http_head
from tests.routing.routed import (
    FAST,
    ROUTES,
    counted_micro_usd,
    raw_config_text,
    route_header,
    runtime,
    settled,
)

PROMPT = "one two three four five six"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
TEXT = "A short answer of eighty bytes: some twenty tokens at four bytes each, as billed"
REPORTED = Usage(input_tokens=12, output_tokens=20)
# An OpenAI chat completion as the fakes write it (JSON with spaces after commas and colons).
BODY = json.dumps(
    {
        "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "object": "chat.completion",
        "created": 1764880000,
        "model": "gpt-4o-mini",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": TEXT},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 20, "total_tokens": 32},
    }
).encode()
HEAD = http_head(extra=f"content-length: {len(BODY)}\r\n")
# What an OpenAI answer holds besides its text, the estimate's envelope (gpt-4o-mini upstream).
OPENAI = PROVIDERS["openai"]
ENVELOPE = len(OPENAI.empty_answer("gpt-4o-mini"))
# raw-model's price (tests.routing.routed.RAW_MODEL), in pico-USD per token.
PICO_IN, PICO_OUT = 150_000, 600_000

EXTRA_ROUTES = f"""\
  - {{name: hedged-raw, hedge: {{delay: 0.1}}, candidates: [{{model: raw-model}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: raw-hedges, hedge: {{delay: 0.1}}, candidates: [{{model: gpt-4o-mini}}, {{model: raw-model}}], {FAST}}}
"""


def tokens(size: int) -> int:
    return -(-size // BYTES_PER_TOKEN)


# What the prompt's estimate adds to a chat of one turn, as every request here with messages is, for its chat
# template (`estimate.template_tokens`).
ONE_TURN = CHAT_TOKENS + MESSAGE_TOKENS


class Script:
    """The raw backend's answer: a chat completion's headers at once, and its body once the router
    abandons the attempt (`abandoned`), once the test releases it (`released`), or never (`never`: it
    hangs until the gateway lets the connection go, or the backend stops); or (`cut`) half its body,
    then the connection closes."""

    def __init__(self) -> None:
        self.body: Literal["abandoned", "released", "never", "cut"] = "abandoned"
        self.abandoned = threading.Event()
        self.released = threading.Event()

    def reset(self) -> None:
        self.body = "abandoned"
        self.abandoned.clear()
        self.released.clear()

    def __call__(self, send: Send, sleep: Sleep) -> None:
        if self.body == "cut":
            send(HEAD + BODY[: len(BODY) // 2])
            return
        send(HEAD)
        if self.body == "never":
            sleep(30)
        elif (self.abandoned if self.body == "abandoned" else self.released).wait(10):
            send(BODY)


@dataclass
class Abandons:
    """When each `routing.execute._abandon` began and how long it took: how long a hedge race's winner
    waits for its loser to end (its usage event may come later, `Pipeline.background`)."""

    started: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    begun: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return ROUTES + EXTRA_ROUTES


@pytest.fixture(scope="module")
def raw_script() -> Script:
    return Script()


@pytest.fixture
def abandons(raw: Script, monkeypatch: pytest.MonkeyPatch) -> Abandons:
    """`_abandon` timed, and telling the raw backend it may send its body: the loser's cancellation is
    requested, in the gateway loop's step that does it, before the body can be read."""
    timed = Abandons()
    abandon = execute._abandon

    async def timed_abandon(task: asyncio.Future[Any]) -> None:
        raw.abandoned.set()
        started = time.perf_counter()
        timed.started.append(started)
        timed.begun.set()
        try:
            await abandon(task)
        finally:
            timed.seconds.append(time.perf_counter() - started)
            timed.ended.set()

    monkeypatch.setattr(execute, "_abandon", timed_abandon)
    return timed


def hedge_wins(gateway: RunningGateway) -> None:
    """One non-streamed request to `hedged-raw`, which the hedge (the fake OpenAI) wins."""
    response = gateway.openai().chat.completions.with_raw_response.create(model="hedged-raw", messages=HI)
    assert response.parse().choices[0].message.content == PROMPT
    assert route_header(response)["hedged"] == "gpt-4o-mini"


def race_events(gateway: RunningGateway) -> tuple[Any, Any]:
    """The usage events of a hedge race's loser and its winner, once both are recorded."""
    settled(gateway, 2)
    loser, winner = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert (loser.backend, loser.status, winner.backend, winner.status) == ("raw", 499, "openai", 200)
    return loser, winner


def hedged_race(gateway: RunningGateway, abandons: Abandons) -> tuple[Any, Any]:
    """One non-streamed request the hedge wins; the usage events of its loser and its winner, once the
    loser's abandonment ended."""
    hedge_wins(gateway)
    assert abandons.ended.wait(10)
    return race_events(gateway)


def test_a_hedge_that_lost_after_its_status_line_is_billed_its_vendors_report(
    gateway: RunningGateway, abandons: Abandons
) -> None:
    loser, winner = hedged_race(gateway, abandons)
    assert (loser.usage, loser.estimated) == (REPORTED, False)
    assert loser.cost_pico_usd == 12 * PICO_IN + 20 * PICO_OUT
    assert not winner.estimated and winner.usage.output_tokens == 6
    # The winner waited a moment for its loser to end, not for CUT_ANSWER_WAIT.
    [held] = abandons.seconds
    assert held < CUT_ANSWER_WAIT, held


def test_a_hedge_that_lost_after_its_status_line_whose_body_never_came_is_billed_an_estimate(
    gateway: RunningGateway, raw: Script, abandons: Abandons, fake_openai: FakeOpenAI
) -> None:
    raw.body = "never"
    loser, _ = hedged_race(gateway, abandons)
    assert loser.estimated
    # The prompt from the request (the same body the hedge sent: both are OpenAI backends asked for
    # gpt-4o-mini); the output from the announced length less what an OpenAI answer holds besides its
    # text, at 4 bytes per token: about the 20 tokens of its 80 bytes of text (high by the spaces after
    # its commas and colons), where the whole length billed five times that.
    sent = fake_openai.last_request.body
    output = tokens(len(BODY) - ENVELOPE)
    assert loser.usage == Usage(input_tokens=tokens(len(sent)) + ONE_TURN, output_tokens=output)
    assert REPORTED.output_tokens <= output <= REPORTED.output_tokens + 8 < tokens(len(BODY)) // 3
    assert loser.cost_pico_usd == loser.usage.input_tokens * PICO_IN + loser.usage.output_tokens * PICO_OUT
    # Its event waited for the body (CUT_ANSWER_WAIT); the winner did not.
    [held] = abandons.seconds
    assert held < CUT_ANSWER_WAIT, held


def test_a_hedge_that_lost_while_its_body_was_awaited_is_an_attempt_of_the_header_and_names_its_own_candidate(
    gateway: RunningGateway, raw: Script, abandons: Abandons
) -> None:
    """The loser's usage event is recorded in the background (its body is still awaited when the
    race is decided). It was taken for an attempt the gateway never sent: `x-weir-route` said
    `attempts=1` beside two ledger rows, without the loser in `tried`, and the loser's row carried the
    final decision, naming the winner's candidate, instead of its own."""
    raw.body = "never"
    response = gateway.openai().chat.completions.with_raw_response.create(model="hedged-raw", messages=HI)
    header = route_header(response)
    assert (header["candidate"], header["hedged"]) == ("gpt-4o-mini", "gpt-4o-mini")
    assert header["attempts"] == "2"
    assert header["tried"] == "gpt-4o-mini:ok,raw-model:cancelled"
    assert abandons.ended.wait(10)
    loser, winner = race_events(gateway)
    assert {loser.request_id, winner.request_id} == {response.headers["x-request-id"]}
    assert route_header(SimpleNamespace(headers={"x-weir-route": loser.routing}))["candidate"] == "raw-model"
    assert (
        route_header(SimpleNamespace(headers={"x-weir-route": winner.routing}))["candidate"] == "gpt-4o-mini"
    )


def test_a_hedge_races_winner_answers_without_waiting_for_its_losers_body(
    gateway: RunningGateway, raw: Script, abandons: Abandons, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loser's body comes only once the test releases it, after the answer; meanwhile its attempt
    # waits for it (for its vendor's usage report), here up to 5 s: an answer that waited for the
    # loser to end would come that late, billed an estimate.
    raw.body = "released"
    monkeypatch.setattr(pipeline, "CUT_ANSWER_WAIT", 5.0)
    hedge_wins(gateway)
    answered = time.perf_counter()
    assert abandons.begun.wait(10)
    [abandoned] = abandons.started
    assert answered - abandoned < CUT_ANSWER_WAIT, answered - abandoned
    assert [event.backend for event in gateway.sink.events] == ["openai"]  # the loser still waits
    raw.released.set()
    # The loser still ends, and is billed what its vendor reported.
    loser, _ = race_events(gateway)
    assert (loser.usage, loser.estimated) == (REPORTED, False)


def test_a_losers_event_recorded_before_the_answer_went_out_leaves_the_request_without_an_error(
    gateway: RunningGateway, raw: Script, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loser's usage event is recorded in the background once its body comes, here after the
    hedge took the race and before the answer goes out (the test holds the answer until then). Its
    `cancelled` became the request's error, which the race's end had cleared: the log line of a
    request answered 200, with the winner's backend and usage, said error=cancelled. The loser is
    still recorded as the 499 it is."""
    raw.body = "released"
    monkeypatch.setattr(pipeline, "CUT_ANSWER_WAIT", 5.0)
    executor, background = runtime(gateway).executor, runtime(gateway).pipeline.background
    first = executor.first

    async def answered_once_the_loser_is_recorded(*args: Any, **kwargs: Any) -> Any:
        result = await first(*args, **kwargs)
        raw.released.set()
        await background.drain()
        return result

    monkeypatch.setattr(executor, "first", answered_once_the_loser_is_recorded)
    with capture_logs() as logs:
        hedge_wins(gateway)
        deadline = time.monotonic() + 5  # the line is written once the response's last byte is sent
        while not any(e["event"] == "request" for e in logs) and time.monotonic() < deadline:
            time.sleep(0.01)
    [line] = [e for e in logs if e["event"] == "request"]
    assert (line["status"], line["backend"], line["error"]) == (200, "openai", None)
    loser, winner = race_events(gateway)
    assert (loser.error, winner.error) == ("cancelled", None)


def test_a_hedge_that_lost_counts_what_it_cost_against_the_hedge_allowance(
    gateway: RunningGateway, raw: Script, fake_openai: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The primary (the fake OpenAI, 0.3 s) answers after the hedge (the raw backend) sent its headers
    # at the hedge delay (0.1 s); the hedge's body never comes, and it is billed an estimate once the
    # answer went out. The allowance counts that, not nothing.
    cap = SpendCap("hedge")
    monkeypatch.setattr(runtime(gateway).executor, "hedges", cap)
    raw.body = "never"
    fake_openai.set_latency(first_token=0.3)
    response = gateway.openai().chat.completions.with_raw_response.create(model="raw-hedges", messages=HI)
    assert route_header(response)["hedged"] == "raw-model"
    settled(gateway, 2)
    winner, hedge = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert (winner.backend, winner.status, hedge.backend, hedge.status) == ("openai", 200, "raw", 499)
    assert hedge.estimated and hedge.cost_pico_usd > 10_000_000
    background = runtime(gateway).pipeline.background
    deadline = time.monotonic() + 5
    while background.tasks and time.monotonic() < deadline:  # it settles just after its event
        time.sleep(0.01)
    assert counted_micro_usd(cap, "demo", "raw-hedges", round(hedge.cost_pico_usd / 1e6), 1)


async def test_the_gateway_stops_once_the_usage_events_it_owes_are_recorded(
    _fake_openai_server: FakeOpenAI, _raw_backend: RawBackend | None
) -> None:
    assert _raw_backend is not None
    env = fakes_env(_fake_openai_server, _fake_openai_server, _fake_openai_server, _fake_openai_server)
    stopping = Gateway(parse_config(raw_config_text(ROUTES), env | {"RAW_URL": _raw_backend.url}))
    recorded: list[str] = []

    async def record_later() -> None:  # an attempt waiting for its body as the gateway stops
        await asyncio.sleep(0.1)
        recorded.append("event")

    stopping.pipeline.background.start(record_later())
    await stopping.stop()
    assert recorded == ["event"] and not stopping.pipeline.background.tasks


def test_a_whole_answer_whose_body_broke_off_is_billed_an_estimate(
    gateway: RunningGateway, raw: Script
) -> None:
    # The vendor generated the whole answer (its status line came) and bills it; half its body came.
    raw.body = "cut"
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().chat.completions.create(model="raw-model", messages=HI)
    assert caught.value.status_code == 502
    settled(gateway, 1)
    [event] = gateway.sink.events
    assert (event.backend, event.status, event.estimated) == ("raw", 502, True)
    assert event.usage.output_tokens == tokens(len(BODY) - ENVELOPE)  # its announced length
    assert event.usage.input_tokens > 0
    assert event.cost_pico_usd == event.usage.input_tokens * PICO_IN + event.usage.output_tokens * PICO_OUT


async def test_what_was_read_of_a_chunked_body_that_stalled_is_its_known_size() -> None:
    piece = BODY[:100]

    def script(send: Send, sleep: Sleep) -> None:
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        send(http_head(extra="transfer-encoding: chunked\r\n") + chunk)
        sleep(30)

    timeouts = Timeouts(read=0.3)
    transport = Transport()
    with RawBackend(script) as backend:
        try:
            response = await transport.send(
                UpstreamRequest(f"{backend.url}/chat/completions", {}, b"{}"), timeouts, "raw"
            )
            with pytest.raises(GatewayTimeout):
                await transport.read(response, timeouts, "raw", MAX_RESPONSE_BODY)
        finally:
            await transport.close()
    assert body_size(response) == len(piece)


def test_every_vendors_envelope_is_an_answer_of_its_own_with_no_text() -> None:
    """Gemini's (an empty STOP) is read as an answer where one may be empty (a request with stop
    sequences); elsewhere it is a failed attempt, which the envelope's size does not depend on."""
    for provider in PROVIDERS.values():
        body = provider.empty_answer("some-model")
        if provider.name == "gemini":
            answer = gemini.chat_response(body, "some-model", may_be_empty=True)
        else:
            answer = provider.chat_response(body, "some-model")
        assert [choice.message.content for choice in answer.choices] in ([""], [None]), provider.name


def _request(**fields: Any) -> bytes:
    return json.dumps({"model": "gpt-4o-mini", "messages": [], **fields}).encode()


@pytest.mark.parametrize(
    ("endpoint", "status", "request_body", "headers", "received", "output"),
    [
        # An answer's length, uncompressed: its text is what is left of it past the envelope.
        ("chat", 200, _request(), {"content-length": str(ENVELOPE + 80)}, 0, 20),
        ("chat", 200, _request(), {"content-length": str(ENVELOPE - 50)}, 0, 0),  # never below 0
        # Never above what the request allowed: its cap for every choice.
        ("chat", 200, _request(max_tokens=5), {"content-length": str(ENVELOPE + 80)}, 0, 5),
        ("chat", 200, _request(max_tokens=50, n=2), {"content-length": str(ENVELOPE + 800)}, 0, 100),
        # Chunked: what was read of it (decompressed), the least it is.
        ("chat", 200, _request(), {}, ENVELOPE + 40, 10),
        # Compressed: its length counts compressed bytes, the least it is, unless more was read.
        ("chat", 200, _request(), {"content-length": str(ENVELOPE + 40), "content-encoding": "gzip"}, 0, 10),
        (
            "chat",
            200,
            _request(),
            {"content-length": str(ENVELOPE + 40), "content-encoding": "gzip"},
            ENVELOPE + 120,
            30,
        ),
        # Chunked, none of it read: what the request allowed, as admission reserved it.
        ("chat", 200, _request(max_tokens=64, n=2), {}, 0, 128),
        ("chat", 200, _request(), {}, 0, DEFAULT_OUTPUT_ESTIMATE),
        ("embeddings", 200, _request(), {"content-length": "100"}, 0, 0),  # vectors: no output tokens
        ("count_tokens", 200, _request(), {"content-length": "100"}, 0, None),  # counting is free
        ("chat", 500, _request(), {"content-length": "100"}, 0, None),  # an error bills nothing
    ],
)
async def test_what_an_answer_whose_body_was_not_read_is_billed(
    endpoint: str,
    status: int,
    request_body: bytes,
    headers: dict[str, str],
    received: int,
    output: int | None,
) -> None:
    async def broken() -> bytes:
        raise BadGateway("the response ended before it was complete")

    reading = asyncio.ensure_future(broken())
    call = Call(RequestInfo("req"), SimpleNamespace(), endpoint)  # type: ignore[arg-type]
    target = SimpleNamespace(
        provider=OPENAI, upstream_model="gpt-4o-mini", backend=SimpleNamespace(name="raw")
    )
    upstream = SimpleNamespace(body=request_body)
    response = SimpleNamespace(status=status, headers=headers, received=received)
    billed = await _cut_answer(call, target, upstream, None, response, reading)  # type: ignore[arg-type]
    if output is None:
        assert billed == (Usage(), False)
    else:
        assert billed == (Usage(input_tokens=tokens(len(request_body)), output_tokens=output), True)


async def test_an_answer_not_read_bills_an_image_sent_inline_as_an_image_not_its_base64() -> None:
    """The prompt's estimate counts an inline image one allowance (`estimate.prompt_tokens`), as
    admission does: its 120 kB of base64 at 4 bytes a token were 30,000 input tokens."""
    image = "data:image/png;base64," + base64.b64encode(bytes(90_000)).decode()
    parts = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": image}}]
    request_body = _request(messages=[{"role": "user", "content": parts}], max_tokens=5)

    async def broken() -> bytes:
        raise BadGateway("the response ended before it was complete")

    call = Call(RequestInfo("req"), SimpleNamespace(), "chat")  # type: ignore[arg-type]
    target = SimpleNamespace(
        provider=OPENAI, upstream_model="gpt-4o-mini", backend=SimpleNamespace(name="raw")
    )
    upstream = SimpleNamespace(body=request_body)
    response = SimpleNamespace(status=200, headers={"content-length": str(ENVELOPE + 80)}, received=0)
    billed = await _cut_answer(call, target, upstream, None, response, asyncio.ensure_future(broken()))  # type: ignore[arg-type]
    prompt = tokens(len(request_body) - len(image)) + INLINE_PART_TOKENS + ONE_TURN
    assert billed == (Usage(input_tokens=prompt, output_tokens=5), True)
