"""A whole (non-streamed) answer cancelled after its status line arrived, before its body was read,
through a real routed gateway with the official OpenAI SDK as client (docs/reliability.md, "Answers
cut short: what gets billed").

The status line of a non-streamed answer comes once the vendor generated all of it, which it bills.
A hedge race's loser cancelled then (its partner took the race a moment earlier), or an attempt whose
client left, was billed nothing: 0 tokens, not estimated. It is billed its vendor's own report when
the body comes within a moment (`CUT_ANSWER_WAIT`), else an estimate, marked `estimated`.

The loser is a raw backend (tests/reliability/raw_backend.py) that sends its headers at once and its
body only once the router abandons it, or never: the hedge (the fake OpenAI) wins the race after the
hedge delay, and the cancellation lands while the loser waits for its body, whatever the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.errors import BadGateway
from gateway.estimate import BYTES_PER_TOKEN
from gateway.pipeline import CUT_ANSWER_WAIT, Call, RequestInfo, _cut_answer
from gateway.usage import Usage
from routing import execute
from tests.fakes import FakeOpenAI
from tests.gateway.conftest import RunningGateway
from tests.reliability.raw_backend import Send, Sleep, http_head
from tests.routing.routed import FAST, ROUTES, route_header, settled

PROMPT = "one two three four five six"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
REPORTED = Usage(input_tokens=12, output_tokens=34)
BODY = json.dumps(
    {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "created": 0,
        "model": "gpt-4o-mini",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "late"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46},
    }
).encode()
HEAD = http_head(extra=f"content-length: {len(BODY)}\r\n")
# raw-model's price (tests.routing.routed.RAW_MODEL), in pico-USD per token.
PICO_IN, PICO_OUT = 150_000, 600_000

EXTRA_ROUTES = f"""\
  - {{name: hedged-raw, hedge: {{delay: 0.1}}, candidates: [{{model: raw-model}}, {{model: gpt-4o-mini}}], {FAST}}}
"""


class Script:
    """The raw backend's answer: a chat completion's headers at once, and its body once the router
    abandons the attempt (`abandoned`), or never (`send_body` False: it hangs until the gateway lets
    the connection go, or the backend stops)."""

    send_body: bool

    def __init__(self) -> None:
        self.abandoned = threading.Event()
        self.reset()

    def reset(self) -> None:
        self.send_body = True
        self.abandoned.clear()

    def __call__(self, send: Send, sleep: Sleep) -> None:
        send(HEAD)
        if not self.send_body:
            sleep(30)
            return
        if self.abandoned.wait(10):
            send(BODY)


@dataclass
class Abandons:
    """How long each `routing.execute._abandon` took: the time a hedge race's winner waits for its
    loser to end before its answer goes to the client."""

    seconds: list[float] = field(default_factory=list)


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
        try:
            await abandon(task)
        finally:
            timed.seconds.append(time.perf_counter() - started)

    monkeypatch.setattr(execute, "_abandon", timed_abandon)
    return timed


def hedged_race(gateway: RunningGateway) -> tuple[Any, Any]:
    """One non-streamed request the hedge wins; the usage events of its loser and its winner."""
    response = gateway.openai().chat.completions.with_raw_response.create(model="hedged-raw", messages=HI)
    assert response.parse().choices[0].message.content == PROMPT
    assert route_header(response)["hedged"] == "gpt-4o-mini"
    settled(gateway, 2)
    loser, winner = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert (loser.backend, loser.status, winner.backend, winner.status) == ("raw", 499, "openai", 200)
    return loser, winner


def test_a_hedge_that_lost_after_its_status_line_is_billed_its_vendors_report(
    gateway: RunningGateway, abandons: Abandons
) -> None:
    loser, winner = hedged_race(gateway)
    assert (loser.usage, loser.estimated) == (REPORTED, False)
    assert loser.cost_pico_usd == 12 * PICO_IN + 34 * PICO_OUT
    assert not winner.estimated and winner.usage.output_tokens == 6
    # The winner's answer waited for the loser's body, which came at once, not for CUT_ANSWER_WAIT.
    [held] = abandons.seconds
    assert held < CUT_ANSWER_WAIT, held


def test_a_hedge_that_lost_after_its_status_line_whose_body_never_came_is_billed_an_estimate(
    gateway: RunningGateway, raw: Script, abandons: Abandons, fake_openai: FakeOpenAI
) -> None:
    raw.send_body = False
    loser, _ = hedged_race(gateway)
    assert loser.estimated
    # The prompt from the request (the same body the hedge sent: both are OpenAI backends asked for
    # gpt-4o-mini), the output from the announced length, at 4 bytes per token.
    sent = fake_openai.last_request.body
    assert loser.usage == Usage(
        input_tokens=-(-len(sent) // BYTES_PER_TOKEN), output_tokens=-(-len(BODY) // BYTES_PER_TOKEN)
    )
    assert loser.cost_pico_usd == loser.usage.input_tokens * PICO_IN + loser.usage.output_tokens * PICO_OUT
    # The cancellation waited for the body that long, no longer (slack for a loaded machine).
    [held] = abandons.seconds
    assert held < CUT_ANSWER_WAIT + 0.5, held


@pytest.mark.parametrize(
    ("endpoint", "status", "billed", "estimated"),
    [
        ("chat", 200, Usage(input_tokens=3, output_tokens=25), True),
        ("embeddings", 200, Usage(input_tokens=3), True),  # vectors: no output tokens
        ("count_tokens", 200, Usage(), False),  # counting is free
        ("chat", 500, Usage(), False),  # an error bills nothing
    ],
)
async def test_what_an_answer_whose_body_was_not_read_is_billed(
    endpoint: str, status: int, billed: Usage, estimated: bool
) -> None:
    async def broken() -> bytes:
        raise BadGateway("the response ended before it was complete")

    reading = asyncio.ensure_future(broken())
    call = Call(RequestInfo("req"), SimpleNamespace(), endpoint)  # type: ignore[arg-type]
    upstream = SimpleNamespace(body=b"0123456789")
    response = SimpleNamespace(status=status, headers={"content-length": "100"})
    usage = await _cut_answer(call, None, upstream, None, response, reading)  # type: ignore[arg-type]
    assert usage == (billed, estimated)
