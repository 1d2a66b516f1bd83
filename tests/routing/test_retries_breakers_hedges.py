"""Retries, breakers and hedging at their edges, through a real gateway with the official SDK as client.

The fake vendors send `retry-after` only as whole seconds; a scripted backend (tests/reliability
raw_backend.py) sends what they cannot: an HTTP date, `retry-after-ms`, a value that is not a number.
A wait the client would not live through (past the timeout its SDK states in
`x-stainless-read-timeout`) is not waited for. A route's own `ttft_timeout` fails over whatever its
`failover_on` lists. For each case: what the client sees, which backends were tried (x-weir-route,
the backends' request counts) and what the ledger holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import email.utils
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import openai
import pytest

from gateway.accounting.events import UsageEvent
from gateway.api.common import client_timeout
from gateway.config import parse_config
from gateway.errors import UpstreamError
from gateway.state import MemoryState
from gateway.state.degradable import DegradableState
from gateway.state.redis import RedisState
from gateway.usage import Usage
from routing import execute
from routing.breaker import Breakers, CircuitBreaker, State
from routing.execute import HOUR, SpendCap, retry_after
from routing.routes import Breaker as BreakerSettings
from routing.stats import WINDOW, ModelStats
from tests.control.helpers import TcpProxy
from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fakes.plugin import FakeVendors
from tests.fixtures.db import REDIS_URL
from tests.fixtures.vendor_gateway import RunningGateway
from tests.reliability.raw_backend import Send, Sleep, http_head
from tests.routing.routed import (
    FAST,
    ROUTES,
    counted_micro_usd,
    fresh,
    ledger,
    route_header,
    routed_gateway,
    runtime,
    settled,
)

HI = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"

EXTRA_ROUTES = f"""\
  - {{name: raw-first, candidates: [{{model: raw-model}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: raw-hedged, hedge: {{delay: 0.15}}, candidates: [{{model: raw-model}}, {{model: deepseek-chat}}], {FAST}}}
  - {{name: raw-hedged-sonnet, hedge: {{delay: 0.15}}, candidates: [{{model: raw-model}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: hedged-p95, hedge: {{delay: p95}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
  - {{name: hedged-p95-ttft, ttft_timeout: 0.5, hedge: {{delay: p95}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
  - {{name: hedged-tight, hedge: {{delay: 0.1, max_spend_usd_per_hour: 0.035}}, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: hedged-tight-too, hedge: {{delay: 0.1, max_spend_usd_per_hour: 0.035}}, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: gpt5-first, candidates: [{{model: gpt-5}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: hedge-slow-ttft, ttft_timeout: 0.4, hedge: {{delay: 1.2}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
  - {{name: impatient-429, ttft_timeout: 0.3, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}, failover_on: [429]}}
  - {{name: patient, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], retry: {{attempts: 2, backoff: 0.02, max_backoff: 0.1, max_retry_after: 10}}, breaker: {{failures: 3, cooldown: 0.5}}, probe_interval: null}}
"""
# A route with breaker settings of its own beside routes that wait longer on its model. A gateway of
# their own: the breakers they share take the most protective of their settings (2 failures, 30 s),
# which the other tests here must not get.
TIGHT_ROUTES = f"""\
routes:
  - {{name: resilient, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: impatient-route, ttft_timeout: 0.3, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: tight, ttft_timeout: 0.3, retry: {{attempts: 1}}, breaker: {{failures: 2, cooldown: 30}}, probe_interval: null, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}]}}
"""
OK_BODY = (
    b'{"id": "chatcmpl-raw", "object": "chat.completion", "created": 0, "model": "gpt-4o-mini",'
    b' "choices": [{"index": 0, "message": {"role": "assistant", "content": "raw answer"},'
    b' "finish_reason": "stop"}], "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}}'
)
RATE_LIMITED = b'{"error": {"message": "slow down", "type": "rate_limit_error", "code": null}}'


class Script:
    """What the raw backend answers: `answers[i]` for its i-th request (the last one from then on)."""

    answers: list[bytes]
    calls: int
    delay: float  # before each answer

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.answers, self.calls, self.delay = [http_head() + OK_BODY], 0, 0.0

    def __call__(self, send: Send, sleep: Sleep) -> None:
        with self.lock:
            answer = self.answers[min(self.calls, len(self.answers) - 1)]
            self.calls += 1
        sleep(self.delay)
        send(answer)


def limited(headers: str) -> bytes:
    return http_head(429, extra=headers) + RATE_LIMITED


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return ROUTES + EXTRA_ROUTES


@pytest.fixture(scope="module")
def raw_script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def _tight(fake_vendors: FakeVendors) -> Iterator[RunningGateway]:
    with routed_gateway(fake_vendors, TIGHT_ROUTES) as gateway:
        yield gateway


@pytest.fixture
def tight_routes(_tight: RunningGateway, fresh_fakes: None) -> RunningGateway:
    """The gateway of TIGHT_ROUTES with fresh fakes, closed breakers and an empty ledger."""
    return fresh(_tight)


def hedge_counts(gateway: RunningGateway, route: str) -> Callable[[], dict[str, float]]:
    """What `route`'s weir_route_hedges_total has counted since this call, by result."""
    counter = runtime(gateway).executor.metrics.hedges  # type: ignore[union-attr]
    results = ("started", "won", "unsupported")
    before = {result: counter.labels(route, result)._value.get() for result in results}
    return lambda: {result: counter.labels(route, result)._value.get() - before[result] for result in results}


def chat(
    gateway: RunningGateway, model: str, timeout: float = 20, **kwargs: Any
) -> tuple[str, dict[str, str]]:
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key=gateway.openai().api_key, max_retries=0, timeout=timeout
    )
    raw = client.chat.completions.with_raw_response.create(model=model, messages=HI, **kwargs)  # type: ignore[arg-type]
    return raw.parse().choices[0].message.content or "", route_header(raw)


# --- retry-after ------------------------------------------------------------------------------------


def test_an_http_date_retry_after_beyond_max_retry_after_fails_over_at_once(
    gateway: RunningGateway, raw: Script
) -> None:
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    raw.answers = [limited(f"retry-after: {later}\r\n")]
    text, route = chat(gateway, "raw-first")
    assert text == ECHO and route["tried"] == "raw-model:429,claude-sonnet:ok"
    assert raw.calls == 1  # told to wait a minute: not asked again a moment later
    assert ledger(gateway) == [("raw", 429), ("anthropic", 200)]


def test_a_retry_after_that_is_not_a_number_never_hangs_the_request(
    gateway: RunningGateway, raw: Script
) -> None:
    raw.answers = [limited("retry-after: NaN\r\n"), http_head() + OK_BODY]
    started = time.monotonic()
    text, route = chat(gateway, "raw-first", timeout=5)
    assert text == "raw answer" and route["tried"] == "raw-model:429,raw-model:ok"
    assert time.monotonic() - started < 3
    assert ledger(gateway) == [("raw", 429), ("raw", 200)]


def test_retry_after_ms_is_honoured_before_retry_after(gateway: RunningGateway, raw: Script) -> None:
    """OpenAI sends both; the milliseconds are the precise one."""
    raw.answers = [limited("retry-after-ms: 300\r\nretry-after: 30\r\n"), http_head() + OK_BODY]
    started = time.monotonic()
    text, route = chat(gateway, "raw-first")
    waited = time.monotonic() - started
    assert text == "raw answer" and route["tried"] == "raw-model:429,raw-model:ok"
    assert 0.3 <= waited < 5  # the 300 ms were waited, not the 30 s (which would have failed over)
    assert ledger(gateway) == [("raw", 429), ("raw", 200)]


def test_a_retry_after_past_the_clients_own_timeout_is_not_waited_for(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The SDKs say how long they wait (`x-stainless-read-timeout`). A 429 asking for 3 s, within the
    route's `max_retry_after` of 10 s, was waited for although the client gives up after 1.5 s: it
    timed out while the next candidate could have answered at once."""
    fake_openai.fail_next(Fault.status(429, retry_after=3))
    started = time.monotonic()
    text, route = chat(gateway, "patient", timeout=1.5)
    assert text == ECHO and route["tried"] == "gpt-4o-mini:429,claude-sonnet:ok"
    assert time.monotonic() - started < 1.5
    assert len(fake_openai.requests) == 1


@pytest.mark.parametrize("stated", ["0", "-3", "inf", "nan", "soon"])
def test_a_client_timeout_that_is_no_timeout_leaves_the_retry_after_wait_alone(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, stated: str
) -> None:
    """A stated timeout that says nothing usable is no reason to leave a backend that asked for a
    second: it is waited for, and the same backend answers."""
    fake_openai.fail_next(Fault.status(429, retry_after=1))
    started = time.monotonic()
    text, route = chat(gateway, "patient", extra_headers={"x-stainless-read-timeout": stated})
    assert text == ECHO and route["tried"] == "gpt-4o-mini:429,gpt-4o-mini:ok"
    assert time.monotonic() - started >= 1
    assert not fake_anthropic.requests


def test_client_timeouts_the_gateway_reads() -> None:
    assert client_timeout("1.5") == 1.5 and client_timeout("600") == 600.0
    for unusable in (None, "", "soon", "0", "-1", "inf", "1e999", "nan"):
        assert client_timeout(unusable) is None


def _waits(headers: dict[str, str]) -> float | None:
    return retry_after(UpstreamError("slow down", status=429, headers=headers))


def test_retry_after_values_the_executor_reads() -> None:
    assert _waits({"retry-after": "2"}) == 2.0
    assert _waits({"Retry-After": "0.25"}) == 0.25  # a fraction, and any case
    assert _waits({"retry-after-ms": "1500", "retry-after": "30"}) == 1.5
    # A garbled retry-after-ms does not hide a usable retry-after.
    assert _waits({"retry-after-ms": "soon", "retry-after": "3"}) == 3.0
    in_a_minute = _waits({"retry-after": email.utils.formatdate(time.time() + 60, usegmt=True)})
    assert in_a_minute is not None and 55 <= in_a_minute <= 61
    assert _waits({"retry-after": email.utils.formatdate(time.time() - 60, usegmt=True)}) == 0.0
    for unusable in ("NaN", "-5", "soon", ""):  # our own backoff instead
        assert _waits({"retry-after": unusable}) is None
    assert _waits({}) is None


# --- breakers ---------------------------------------------------------------------------------------


def test_a_half_open_trial_whose_client_left_after_its_first_token_leaves_the_breaker_closed(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """The half-open trial is a stream the client walks away from after its first token. That token
    was the trial's verdict (the backend answered): the breaker is closed, and the client leaving
    says nothing more, so the next request goes to the backend as to any."""
    breakers = runtime(gateway).router.breakers
    key = "openai/gpt-4o-mini"
    settings = runtime(gateway).router.routes["resilient"][0].breaker  # cooldown 0.5 s
    breakers.get(key, settings).trip(now=time.monotonic() - 1)
    assert breakers.state(key) == "half_open"
    fake_openai.fail_next(Fault.slow_stream(0.2))
    stream = gateway.openai().chat.completions.create(model="resilient", messages=HI, stream=True)
    assert next(iter(stream)).choices  # the trial answered its first token...
    stream.close()  # ...and its client left
    settled(gateway, 1)
    assert ledger(gateway) == [("openai", 499)]
    assert breakers.state(key) == "closed"
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and "tried" not in route
    assert breakers.state(key) == "closed"


@pytest.mark.parametrize("stream", [False, True])
def test_the_ledger_row_says_which_candidates_were_skipped_as_the_header_does(
    tight_routes: RunningGateway, stream: bool
) -> None:
    """The first candidate's breaker is open and the second answers: `x-weir-route` said
    `tried=gpt-4o-mini:open,...`, while the answering attempt's ledger row, written as its attempt
    was under way, dropped the lone skip (tried entries were shown from two on)."""
    gateway = tight_routes
    runtime(gateway).router.breakers.get("openai/gpt-4o-mini").trip()
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="resilient", messages=HI, stream=stream
    )
    if stream:
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    header = raw.headers["x-weir-route"]
    settled(gateway, 1)
    [event] = gateway.sink.events
    assert event.backend == "anthropic" and event.routing is not None
    assert "candidate=claude-sonnet" in event.routing and "tried=gpt-4o-mini:open" in event.routing
    # The row is the decision as its attempt stood (its own outcome is the row's status); the header
    # goes out once that attempt answered (a stream: its first token), which it notes too.
    assert header == event.routing + ",claude-sonnet:ok"


def test_a_streamed_half_open_trial_gives_its_verdict_at_its_first_token(
    tight_routes: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The half-open trial is a long, slow stream. Its first token shows the backend answers: that
    closes the breaker (30 s cooldown here), so a request sent while the stream still runs goes to the
    backend too. The breaker waited for the stream's end, and sent every request meanwhile to the
    next candidate (`tried=gpt-4o-mini:open`) for the whole generation."""
    gateway = tight_routes
    breakers = runtime(gateway).router.breakers
    key = "openai/gpt-4o-mini"
    breakers.get(key).trip(now=time.monotonic() - 31)
    assert breakers.state(key) == "half_open"
    fake_openai.fail_next(Fault.slow_stream(0.4))  # six words: about 2.4 s of stream
    stream = gateway.openai().chat.completions.create(model="resilient", messages=HI, stream=True)
    chunks = iter(stream)
    first = next(c for c in chunks if c.choices and c.choices[0].delta.content)  # the trial's first token
    text, route = chat(gateway, "resilient")  # while the trial streams on
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and "tried" not in route, route
    assert breakers.state(key) == "closed"
    assert not fake_anthropic.requests
    rest = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (first.choices[0].delta.content or "") + rest == ECHO  # the trial streamed to its end
    assert breakers.state(key) == "closed"


@pytest.mark.parametrize("answer", ["first_token", "stream_end", "whole"])
def test_a_request_let_through_before_the_breaker_opened_does_not_close_it_when_it_answers(
    tight_routes: RunningGateway, fake_openai: FakeOpenAI, answer: str
) -> None:
    """A request goes to the backend while its breaker is closed; before it answers (a stream's first
    token, a stream's end, a whole answer), other requests' failures open the breaker. Its answer was
    no half-open trial: it closes nothing, and the next request skips the backend for the cooldown
    (30 s here). It closed the breaker (a stream's first token did so wherever the breaker was not
    closed), sending the next requests back to a backend that had just failed the latest ones."""
    gateway = tight_routes
    breakers = runtime(gateway).router.breakers
    key = "openai/gpt-4o-mini"
    if answer == "stream_end":
        fake_openai.fail_next(Fault.slow_stream(0.1))
    else:
        fake_openai.set_latency(first_token=0.4)

    def ask() -> str:
        if answer == "whole":
            return chat(gateway, "resilient")[0]
        stream = gateway.openai().chat.completions.create(model="resilient", messages=HI, stream=True)
        chunks = iter(stream)
        first = next(c for c in chunks if c.choices and c.choices[0].delta.content)
        if answer == "stream_end":
            breakers.get(key).trip()  # after its first token, before its end
        return (first.choices[0].delta.content or "") + "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices
        )

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(ask)
        if answer != "stream_end":
            deadline = time.monotonic() + 5
            while not fake_openai.posts:  # sent while the breaker was closed...
                assert time.monotonic() < deadline
                time.sleep(0.01)
            breakers.get(key).trip()  # ...and opened before it answers
        assert asked.result(timeout=10) == ECHO
    assert breakers.state(key) == "open"
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:open,claude-sonnet:ok"


@pytest.mark.parametrize("answer", ["first_token", "whole"])
def test_a_trial_let_through_before_the_breaker_opened_again_does_not_close_it_when_it_answers(
    tight_routes: RunningGateway, fake_openai: FakeOpenAI, answer: str
) -> None:
    """The breaker (30 s cooldown) is half-open and request A goes as its trial. A is slow: silent for
    a cooldown (made so here), it no longer holds the breaker, and request B goes as the trial, fails
    and opens the breaker again. Then A answers (a stream's first token, a whole answer): let through
    before that opening, it closes nothing, and the next request skips the backend. It closed the
    breaker, sending the next requests back to a backend whose latest trial had just failed."""
    gateway = tight_routes
    breakers = runtime(gateway).router.breakers
    key = "openai/gpt-4o-mini"
    breaker = breakers.get(key)
    breaker.trip(now=time.monotonic() - breaker.settings.cooldown)
    fake_openai.set_latency(first_token=0.4)

    def ask() -> str:
        if answer == "whole":
            return chat(gateway, "resilient")[0]
        text, _ = streamed(gateway, "resilient")
        return text

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(ask)
        deadline = time.monotonic() + 5
        while not fake_openai.posts:  # A went as the trial
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert breaker.trial() is not None
        breaker.trial_started -= breaker.settings.cooldown  # A silent for a cooldown
        assert breaker.allow()  # B, the trial now...
        assert breaker.failure()  # ...fails: open again
        assert asked.result(timeout=10) == ECHO  # A's answer
    assert breakers.state(key) == "open", "a trial let through before the opening closed it"
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:open,claude-sonnet:ok"


def test_a_trial_is_known_by_when_its_breaker_let_it_through_not_by_the_trial_in_flight_later(
    tight_routes: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With shared state, a half-open trial that only the cooldown let through is claimed for the
    fleet: a round trip. While request R waits on it, the breaker moves: another request's failure
    opens it again, a probe half-opens it, and request S goes as its trial. R was taken for the trial
    in flight once the shared state answered, S's: its answer closed the breaker that S's verdict was
    to decide (and its end without one would have freed S's hold). R is known by when the breaker let
    it through, before that opening: its answer closes nothing, and S still holds the breaker."""
    breakers = runtime(tight_routes).router.breakers
    key = Breakers.key("openai", "gpt-4o-mini")
    breaker = breakers.get(key)
    held: list[float | None] = []

    class Moving(MemoryState):
        async def kv_get(self, name: str) -> bytes | None:
            if not held:  # R's claim of the fleet's trial, under way
                assert breaker.failure()  # another request fails: open again
                breaker.half_open()  # a probe reached the backend
                assert breaker.allow()  # S, the trial now
                held.append(breaker.trial())
            return await super().kv_get(name)

    monkeypatch.setattr(breakers, "shared", Moving())
    breaker.trip(now=time.monotonic() - breaker.settings.cooldown)
    text, route = chat(tight_routes, "resilient")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and "tried" not in route  # R went
    assert breakers.state(key) == "half_open", "R's answer closed the breaker as S's would"
    assert breaker.trial() == held[0] is not None  # S still holds it...
    # ...so nothing else goes while its trial is young (read at a fixed time: under load this request
    # can take longer than the 0.5 s cooldown, after which a silent trial no longer holds the breaker).
    assert not breaker.admits(now=held[0] + breaker.settings.cooldown / 2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_hedged_routes_half_open_trial_closes_the_breaker_when_it_answers(
    gateway: RunningGateway, stream: bool
) -> None:
    """A hedged route's first candidate is its breaker's half-open trial: its answer (a stream's first
    token) before the hedge delay closes the breaker, as an unhedged route's does."""
    breakers = runtime(gateway).router.breakers
    key = "openai/gpt-4o-mini"
    breakers.get(key).trip(now=time.monotonic() - 1)  # cooldown 0.5 s: half-open
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="hedged", messages=HI, stream=stream
    )
    assert route_header(raw)["candidate"] == "gpt-4o-mini" and "hedged" not in route_header(raw)
    if stream:
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    assert breakers.state(key) == "closed"


def test_a_half_open_trial_that_never_reports_is_replaced_after_a_cooldown() -> None:
    breaker = Breakers().get("b/m", BreakerSettings(failures=1, cooldown=0.5))
    breaker.trip(now=0.0)
    assert breaker.allow(now=1.0)  # half-open: the trial goes through...
    assert not breaker.allow(now=1.2)  # ...and holds the breaker while it runs
    assert breaker.allow(now=1.6)  # a trial silent for a cooldown no longer does


def test_half_open_lets_one_trial_through_under_concurrency_and_its_failure_reopens(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    breakers = runtime(gateway).router.breakers
    key = "openai/gpt-4o-mini"
    settings = runtime(gateway).router.routes["resilient"][0].breaker
    breakers.get(key, settings).trip(now=time.monotonic() - 1)
    fake_openai.set_latency(first_token=0.6)  # the trial is still in flight while the others arrive
    routes: list[dict[str, str]] = []

    def ask() -> None:
        text, route = chat(gateway, "resilient")
        assert text == ECHO
        routes.append(route)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(r["candidate"] for r in routes) == ["claude-sonnet"] * 3 + ["gpt-4o-mini"]
    assert len(fake_openai.requests) == 1
    assert all(
        r["tried"] == "gpt-4o-mini:open,claude-sonnet:ok" for r in routes if r["candidate"] != "gpt-4o-mini"
    )
    assert breakers.state(key) == "closed"  # the trial answered
    # Opened again, and this time the trial fails: open at once, the request falls over, no retry.
    fake_openai.reset()
    breakers.get(key).trip(now=time.monotonic() - 1)
    fake_openai.fail_next(500)
    gateway.sink.events.clear()
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:502,claude-sonnet:ok"
    assert breakers.state(key) == "open"
    assert ledger(gateway) == [("openai", 500), ("anthropic", 200)]
    text, route = chat(gateway, "resilient")
    assert route["tried"] == "gpt-4o-mini:open,claude-sonnet:ok"


def test_a_400_caused_by_the_request_never_opens_the_breaker_nor_fails_over(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Not even a context-length 400, which another candidate with a larger window might take: the docs
    promise a 4xx the request caused never fails over."""
    breakers = runtime(gateway).router.breakers
    message = "This model's maximum context length is 128000 tokens (context_length_exceeded)"
    fake_openai.fail_next(Fault.status(400, message=message), times=4)  # more than `failures` (3)
    for _ in range(4):
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            chat(gateway, "resilient")
    assert ledger(gateway) == [("openai", 400)] * 4 and not fake_anthropic.requests
    assert breakers.state("openai/gpt-4o-mini") == "closed"
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini"


def test_a_failing_model_does_not_open_the_breaker_of_another_model_on_its_backend(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    breakers = runtime(gateway).router.breakers
    fake_openai.fail_next(500, times=3)  # 2 tries, then 1: the third failure opens it
    for _ in range(2):
        text, route = chat(gateway, "resilient")
        assert text == ECHO and route["candidate"] == "claude-sonnet"
    assert breakers.state("openai/gpt-4o-mini") == "open"
    assert breakers.state("openai/gpt-5") == "closed"
    _, route = chat(gateway, "gpt5-first")
    assert route["candidate"] == "gpt-5" and "tried" not in route
    assert fake_openai.last_request.json["model"] == "gpt-5"


# --- hedging ----------------------------------------------------------------------------------------


def test_when_both_hedged_attempts_answer_at_once_the_loser_is_closed_and_billed(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The primary's first token and the hedge's arrive in the same turn of the event loop (both
    are done when the race is looked at): one wins, the other must still be cancelled and closed,
    its usage event recorded and its in-flight slot given back."""
    pipeline = runtime(gateway).executor.pipeline
    real_stream = pipeline.stream
    opened: list[asyncio.Event] = []

    async def stream(*args: Any, **kwargs: Any) -> Any:
        batches = await real_stream(*args, **kwargs)
        # Hold each opened stream until both are open, then release them together.
        gate = asyncio.Event()
        opened.append(gate)
        if len(opened) == 2:
            for each in opened:
                each.set()
        await gate.wait()
        return batches

    monkeypatch.setattr(pipeline, "stream", stream)
    fake_openai.set_latency(first_token=0.3)  # after the hedge delay (0.15 s): both are started
    raw = gateway.openai().chat.completions.with_raw_response.create(model="hedged", messages=HI, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    assert len(opened) == 2 and route_header(raw)["hedged"] == "deepseek-chat"
    settled(gateway, 2)
    statuses = sorted(e.status for e in gateway.sink.events)
    assert statuses == [200, 499]  # the winner's answer and the loser, cancelled
    deadline = time.monotonic() + 2
    while any(runtime(gateway).router.context.in_flight.values()):
        assert time.monotonic() < deadline, runtime(gateway).router.context.in_flight
        time.sleep(0.01)


def timed(model: str, *, stream: bool, ttft_s: float | None, latency_s: float) -> UsageEvent:
    """An answered attempt on the fake OpenAI's `model`, as routing learns its speed from it."""
    return UsageEvent(
        request_id="r",
        attempt=1,
        ts=dt.datetime.now(dt.UTC),
        tenant_id=None,
        key_id=None,
        route=model,
        backend="openai",
        model=model,
        usage=Usage(input_tokens=6, output_tokens=6),
        prices={},
        cost_pico_usd=0,
        latency_ms=latency_s * 1000,
        ttft_ms=None if ttft_s is None else ttft_s * 1000,
        stream=stream,
    )


def test_a_p95_hedge_waits_for_a_whole_answer_when_the_request_is_not_streamed(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The primary's streams have their first token in 50 ms, its whole answers take up to 1.5 s. A
    request not streamed is answered in 0.4 s: within what its answers take, so it is not hedged
    (it was, after the streams' 50 ms p95: nearly every request not streamed went to both). A stream
    that slow to its first token still is."""
    stats = runtime(gateway).executor.context.stats
    monkeypatch.setitem(stats.models, ("openai", "gpt-4o-mini"), ModelStats())  # this test's own
    for _ in range(WINDOW):
        stats.record(timed("gpt-4o-mini", stream=True, ttft_s=0.05, latency_s=0.5))
        stats.record(timed("gpt-4o-mini", stream=False, ttft_s=None, latency_s=1.5))
    fake_openai.set_latency(first_token=0.4)
    content, route = chat(gateway, "hedged-p95")
    assert content == ECHO
    assert "hedged" not in route and route["attempts"] == "1"
    assert len(fake_deepseek.requests) == 0
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="hedged-p95", messages=HI, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    assert route_header(raw)["hedged"] == "deepseek-chat"


def test_a_p95_hedge_starts_before_the_routes_ttft_timeout_where_timeouts_made_the_p95(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One stream in ten to gpt-4o-mini times out (0.5 s, the route's `ttft_timeout`): each enters
    the p95 window as at least that slow, so the p95 is the timeout itself. Waited, no hedge started
    before the timeout gave up on the primary: exactly where hedging is for (the slow tail), each such
    request waited two timeouts (the primary retried in place) before the next candidate was asked.
    The hedge starts before the timeout."""
    stats = runtime(gateway).executor.context.stats
    monkeypatch.setitem(stats.models, ("openai", "gpt-4o-mini"), ModelStats())  # this test's own
    for i in range(WINDOW):
        answered = timed("gpt-4o-mini", stream=True, ttft_s=0.1, latency_s=0.2)
        timed_out = msgspec.structs.replace(
            answered, ttft_ms=None, latency_ms=500.0, status=504, error="timeout"
        )
        stats.record(timed_out if i % 10 == 0 else answered)
    assert stats.get("openai", "gpt-4o-mini").p95_ttft() == pytest.approx(0.5)
    fake_openai.set_latency(first_token=3.0)
    started = time.monotonic()
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="hedged-p95-ttft", messages=HI, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    assert route_header(raw)["hedged"] == "deepseek-chat"
    assert time.monotonic() - started < 0.95  # not two 0.5 s timeouts first
    assert len(fake_deepseek.requests) == 1


def test_a_hedge_that_lost_before_any_answer_came_keeps_its_estimate_on_the_cap(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not streamed, a hedge's answer comes whole: one that lost is cancelled before anything of it
    came back, its usage event bills nothing (the gateway cannot tell what its vendor, which had the
    request, generated and bills for). The cap gave its estimate back for that: lost hedges spent
    none of it, and a tenant whose primaries answered just after the delay hedged without bound. The
    estimate stays counted."""
    executor = runtime(gateway).executor
    executor.hedges.state = MemoryState()  # this test's window only
    charges: list[execute.Charge] = []
    charge = executor.hedges.charge

    async def charged(*args: Any) -> execute.Charge | None:
        counted = await charge(*args)
        if counted is not None:
            charges.append(counted)
        return counted

    monkeypatch.setattr(executor.hedges, "charge", charged)
    fake_openai.set_latency(first_token=0.5)  # past the hedge delay (0.15 s)
    fake_anthropic.set_latency(first_token=3.0)  # still generating when the primary answers
    content, route = chat(gateway, "hedged-sonnet")
    assert content == ECHO and route["candidate"] == "gpt-4o-mini" and route["hedged"] == "claude-sonnet"
    assert len(fake_anthropic.requests) == 1 and len(charges) == 1 and charges[0].counted > 0
    settled(gateway, 2)
    assert {e.backend: (e.status, e.cost_pico_usd) for e in gateway.sink.events}["anthropic"] == (499, 0)
    deadline = time.monotonic() + 2
    while not charges[0].settled:  # priced once its usage event is recorded
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert counted_micro_usd(executor.hedges, "demo", "hedged-sonnet", charges[0].counted, 0)


def test_a_ttft_timeout_shorter_than_the_hedge_delay_fails_over_before_any_hedge(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    fake_openai.set_latency(first_token=3.0)
    started = time.monotonic()
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="hedge-slow-ttft", messages=HI, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    assert time.monotonic() - started < 2.5  # two 0.4 s timeouts, not the 3 s first token
    # The primary never got to the hedge delay (1.2 s): each try was cut at 0.4 s, then the next
    # candidate was asked once, as a plain attempt rather than a hedge.
    assert route_header(raw)["tried"] == "gpt-4o-mini:504,gpt-4o-mini:504,deepseek-chat:ok"
    assert len(fake_deepseek.requests) == 1
    settled(gateway, 3)
    # A TTFT timeout is the backend's 504 (tests/routing/test_routing_observability.py), not a 499.
    assert ledger(gateway) == [("openai", 504), ("openai", 504), ("deepseek", 200)]


def test_the_routes_own_ttft_timeout_fails_over_whatever_failover_on_lists(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """`ttft_timeout` is the route's own instruction to move on, but its 504 was matched against
    `failover_on` like a backend's: a route failing over on 429 only ended the request with 504
    `ttft_timeout` at its first candidate, its timeout only making requests fail sooner."""
    fake_openai.fail_next(Fault.delay(2.0), times=2)
    text, route = streamed(gateway, "impatient-429")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:504,gpt-4o-mini:504,claude-sonnet:ok"
    assert len(fake_anthropic.requests) == 1


def test_when_both_hedged_attempts_fail(
    gateway: RunningGateway, raw: Script, fake_deepseek: FakeOpenAI
) -> None:
    raw.delay = 0.3  # fails after the hedge (0.15 s) has started, and after the hedge failed
    raw.answers = [http_head(500) + b'{"error": {"message": "boom", "type": "server_error"}}']
    fake_deepseek.fail_next(500, times=5)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().chat.completions.create(model="raw-hedged", messages=HI, stream=True)
    assert caught.value.status_code == 502 and time.monotonic() - started < 5
    # The race lost on both sides, then each candidate's remaining tries, then the error.
    tried = route_header(caught.value.response)["tried"].split(",")
    assert sorted(tried) == ["deepseek-chat:502"] * 3 + ["raw-model:502"] * 2
    assert raw.calls == 2 and len(fake_deepseek.requests) == 3
    settled(gateway, 5)
    assert sorted(ledger(gateway)) == [("deepseek", 500)] * 3 + [("raw", 500)] * 2  # one row per attempt


def test_a_primary_that_fails_before_its_hedge_starts_is_not_named_as_the_one_that_answered(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """The primary's 500 comes before the hedge delay: no hedge starts, and the request goes on as an
    unhedged one does. When every candidate then fails, x-weir-route (and the request's log line)
    names the candidate whose failure the client got, the last one tried, as on a route without a
    hedge: it named the primary, counted as having answered (`Plan.serve`) as its attempt failed."""
    fake_openai.fail_next(500, times=2)
    fake_deepseek.fail_next(500, times=2)
    with pytest.raises(openai.InternalServerError) as caught:
        gateway.openai().chat.completions.create(model="hedged", messages=HI)  # type: ignore[arg-type]
    header = route_header(caught.value.response)
    assert header["tried"] == "gpt-4o-mini:502,gpt-4o-mini:502,deepseek-chat:502,deepseek-chat:502"
    assert header["candidate"] == "deepseek-chat"
    settled(gateway, 4)
    assert ledger(gateway)[-1] == ("deepseek", 500)


def test_a_primary_that_cannot_take_the_request_leaves_the_hedge_running_to_answer(
    gateway: RunningGateway, raw: Script, fake_deepseek: FakeOpenAI
) -> None:
    """The primary's model refuses a parameter it does not take (a reasoning model's `temperature`,
    400 `unsupported_value`) after the hedge started. Unhedged, that 400 passes the request on to the
    next candidate, the hedge's: so the hedge, already under way, answers. It was cancelled as for a
    400 the request caused, and its candidate then asked again from the start (two requests, one
    billed as cancelled, and the wait for a second answer)."""
    raw.delay = 0.3  # after the hedge (0.15 s) started, before it answers
    raw.answers = [
        http_head(400)
        + b'{"error": {"message": "Unsupported value: \'temperature\' does not support 0.2 with this '
        b'model.", "type": "invalid_request_error", "param": "temperature", "code": "unsupported_value"}}'
    ]
    fake_deepseek.set_latency(first_token=0.4)
    raw_answer = gateway.openai().chat.completions.with_raw_response.create(
        model="raw-hedged",
        messages=HI,  # type: ignore[arg-type]
        temperature=0.2,
    )
    assert raw_answer.parse().choices[0].message.content == ECHO
    header = route_header(raw_answer)
    assert header["candidate"] == "deepseek-chat" and header["hedged"] == "deepseek-chat"
    assert raw.calls == 1 and len(fake_deepseek.requests) == 1  # the hedge answered; not asked again
    settled(gateway, 2)
    assert sorted(ledger(gateway)) == [("deepseek", 200), ("raw", 400)]


def test_when_both_hedged_attempts_fail_at_once_the_race_ends_with_the_primarys_failure(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The primary's 503 and the hedge's 400 (the request's fault there) come back in the same turn
    of the event loop, both attempts done when the race is looked at. The race ends with the
    primary's failure, which fails over: the primary is retried and answers. It ended with whichever
    the set of both gave last: the hedge's 400 then ended the request, though unhedged the primary
    would have been retried first. Several requests: the set's order varied between them."""
    pipeline = runtime(gateway).executor.pipeline
    real_exchange = pipeline.exchange
    held: list[asyncio.Event] = []  # the race's two attempts, each held once it failed

    async def exchange(*args: Any, **kwargs: Any) -> Any:
        if len(held) >= 2:  # the race is over: the primary's retry goes as it is
            return await real_exchange(*args, **kwargs)
        gate = asyncio.Event()
        try:
            return await real_exchange(*args, **kwargs)
        finally:
            # Hold each failure until both attempts have failed, then release them together.
            held.append(gate)
            if len(held) == 2:
                for each in held:
                    each.set()
            await gate.wait()

    monkeypatch.setattr(pipeline, "exchange", exchange)
    for _ in range(8):
        held.clear()
        fake_openai.fail_next(503)  # the primary's first try; its retry answers
        fake_deepseek.fail_next(400)
        raw = gateway.openai().chat.completions.with_raw_response.create(model="hedged", messages=HI)
        assert raw.parse().choices[0].message.content == ECHO and len(held) == 2
        header = route_header(raw)
        assert sorted(header["tried"].split(",")) == [
            "deepseek-chat:400",
            "gpt-4o-mini:503",
            "gpt-4o-mini:ok",
        ]
        assert header["tried"].endswith("gpt-4o-mini:ok")  # the primary's retry, after the race


@pytest.mark.parametrize("since", ["open", "half_open"])
def test_a_hedge_is_admitted_by_its_breaker_when_it_would_start_not_only_when_it_was_picked(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
    since: str,
) -> None:
    """`hedged` picks deepseek-chat as the partner, its breaker closed, when the request starts; other
    requests' failures there open that breaker during the hedge delay. The hedge went anyway, to a
    backend whose breaker is open. It is admitted when it would start, as any candidate is: open, no
    hedge starts (`hedge=open`, nothing sent) and the primary goes on alone; half-open by
    then (a cooldown shorter than the delay, a probe), it goes as the breaker's trial, whose answer
    closes it (it left the breaker half-open, its trial never claimed)."""
    executor = runtime(gateway).executor
    breakers = runtime(gateway).router.breakers
    key = Breakers.key("deepseek", "deepseek-chat")
    pick = executor._hedge_partner

    def picked(*args: Any) -> Any:
        partner = pick(*args)
        assert partner is not None and breakers.state(key) == "closed"
        breaker = breakers.get(key)
        breaker.trip(now=time.monotonic() - (breaker.settings.cooldown if since == "half_open" else 0))
        return partner

    monkeypatch.setattr(executor, "_hedge_partner", picked)
    fake_openai.set_latency(first_token=0.6)  # past the hedge delay (0.15 s)
    text, route = chat(gateway, "hedged")
    assert text == ECHO
    if since == "open":
        assert route["candidate"] == "gpt-4o-mini" and "hedged" not in route
        assert route["hedge"] == "open" and "tried" not in route
        assert not fake_deepseek.requests and breakers.state(key) == "open"
    else:
        assert route["candidate"] == route["hedged"] == "deepseek-chat"
        assert len(fake_deepseek.requests) == 1 and breakers.state(key) == "closed"


@pytest.mark.parametrize("primary", ["answers", "fails_first"])
def test_a_hedge_its_adapter_cannot_express_frees_its_trial_and_is_noted_as_its_own(
    gateway: RunningGateway,
    raw: Script,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    primary: str,
) -> None:
    """`raw-hedged-sonnet` hedges raw-model with claude-sonnet, whose breaker is half-open when the
    hedge would start: the hedge goes as its trial. Anthropic cannot express `n` = 2, which only its
    adapter finds, after the hedge started: nothing is sent. The trial stayed claimed (a cooldown with
    no request there), the hedge's estimate stayed counted against the tenant's cap, and where the
    primary had failed first (made so here), that refusal ended the race as the primary's own: noted
    `raw-model:unsupported`, no retry of the primary. The hedge is noted `claude-sonnet:unsupported`,
    its trial is the next request's, it costs nothing, and the primary's failure fails over as any.
    Sent nowhere, it is the hedge's refusal, as `hedge=open` is: `hedge=unsupported` in x-weir-route
    and weir_route_hedges_total (it was counted `started` and noted `hedged=claude-sonnet`)."""
    executor = runtime(gateway).executor
    executor.hedges.state = MemoryState()  # this test's window only
    hedges = hedge_counts(gateway, "raw-hedged-sonnet")
    breakers = runtime(gateway).router.breakers
    breaker = breakers.get(Breakers.key("anthropic", "claude-sonnet-4-5"))
    pick, attempt = executor._hedge_partner, executor._attempt
    started: list[asyncio.Future[Any]] = []

    def picked(*args: Any) -> Any:
        partner = pick(*args)
        breaker.trip(now=time.monotonic() - breaker.settings.cooldown)  # half-open when it starts
        return partner

    async def attempted(*args: Any, **kwargs: Any) -> Any:
        if len(started) == 1 and primary == "fails_first":  # the hedge, once the primary failed
            await asyncio.wait(started)
        task = asyncio.current_task()
        assert task is not None
        started.append(task)
        return await attempt(*args, **kwargs)

    monkeypatch.setattr(executor, "_hedge_partner", picked)
    monkeypatch.setattr(executor, "_attempt", attempted)
    raw.delay = 0.3  # past the hedge delay (0.15 s)
    if primary == "fails_first":
        raw.answers = [
            http_head(500) + b'{"error": {"message": "boom", "type": "server_error"}}',
            raw.answers[0],
        ]
    text, route = chat(gateway, "raw-hedged-sonnet", n=2)
    assert text == "raw answer" and route["candidate"] == "raw-model"
    assert route["hedge"] == "unsupported" and "hedged" not in route
    assert route.get("tried") == {"answers": None, "fails_first": "raw-model:502,raw-model:ok"}[primary]
    assert hedges() == {"started": 0, "won": 0, "unsupported": 1}
    assert breaker.state is State.HALF_OPEN and breaker.trial() is None  # the next request's trial
    assert not fake_anthropic.requests
    assert counted_micro_usd(
        executor.hedges, "demo", "raw-hedged-sonnet", 0, 0
    )  # nothing sent, nothing spent


def test_a_hedge_its_adapter_cannot_express_is_noted_once_when_the_request_fails_over_to_it(
    gateway: RunningGateway, raw: Script, fake_anthropic: FakeAnthropic
) -> None:
    """`raw-hedged-sonnet`'s hedge, claude-sonnet, cannot express `n` = 2: nothing is sent. The
    primary then fails both its tries and the request moves on to claude-sonnet, which cannot express
    it either. It was noted `unsupported` as the hedge and again when the chain reached it (one
    candidate twice in `tried`), and the 502 said `hedged=claude-sonnet`. As for a hedge its breaker
    refused: the hedge's note is `hedge=unsupported`, and `tried=` notes the candidate once, where the
    chain reaches it."""
    hedges = hedge_counts(gateway, "raw-hedged-sonnet")
    raw.delay = 0.3  # past the hedge delay (0.15 s)
    raw.answers = [http_head(500) + b'{"error": {"message": "boom", "type": "server_error"}}']
    with pytest.raises(openai.InternalServerError) as caught:
        chat(gateway, "raw-hedged-sonnet", n=2)
    route = route_header(caught.value.response)
    assert route["hedge"] == "unsupported" and "hedged" not in route
    assert route["tried"] == "raw-model:502,raw-model:502,claude-sonnet:unsupported"
    assert raw.calls == 2 and not fake_anthropic.requests
    assert hedges() == {"started": 0, "won": 0, "unsupported": 1}


def test_a_hedge_its_breaker_refused_is_noted_once_when_the_request_fails_over_to_it(
    gateway: RunningGateway, raw: Script, fake_deepseek: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`raw-hedged`'s hedge, deepseek-chat, is refused by its breaker, opened during the delay (2 s
    cooldown, the longest of the routes there): no hedge starts. The primary then fails both its
    tries, and the request moves on to deepseek-chat, still open. It was noted `open` at the hedge
    and again when the chain reached it: one candidate skipped twice in `tried` (and counted twice as
    an attempt). The hedge's refusal is the hedge's (`hedge=open`); the candidate is noted once,
    where the chain skipped it."""
    executor = runtime(gateway).executor
    breakers = runtime(gateway).router.breakers
    key = Breakers.key("deepseek", "deepseek-chat")
    pick = executor._hedge_partner

    def picked(*args: Any) -> Any:
        partner = pick(*args)
        breakers.get(key).trip()  # other requests' failures, during the delay
        return partner

    monkeypatch.setattr(executor, "_hedge_partner", picked)
    raw.delay = 0.3  # past the hedge delay (0.15 s)
    raw.answers = [http_head(500) + b'{"error": {"message": "boom", "type": "server_error"}}']
    with pytest.raises(openai.InternalServerError) as caught:
        chat(gateway, "raw-hedged")
    route = route_header(caught.value.response)
    assert route["hedge"] == "open"
    assert route["tried"] == "raw-model:502,raw-model:502,deepseek-chat:open"
    assert raw.calls == 2 and not fake_deepseek.requests and breakers.state(key) == "open"


def test_a_hedge_loser_that_was_a_silent_trial_does_not_free_the_trial_let_through_since(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`hedged`'s first candidate goes as its breaker's half-open trial and is slow; silent for a
    cooldown, it no longer holds the breaker, and another request goes as the trial. The hedge answers
    first and the old trial, the race's loser, is cancelled: no verdict. Its end freed the other
    request's trial, letting a third request go beside it."""
    executor = runtime(gateway).executor
    breaker = runtime(gateway).router.breakers.get(Breakers.key("openai", "gpt-4o-mini"))
    breaker.trip(now=time.monotonic() - breaker.settings.cooldown)
    pick = executor._hedge_partner
    held: list[float | None] = []

    def picked(*args: Any) -> Any:
        assert breaker.trial() is not None  # the first candidate's, admitted just now
        breaker.trial_started -= breaker.settings.cooldown  # silent for a cooldown
        assert breaker.allow()  # another request's trial
        held.append(breaker.trial())
        return pick(*args)

    monkeypatch.setattr(executor, "_hedge_partner", picked)
    fake_openai.set_latency(first_token=0.6)  # past the hedge delay (0.15 s)
    text, route = chat(gateway, "hedged")
    assert text == ECHO and route["candidate"] == route["hedged"] == "deepseek-chat"
    assert len(fake_deepseek.requests) == 1
    assert breaker.state is State.HALF_OPEN and breaker.trial() == held[0] is not None  # still held


def test_a_routes_ttft_timeout_does_not_take_the_model_from_routes_that_wait_longer(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """`impatient-route` gives gpt-4o-mini 0.3 s to its first token, `resilient` waits as long as it
    takes. gpt-4o-mini is slow (0.6 s), not down: impatient-route's three timeouts (the breaker's
    three failures) opened the breaker both routes share, and `resilient` then sent its requests to
    its fallback although gpt-4o-mini would have answered them. (They open impatient-route's own
    latency breaker there instead: its retry after the third is skipped.) Real failures still open it
    for all."""
    key = Breakers.key("openai", "gpt-4o-mini")
    breakers = runtime(gateway).router.breakers
    fake_openai.set_latency(first_token=0.6)
    for tried in ("gpt-4o-mini:504,gpt-4o-mini:504,claude-sonnet:ok", "gpt-4o-mini:504,claude-sonnet:ok"):
        raw = gateway.openai().chat.completions.with_raw_response.create(
            model="impatient-route", messages=HI, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
        assert route_header(raw)["tried"] == tried
    assert breakers.state(key) == State.CLOSED
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and "tried" not in route

    fake_openai.set_latency()
    fake_openai.fail_next(500, times=3)  # two on the first request, one on the second: three failures
    assert [chat(gateway, "resilient")[1]["tried"] for _ in range(2)] == [
        "gpt-4o-mini:502,gpt-4o-mini:502,claude-sonnet:ok",
        "gpt-4o-mini:502,claude-sonnet:ok",
    ]
    assert breakers.state(key) == State.OPEN
    assert chat(gateway, "impatient-route")[1]["tried"] == "gpt-4o-mini:open,claude-sonnet:ok"


def streamed(gateway: RunningGateway, model: str) -> tuple[str, dict[str, str]]:
    messages: Any = HI
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=model, messages=messages, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices), route_header(raw)


def chats_sent(fake: FakeOpenAI) -> int:
    return sum(r.path.endswith("/chat/completions") for r in fake.requests)


def test_a_route_stops_waiting_on_a_model_too_slow_for_it_while_routes_that_wait_longer_keep_it(
    tight_routes: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """`tight` gives gpt-4o-mini 0.3 s to its first token; `resilient` waits as long as it takes, so
    tight's timeouts leave the shared breaker closed, and tight paid its 0.3 s on every stream for as
    long as gpt-4o-mini stayed slow. They open tight's own latency breaker there instead: after its
    two failures its streams go straight to claude-sonnet (`slow`: nothing sent), while `resilient`
    still gets gpt-4o-mini's answers, and tight's requests that do not stream (no first-token
    timeout) still go to gpt-4o-mini."""
    breakers = runtime(tight_routes).router.breakers
    fake_openai.set_latency(first_token=0.6)
    for _ in range(2):
        text, route = streamed(tight_routes, "tight")
        assert text == ECHO and route["tried"] == "gpt-4o-mini:504,claude-sonnet:ok"
    sent = chats_sent(fake_openai)
    text, route = streamed(tight_routes, "tight")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:slow,claude-sonnet:ok"
    assert chats_sent(fake_openai) == sent  # no timeout waited out: nothing went to gpt-4o-mini
    assert breakers.latency_states() == {"tight": {"openai/gpt-4o-mini": "open"}}

    assert breakers.state(Breakers.key("openai", "gpt-4o-mini")) == State.CLOSED
    text, route = streamed(tight_routes, "resilient")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and "tried" not in route
    text, route = chat(tight_routes, "tight")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and "tried" not in route


def test_after_its_cooldown_a_routes_latency_breaker_sends_one_trial_and_a_first_token_in_time_closes_it(
    tight_routes: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """Half-open, one stream of the route is the trial (another meanwhile still skips the model); a
    trial that times out opens it for another cooldown, one whose first token comes in time closes
    it, and the route's streams go to the model again."""
    router = runtime(tight_routes).router
    fake_openai.set_latency(first_token=0.6)
    for _ in range(2):
        streamed(tight_routes, "tight")
    latency = router.breakers.latency_breaker(
        router.routes["tight"][0], Breakers.key("openai", "gpt-4o-mini")
    )
    assert latency is not None and latency.current() == State.OPEN
    latency.opened_at -= 30  # its 30 s cooldown has passed

    sent = chats_sent(fake_openai)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        trial = pool.submit(streamed, tight_routes, "tight")
        deadline = time.monotonic() + 5
        while chats_sent(fake_openai) == sent:  # the trial reached gpt-4o-mini
            assert time.monotonic() < deadline and not trial.done(), "no trial was sent"
            time.sleep(0.01)
        assert streamed(tight_routes, "tight")[1]["tried"] == "gpt-4o-mini:slow,claude-sonnet:ok"
        assert trial.result()[1]["tried"] == "gpt-4o-mini:504,claude-sonnet:ok"
    assert chats_sent(fake_openai) == sent + 1
    assert latency.current() == State.OPEN  # still too slow: another cooldown
    assert streamed(tight_routes, "tight")[1]["tried"] == "gpt-4o-mini:slow,claude-sonnet:ok"

    latency.opened_at -= 30
    fake_openai.set_latency()
    for _ in range(2):
        text, route = streamed(tight_routes, "tight")
        assert text == ECHO and route["candidate"] == "gpt-4o-mini" and "tried" not in route
    assert router.breakers.latency_states() == {"tight": {"openai/gpt-4o-mini": "closed"}}


def test_a_stream_let_through_before_its_routes_latency_breaker_opened_does_not_close_it(
    tight_routes: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream of `tight` goes to gpt-4o-mini while tight's latency breaker there is closed; before
    its first token comes (in time), other streams' timeouts open the breaker. That first token was no
    half-open trial: it closes nothing, and tight's next stream skips the model for the cooldown (30 s
    here). It closed the breaker, sending tight's streams back to a model whose latest ones timed out."""
    router = runtime(tight_routes).router
    tight, key = router.routes["tight"][0], Breakers.key("openai", "gpt-4o-mini")
    pipeline = runtime(tight_routes).executor.pipeline
    real_stream = pipeline.stream
    opened: list[bool] = []

    async def stream(*args: Any, **kwargs: Any) -> Any:
        batches = await real_stream(*args, **kwargs)
        if not opened:  # sent while the breaker was closed: two other streams time out meanwhile
            for _ in range(2):
                await router.breakers.too_slow(key, 0.3, tight)
            opened.append(True)
        return batches

    monkeypatch.setattr(pipeline, "stream", stream)
    text, route = streamed(tight_routes, "tight")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and "tried" not in route
    assert router.breakers.latency_states() == {"tight": {key: "open"}}
    text, route = streamed(tight_routes, "tight")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:slow,claude-sonnet:ok"


@pytest.mark.parametrize("held", ["backend", "latency"])
def test_an_attempt_that_was_no_trial_does_not_free_the_trial_another_request_holds(
    tight_routes: RunningGateway, fake_openai: FakeOpenAI, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    """A stream of `tight` goes to gpt-4o-mini while its breakers there are closed; while it waits, one
    of them opens and half-opens, and another request takes its trial. The stream then ends with no
    verdict on that breaker (the backend's: a TTFT timeout that only tight's latency preference
    counts; tight's latency breaker: a 502 before its first token was due). That freed the other
    request's trial, as if the stream had been the trial: the next request went as a second trial
    beside it."""
    router = runtime(tight_routes).router
    tight, key = router.routes["tight"][0], Breakers.key("openai", "gpt-4o-mini")
    pipeline = runtime(tight_routes).executor.pipeline
    real_stream = pipeline.stream
    trials: list[CircuitBreaker] = []

    async def stream(*args: Any, **kwargs: Any) -> Any:
        if not trials:  # sent while the breakers were closed
            if held == "backend":
                breaker = router.breakers.get(key)
                breaker.trip(now=time.monotonic() - breaker.settings.cooldown)
            else:
                for _ in range(2):
                    await router.breakers.too_slow(key, 0.3, tight)
                breaker = router.breakers.latency_breaker(tight, key)  # type: ignore[assignment]
                breaker.opened_at -= breaker.settings.cooldown
            assert breaker.allow() and breaker.current() == State.HALF_OPEN  # another request's trial
            trials.append(breaker)
        return await real_stream(*args, **kwargs)

    monkeypatch.setattr(pipeline, "stream", stream)
    if held == "backend":
        fake_openai.set_latency(first_token=0.6)  # past tight's ttft_timeout (0.3 s)
    else:
        fake_openai.fail_next(500)
    text, route = streamed(tight_routes, "tight")
    status = "504" if held == "backend" else "502"
    assert text == ECHO and route["tried"] == f"gpt-4o-mini:{status},claude-sonnet:ok"
    assert not trials[0].admits()  # the other request's trial still holds it


@pytest.mark.parametrize("order", [("resilient", "tight"), ("tight", "resilient")])
def test_routes_sharing_a_model_give_its_breaker_the_same_settings_whatever_order_requests_come_in(
    tight_routes: RunningGateway, order: tuple[str, str]
) -> None:
    """`resilient` (3 failures, 0.5 s cooldown) and `tight` (2, 30 s) share gpt-4o-mini's breaker. It
    took the settings of whichever route's request came last, so how long it stayed open depended on
    which route happened to send last. It has the route table's settings, the most protective of
    theirs (the fewest failures, the longest cooldown), however requests come in."""
    router = runtime(tight_routes).router
    key = Breakers.key("openai", "gpt-4o-mini")
    for model in order:
        text, route = chat(tight_routes, model)
        assert text == ECHO and route["candidate"] == "gpt-4o-mini"
    assert router.breakers.get(key).settings == BreakerSettings(failures=2, cooldown=30)
    # The routes' own latency breakers there keep their own routes' settings.
    latency = router.breakers.latency_settings
    assert latency[("tight", 0.3, key)] == BreakerSettings(failures=2, cooldown=30)
    assert latency[("impatient-route", 0.3, key)] == BreakerSettings(failures=3, cooldown=0.5)


def test_when_every_candidate_is_open_retry_after_says_when_the_first_takes_requests_again(
    tight_routes: RunningGateway,
) -> None:
    """`resilient`'s own cooldown is 0.5 s, but the shared breakers of its models wait 30 s (tight's,
    the longest of the routes there): a client told `retry-after: 1` met another 503 for 29 s."""
    router = runtime(tight_routes).router
    for name in ("gpt-4o-mini", "claude-sonnet"):
        target = router.models.targets[name]
        router.breakers.get(Breakers.key(target.backend.name, target.upstream_model)).trip()
    client = openai.OpenAI(
        base_url=f"{tight_routes.url}/v1", api_key=tight_routes.openai().api_key, max_retries=0
    )
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="resilient", messages=HI)  # type: ignore[arg-type]
    assert refused.value.status_code == 503
    assert 28 <= int(refused.value.response.headers["retry-after"]) <= 30


PATIENCE = """\
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
models:
  - {name: gpt-4o-mini, backend: openai}
  - {name: gpt-5, backend: openai}
"""


async def test_ttft_timeouts_open_the_breaker_where_no_route_there_waits_longer() -> None:
    """The rule (Breakers.too_slow): a route's TTFT timeout counts against a backend's breaker when
    every route with a breaker there would have given up as soon (the only route of a model keeps
    skipping it while it is too slow), not when one waits longer."""
    from gateway.router_basic import ModelTable
    from routing.router import Router
    from routing.routes import Candidate, Route

    settings = BreakerSettings(failures=2, cooldown=30)
    mini, five = Breakers.key("openai", "gpt-4o-mini"), Breakers.key("openai", "gpt-5")
    routes = [
        Route(name="tight", ttft_timeout=1, breaker=settings, candidates=[Candidate(model="gpt-4o-mini")]),
        Route(name="loose", ttft_timeout=5, breaker=settings, candidates=[Candidate(model="gpt-4o-mini")]),
        Route(name="alone", ttft_timeout=1, breaker=settings, candidates=[Candidate(model="gpt-5")]),
        # No breaker: it never consults one, so its patience does not count.
        Route(name="unguarded", breaker=None, candidates=[Candidate(model="gpt-5")]),
    ]
    breakers = Router(ModelTable(parse_config(PATIENCE, {})), routes).breakers
    for _ in range(2):
        await breakers.too_slow(mini, 1)
        await breakers.too_slow(five, 1)
    assert breakers.state(mini) == State.CLOSED  # `loose` would have waited
    assert breakers.state(five) == State.OPEN  # nobody would
    for _ in range(2):
        await breakers.too_slow(mini, 5)
    assert breakers.state(mini) == State.OPEN


async def test_a_routes_latency_breakers_last_while_it_is_in_force_and_another_route_waits_longer() -> None:
    """`tight`'s timeouts on gpt-4o-mini open its own latency breaker there (`loose` would wait), which
    a route table that changes nothing of that keeps; it goes once `loose` waits no longer (the
    timeouts are the shared breaker's again), or once `tight` waits longer itself."""
    from gateway.router_basic import ModelTable
    from routing.router import Router
    from routing.routes import Candidate, Route

    settings = BreakerSettings(failures=2, cooldown=30)
    mini = Breakers.key("openai", "gpt-4o-mini")

    def route(name: str, ttft_timeout: float) -> Route:
        return Route(
            name=name,
            ttft_timeout=ttft_timeout,
            breaker=settings,
            candidates=[Candidate(model="gpt-4o-mini")],
        )

    router = Router(ModelTable(parse_config(PATIENCE, {})), [route("tight", 1), route("loose", 5)])
    breakers = router.breakers
    for _ in range(2):
        await breakers.too_slow(mini, 1, route("tight", 1))
    assert breakers.latency_states() == {"tight": {mini: "open"}}
    assert breakers.state(mini) == State.CLOSED
    router.set_routes([route("tight", 1), route("loose", 5), route("other", 2)])
    assert breakers.latency_states() == {"tight": {mini: "open"}}
    router.set_routes([route("tight", 1), route("loose", 1)])
    assert breakers.latency_states() == {}
    router.set_routes([route("tight", 1), route("loose", 5)])
    await breakers.too_slow(mini, 1, route("tight", 1))
    router.set_routes([route("tight", 2), route("loose", 5)])
    assert breakers.latency_states() == {}


def _tight_and_loose() -> tuple[Any, Breakers]:
    """Routes `tight` (1 s TTFT timeout) and `loose` (5 s) on gpt-4o-mini, and their breakers: tight
    has a latency breaker there (2 timeouts in a row open it, 30 s cooldown)."""
    from gateway.router_basic import ModelTable
    from routing.router import Router
    from routing.routes import Candidate, Route

    tight, loose = (
        Route(
            name=name,
            ttft_timeout=wait,
            breaker=BreakerSettings(failures=2, cooldown=30),
            candidates=[Candidate(model="gpt-4o-mini")],
        )
        for name, wait in (("tight", 1), ("loose", 5))
    )
    return tight, Router(ModelTable(parse_config(PATIENCE, {})), [tight, loose]).breakers


async def test_only_its_trials_first_token_in_time_closes_a_routes_latency_breaker() -> None:
    """Any first token in time starts a closed latency breaker's count of timeouts again; one that is
    not closed, open or half-open, closes on its half-open trial's first token alone."""
    mini = Breakers.key("openai", "gpt-4o-mini")
    tight, breakers = _tight_and_loose()
    await breakers.too_slow(mini, 1, tight)
    breakers.in_time(tight, mini, trial=None)
    await breakers.too_slow(mini, 1, tight)
    latency = breakers.latency_breaker(tight, mini)
    assert latency is not None and latency.current() == State.CLOSED  # one timeout in a row, not two
    await breakers.too_slow(mini, 1, tight)
    breakers.in_time(tight, mini, trial=None)
    assert latency.current() == State.OPEN
    latency.opened_at -= 30
    assert latency.allow() and latency.current() == State.HALF_OPEN  # the trial goes...
    breakers.in_time(tight, mini, trial=None)  # ...and a stream let through before answers in time
    assert latency.current() == State.HALF_OPEN
    breakers.in_time(tight, mini, trial=latency.trial())
    assert latency.current() == State.CLOSED


async def test_a_latency_trial_let_through_before_the_latest_opening_does_not_close_it() -> None:
    """Trial A of `tight`'s latency breaker, silent for a cooldown, no longer holds it: stream B goes
    as the trial, times out, and opens it again. A's first token then comes in time: let through
    before that opening, it closes nothing (B's timeout is the latest word on the model's speed). It
    closed the breaker, sending tight's streams back to a model whose latest trial had just been too
    slow."""
    mini = Breakers.key("openai", "gpt-4o-mini")
    tight, breakers = _tight_and_loose()
    for _ in range(2):
        await breakers.too_slow(mini, 1, tight)
    latency = breakers.latency_breaker(tight, mini)
    assert latency is not None and latency.current() == State.OPEN
    latency.opened_at -= 30
    assert latency.allow()  # A, the trial...
    a = latency.trial()
    latency.trial_started -= 30  # ...silent for a cooldown
    assert latency.allow()  # B, the trial now...
    await breakers.too_slow(mini, 1, tight)  # ...times out: open again
    breakers.in_time(tight, mini, trial=a)
    assert latency.current() == State.OPEN, "a trial let through before the opening closed it"


def test_a_shared_breakers_settings_follow_the_route_table() -> None:
    """Decided per table, each setting on its own: an edit that drops the route asking for the
    fewest failures or the longest cooldown gives the breaker the others' again."""
    from gateway.router_basic import ModelTable
    from routing.router import Router
    from routing.routes import Candidate, Route

    mini = Breakers.key("openai", "gpt-4o-mini")

    def route(name: str, failures: int, cooldown: float) -> Route:
        settings = BreakerSettings(failures=failures, cooldown=cooldown)
        return Route(name=name, breaker=settings, candidates=[Candidate(model="gpt-4o-mini")])

    router = Router(ModelTable(parse_config(PATIENCE, {})), [route("a", 2, 5), route("b", 4, 60)])
    assert router.breakers.get(mini).settings == BreakerSettings(failures=2, cooldown=60)
    router.set_routes([route("a", 2, 5), route("c", 3, 10)])
    assert router.breakers.get(mini).settings == BreakerSettings(failures=2, cooldown=10)
    router.breakers.breakers.clear()  # one made afresh takes the table's too
    assert router.breakers.get(mini).settings == BreakerSettings(failures=2, cooldown=10)


def test_when_every_candidate_is_open_the_client_is_told_when_to_retry(gateway: RunningGateway) -> None:
    breakers = runtime(gateway).router.breakers
    settings = runtime(gateway).router.routes["resilient"][0].breaker  # cooldown 0.5 s
    for key in ("openai/gpt-4o-mini", "anthropic/claude-sonnet-4-5"):
        breakers.get(key, settings).trip()
    with pytest.raises(openai.APIStatusError) as caught:
        chat(gateway, "resilient")
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "1"  # the 0.5 s cooldown, rounded up, not "0"
    assert route_header(caught.value.response)["tried"] == "gpt-4o-mini:open,claude-sonnet:open"
    assert not gateway.sink.events  # nothing was sent anywhere


def test_the_hedge_cap_holds_for_concurrent_requests_of_one_tenant(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Each hedge to claude-sonnet asked for 1,000 tokens is estimated at about $0.015; the route allows
    $0.035 an hour. Four requests at once, all slow enough to hedge and none finished (so no estimate
    is yet replaced by a cost) before every one has decided: exactly two hedge."""
    runtime(gateway).executor.hedges.state = MemoryState()  # this test's window only
    # The first hedge's cost is known ~1.6 s after its request started: the four must all decide
    # within that (they start together; the margin is for a loaded machine).
    fake_openai.set_latency(first_token=2.5)
    fake_anthropic.set_latency(first_token=1.5)
    routes: list[dict[str, str]] = []

    def ask() -> None:
        raw = gateway.openai().chat.completions.with_raw_response.create(
            model="hedged-tight", messages=HI, stream=True, max_tokens=1000
        )
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
        routes.append(route_header(raw))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(routes) == 4
    assert sorted(r.get("hedge", r.get("hedged")) for r in routes) == ["capped"] * 2 + ["claude-sonnet"] * 2
    assert len(fake_anthropic.requests) == 2


def test_a_tenants_hedges_on_one_route_spend_none_of_another_routes_cap(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Each route sets its own hedge cap ($0.035 an hour on both routes here). A hedge on hedged-tight
    that cost $0.03 leaves that route too little for the next (estimated at about $0.015 for 1,000
    tokens), and leaves hedged-tight-too its whole allowance: counted per tenant alone, one route's
    hedges spent the other's, which then hedged nothing."""
    hedges = runtime(gateway).executor.hedges
    hedges.state = MemoryState()  # this test's window only
    fake_openai.set_latency(first_token=0.6)  # past the hedge delay (0.1 s): every request hedges
    fake_anthropic.set_next_usage(input_tokens=6, output_tokens=2000)  # $0.03 at $15 per 1M
    _, route = chat(gateway, "hedged-tight", max_tokens=1000)
    assert route["candidate"] == "claude-sonnet" and route["hedged"] == "claude-sonnet"
    settled(gateway, 2)  # the hedge priced, and its cost counted instead of its estimate
    assert counted_micro_usd(hedges, "demo", "hedged-tight", 30_018, 1)
    _, route = chat(gateway, "hedged-tight", max_tokens=1000)
    assert route["candidate"] == "gpt-4o-mini" and route["hedge"] == "capped"
    _, route = chat(gateway, "hedged-tight-too", max_tokens=1000)
    assert route["candidate"] == "claude-sonnet" and route["hedged"] == "claude-sonnet"


async def test_a_hedges_cost_corrects_its_estimate_in_the_minute_it_was_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hedge cap counts a hedge's estimate in the minute the hedge starts and replaces it with
    what the hedge cost once that is priced. What the estimate was over by went to the minute current
    then: a hedge priced after its estimate had left the hour (a long stream) freed that much of the
    next hour, which then let hedges spend the cap and more; priced within the hour, the correction
    outlived the estimate by as long as the hedge ran. It goes to the estimate's minute now (nowhere
    once that has left the hour); what a hedge cost beyond its estimate counts from when it is known."""
    now = [1_000_000.0]
    monkeypatch.setattr(MemoryState, "_now", staticmethod(lambda: now[0]))
    cap = SpendCap("hedge")
    long = await cap.charge("t", "r", 0.6, cap=1.0)
    assert long is not None and await cap.charge("t", "r", 0.5, cap=1.0) is None
    now[0] += HOUR + 60  # priced once its estimate has left the hour
    await long.settle(100_000 * 10**6)  # $0.1
    assert counted_micro_usd(cap, "t", "r", 0, 0)

    slow = await cap.charge("t", "r", 0.6, cap=1.0)
    assert slow is not None
    now[0] += HOUR / 2
    await slow.settle(100_000 * 10**6)
    assert counted_micro_usd(cap, "t", "r", 100_000, 0)
    now[0] += HOUR / 2 + 60  # the estimate's minute has left the hour, and its correction with it
    assert counted_micro_usd(cap, "t", "r", 0, 0)

    over = await cap.charge("t", "r", 0.1, cap=1.0)
    assert over is not None
    now[0] += HOUR / 2
    await over.settle(400_000 * 10**6)  # $0.3 beyond its estimate
    now[0] += HOUR / 2 + 60
    assert counted_micro_usd(cap, "t", "r", 300_000, 0)  # an hour from when it was known
    now[0] += HOUR / 2
    assert counted_micro_usd(cap, "t", "r", 0, 0)


@pytest.mark.redis
async def test_a_hedge_priced_after_its_estimate_left_the_window_frees_no_room_in_redis(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with the cap's window in Redis (1.2 s here, 20 ms buckets): the bucket Redis counted
    the estimate in is where its correction goes, and there is none once that bucket has left."""
    monkeypatch.setattr(execute, "HOUR", 1.2)
    cap = SpendCap("hedge", RedisState.from_url(REDIS_URL, prefix=redis_prefix))
    try:
        charge = await cap.charge("t", "r", 0.6, cap=1.0)
        assert charge is not None
        await asyncio.sleep(1.25)  # its estimate's bucket has left the window
        await charge.settle(0)
        assert await cap.charge("t", "r", 1.0, cap=1.0) is not None
        assert await cap.charge("t", "r", 1e-6, cap=1.0) is None
    finally:
        await cap.state.close()


@pytest.mark.redis
async def test_breakers_shared_through_redis_keep_working_while_redis_is_away(redis_prefix: str) -> None:
    """Two replicas' breakers over one Redis (through a proxy the test stops): an opening on one is
    adopted by the other, per backend and model; with Redis gone both go on counting, opening and
    syncing on their own without an error; once it is back, openings are shared again."""
    proxy = TcpProxy(6379)
    await proxy.start()
    url = f"redis://127.0.0.1:{proxy.port}/0"
    states = [DegradableState(RedisState.from_url(url, prefix=redis_prefix), retry_s=0.1) for _ in "ab"]
    a, b = Breakers(states[0]), Breakers(states[1])
    settings = BreakerSettings(failures=2, cooldown=30)
    first, second, third = "openai/gpt-4o-mini", "openai/gpt-5", "anthropic/claude-sonnet-4-5"
    try:
        for breakers in (a, b):
            for key in (first, second, third):
                breakers.get(key, settings)
        for _ in range(2):
            await a.failure(first)
        await b.sync()
        assert (b.state(first), b.state(second)) == (State.OPEN, State.CLOSED)
        await proxy.stop()
        started = time.monotonic()
        for _ in range(2):
            await a.failure(second)
        await b.sync()
        assert a.state(second) == State.OPEN  # counted here: this replica still skips it
        assert b.state(first) == State.OPEN and b.state(second) == State.CLOSED  # not shared meanwhile
        assert time.monotonic() - started < 3
        await proxy.start()
        await asyncio.sleep(0.2)  # past retry_s: the next call tries Redis again
        for _ in range(2):
            await a.failure(third)
        await b.sync()
        assert b.state(third) == State.OPEN
    finally:
        for state in states:
            await state.close()
        await proxy.stop()


def test_a_non_streaming_hedge_loser_is_logged_as_cancelled(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """As for streams: the attempt the hedge beat was cancelled, and its usage event says 499 (it
    said 0, "never answered", which reads as a backend failure in the uptime and error reports)."""
    fake_openai.set_latency(first_token=2.0)
    raw = gateway.openai().chat.completions.with_raw_response.create(model="hedged", messages=HI)
    assert raw.parse().choices[0].message.content == ECHO
    assert route_header(raw)["hedged"] == "deepseek-chat"
    settled(gateway, 2)
    assert {e.backend: (e.status, e.ok) for e in gateway.sink.events} == {
        "deepseek": (200, True),
        "openai": (499, False),
    }
