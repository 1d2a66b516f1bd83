"""A client that leaves at every point of a routed request, and what that leaves behind.

The client (the official OpenAI SDK, its timeout or `close()` as the way out) hangs up while its
request waits out a retry's `retry-after`, while the hedge delay runs, during the hedge race, while the
stream waits for its first token under a TTFT timeout, mid-stream, and while a mid-stream resume opens
its continuation on the next candidate. After each: no new upstream request once the client is gone
(no retry, no hedge, no next candidate), the attempt under way is cancelled at once and recorded as the
client's 499 (`client_disconnected`, not the gateway's own `cancelled`), the executor's in-flight
counts, the tenant's stream slot and a half-open breaker's trial are free again, a hedge's spend cap
counts what the hedge was billed, and no task is left running or dies unobserved on the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.state import MemoryState
from routing.breaker import Breakers
from tests.control.helpers import TcpProxy
from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fixtures.db import REDIS_PORT, REDIS_URL
from tests.fixtures.gateway import CONFIG as GATEWAY_CONFIG
from tests.fixtures.gateway import Weir, sqlite_weir
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway
from tests.reliability.proxy import ThreadedProxy
from tests.routing.routed import counted_micro_usd, fresh, ledger, routed_config_text, runtime

HI = [{"role": "user", "content": "one two three four five six seven eight"}]
ONE_STREAM_KEY = "sk-weir-leaver-one-stream-0123456789"
ONE_STREAM = '  - {name: one-stream, api_keys: ["${ONE_STREAM_KEY}"], max_concurrent_streams: 1}'
QUIET = "breaker: {failures: 3, cooldown: 0.5}, probe_interval: null"
RETRY = "retry: {attempts: 2, backoff: 0.02, max_backoff: 0.1, max_retry_after: 5}"
LEAVER_ROUTES = f"""\
routes:
  - {{name: leave-retry, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {RETRY}, {QUIET}}}
  - {{name: leave-hedge, hedge: {{delay: 0.8}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {RETRY}, {QUIET}}}
  - {{name: leave-race, hedge: {{delay: 0.1}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {RETRY}, {QUIET}}}
  - {{name: leave-ttft, ttft_timeout: 1.0, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {RETRY}, {QUIET}}}
  - {{name: leave-resume, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {RETRY}, {QUIET}}}
"""
SLOW = 2.5  # seconds a slow fake takes to its first token: far longer than the client waits


@pytest.fixture(scope="module")
def gateway_config() -> str:
    return routed_config_text(LEAVER_ROUTES).replace("\nserver:\n", f"\n{ONE_STREAM}\nserver:\n", 1)


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {"ONE_STREAM_KEY": ONE_STREAM_KEY}


@pytest.fixture(scope="module")
def _routed(_routed: RunningGateway) -> RunningGateway:
    # One request first: the shared upstream client then exists, and tells which loop serves.
    _client(_routed, 10).chat.completions.create(model="leave-retry", messages=HI)  # type: ignore[arg-type]
    return _routed


class _Errors(logging.Handler):
    """Error records from uvicorn (an exception out of the app) and asyncio (a task's exception nobody
    retrieved), which live on the gateway's own thread and do not all reach pytest's caplog."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def errors() -> Iterator[_Errors]:
    handler = _Errors()
    loggers = [logging.getLogger(name) for name in ("asyncio", "uvicorn.error", "uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@pytest.fixture
def gateway(_routed: RunningGateway, fresh_fakes: None, errors: _Errors) -> Iterator[RunningGateway]:
    gateway = fresh(_routed)
    runtime(gateway).executor.hedges.state = MemoryState()  # this test's hedge spend alone
    loop = _loop(gateway)
    # Exceptions of tasks nobody awaited go to the loop's handler: count them, whatever logs them.
    unhandled: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.call_soon_threadsafe(loop.set_exception_handler, lambda _, context: unhandled.append(context))
    try:
        yield gateway
    finally:
        loop.call_soon_threadsafe(loop.set_exception_handler, previous)
    assert not unhandled, unhandled
    assert not [r.getMessage() for r in errors.records if r.levelno >= logging.ERROR]


def _loop(gateway: RunningGateway) -> asyncio.AbstractEventLoop:
    """The event loop the gateway serves on (its shared HTTP client lives there)."""
    session = runtime(gateway).transport._session
    assert session is not None
    return session._loop  # aiohttp keeps it there, with no public accessor


def _tasks(gateway: RunningGateway) -> set[str]:
    """The names of the coroutines the gateway's loop is running besides the server's own."""
    loop = _loop(gateway)

    async def names() -> set[str]:
        me = asyncio.current_task()
        return {repr(t.get_coro()) for t in asyncio.all_tasks() if t is not me}

    return asyncio.run_coroutine_threadsafe(names(), loop).result(5)


def _until(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _client(gateway: RunningGateway, timeout: float, key: str = DEMO_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=timeout)


def _leave_before_the_answer(
    gateway: RunningGateway, model: str, after: float, stream: bool = False, key: str = DEMO_KEY
) -> float:
    """Ask `model` and hang up `after` seconds, before any byte of the answer; when the client left.
    It does not say when it will (no `x-stainless-read-timeout`, which would have the gateway move
    on from a wait it cannot outlive): it leaves as a user who cancels does, unannounced."""
    client = _client(gateway, after, key)
    unannounced = {"x-stainless-read-timeout": openai.omit}
    try:
        with pytest.raises(openai.APITimeoutError):
            if stream:
                for _ in client.chat.completions.create(
                    model=model,
                    messages=HI,  # type: ignore[arg-type]
                    stream=True,
                    extra_headers=unannounced,
                ):
                    pass
            else:
                client.chat.completions.create(model=model, messages=HI, extra_headers=unannounced)  # type: ignore[arg-type]
    finally:
        client.close()
    return time.monotonic()


def _samples(gateway: RunningGateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{gateway.url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _errors_of(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], kind: str) -> float:
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "weir_errors_total" and dict(labels).get("type") == kind
    )


def _nothing_left(gateway: RunningGateway, tasks_before: set[str]) -> None:
    """What every leaving client must find freed: in-flight counts, stream slots, tasks."""
    in_flight = runtime(gateway).router.context.in_flight
    assert _until(lambda: not any(in_flight.values())), in_flight
    assert runtime(gateway).executor.context.in_flight is in_flight
    streams = runtime(gateway).limits.streams
    assert _until(lambda: not streams), streams
    assert _until(lambda: _tasks(gateway) <= tasks_before), _tasks(gateway) - tasks_before


def _events(gateway: RunningGateway, count: int, timeout: float = 5.0) -> list[tuple[str, int]]:
    _until(lambda: len(gateway.sink.events) >= count, timeout)
    return ledger(gateway)


# --- before the first answer: nothing new goes upstream once the client is gone --------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_leaves_during_the_retry_after_wait_gets_no_retry_and_no_fallback(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """The backend says 429, retry after 1 s; the client gives up 0.3 s into that wait. The retry and
    the next candidate would answer nobody: neither may be sent, and the request ends there."""
    tasks = _tasks(gateway)
    fake_openai.fail_next(Fault.status(429, retry_after=1))
    _leave_before_the_answer(gateway, "leave-retry", 0.3, stream)
    time.sleep(1.5)  # past the retry-after: a retry would have been sent by now
    assert len(fake_openai.requests) == 1, "the retry went upstream after the client had left"
    assert not fake_anthropic.requests, "the next candidate was asked after the client had left"
    assert _events(gateway, 1) == [("openai", 429)]
    _nothing_left(gateway, tasks)


def test_a_client_that_leaves_during_the_hedge_delay_starts_no_hedge(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """The primary is slow; the client leaves before the hedge delay (0.8 s) is up. No hedge may be
    sent for it, nor charged to the tenant's hedge allowance, and the primary is cancelled at once:
    its 499 is the client's (`client_disconnected`), not a hedge loser's (`cancelled`)."""
    tasks = _tasks(gateway)
    before = _samples(gateway)
    fake_openai.set_latency(first_token=SLOW)
    left = _leave_before_the_answer(gateway, "leave-hedge", 0.3, stream=True)
    assert _events(gateway, 1) == [("openai", 499)]
    assert time.monotonic() - left < 1.0, "the primary ran on after its client left"
    time.sleep(0.8)  # past the hedge delay
    assert not fake_deepseek.requests, "a hedge was sent for a client that had left"
    assert ledger(gateway) == [("openai", 499)]
    after = _samples(gateway)
    assert _errors_of(after, "client_disconnected") - _errors_of(before, "client_disconnected") == 1
    assert _errors_of(after, "cancelled") - _errors_of(before, "cancelled") == 0
    assert counted_micro_usd(
        runtime(gateway).executor.hedges, "demo", "leave-hedge", 0, 0
    )  # no hedge, no spend
    _nothing_left(gateway, tasks)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_leaves_during_the_hedge_race_cancels_both_attempts(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI, stream: bool
) -> None:
    """Both the primary and its hedge are under way and slow; the client leaves. Neither may run on
    to an answer nobody reads: both end at once, each with the client's 499, and the hedge's spend
    is what it was billed (nothing for a call that answered nothing)."""
    tasks = _tasks(gateway)
    before = _samples(gateway)
    for fake in (fake_openai, fake_deepseek):
        fake.set_latency(first_token=SLOW)
    left = _leave_before_the_answer(gateway, "leave-race", 0.5, stream)
    assert len(fake_deepseek.requests) == 1  # the race was on when the client left
    events = _events(gateway, 2)
    assert time.monotonic() - left < 1.5, "the race ran on after its client left"
    assert sorted(events) == [("deepseek", 499), ("openai", 499)]
    # The hedge's allowance counts what the cancelled hedge was billed (a stream that had started:
    # its prompt, estimated), not the estimate it was let through on.
    billed = sum(e.cost_pico_usd for e in gateway.sink.events if e.backend == "deepseek")
    hedges = runtime(gateway).executor.hedges
    assert _until(lambda: counted_micro_usd(hedges, "demo", "leave-race", round(billed / 1e6), 1)), billed
    after = _samples(gateway)
    assert _errors_of(after, "client_disconnected") - _errors_of(before, "client_disconnected") == 2
    assert _errors_of(after, "cancelled") - _errors_of(before, "cancelled") == 0
    _nothing_left(gateway, tasks)


def test_a_client_that_leaves_while_the_ttft_timeout_runs_gets_no_next_candidate(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The stream waits for its first token (TTFT timeout 1 s); the client leaves at 0.3 s. When the
    timeout comes there is nobody to fail over for: the attempt is the client's 499 (not a 504 the
    breaker counts against the backend), and no other candidate is asked."""
    tasks = _tasks(gateway)
    fake_openai.set_latency(first_token=SLOW)
    left = _leave_before_the_answer(gateway, "leave-ttft", 0.3, stream=True)
    assert _events(gateway, 1) == [("openai", 499)]
    assert time.monotonic() - left < 0.7, "the attempt ran on after its client left"
    time.sleep(1.0)  # past the TTFT timeout
    assert not fake_anthropic.requests, "the next candidate was asked after the client had left"
    assert ledger(gateway) == [("openai", 499)]
    breaker = runtime(gateway).router.breakers.get(Breakers.key("openai", "gpt-4o-mini"))
    assert breaker.failures == 0  # the backend did nothing wrong: its client left
    _nothing_left(gateway, tasks)


def test_a_client_that_leaves_before_its_first_token_frees_its_stream_slot_at_once(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A tenant allowed one stream at a time gives up on a slow one and asks again: its slot must be
    free, not held (429 `concurrent_streams_exceeded`) while the gateway waits for an answer nobody
    will read."""
    fake_openai.set_latency(first_token=SLOW)
    _leave_before_the_answer(gateway, "leave-retry", 0.3, stream=True, key=ONE_STREAM_KEY)
    fake_openai.set_latency()
    time.sleep(0.2)  # the gateway learns the client left (a loop turn or two)
    client = _client(gateway, 10, ONE_STREAM_KEY)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="leave-retry", messages=HI, stream=True)  # type: ignore[arg-type]
        if c.choices
    )
    assert text == HI[0]["content"]


def test_a_half_open_trial_whose_client_left_before_its_answer_frees_the_breaker(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The half-open breaker's one trial is a request whose client leaves before the answer. The
    trial said nothing about the backend: the next request must be the next trial at once, not be
    sent elsewhere for as long as the abandoned trial would have taken."""
    breakers = runtime(gateway).router.breakers
    key = Breakers.key("openai", "gpt-4o-mini")
    settings = runtime(gateway).router.routes["leave-retry"][0].breaker
    breakers.get(key, settings).trip(now=time.monotonic() - 1)
    fake_openai.set_latency(first_token=SLOW)
    _leave_before_the_answer(gateway, "leave-retry", 0.3)
    assert _events(gateway, 1) == [("openai", 499)]
    fake_openai.set_latency()
    raw = _client(gateway, 10).chat.completions.with_raw_response.create(model="leave-retry", messages=HI)
    assert "candidate=gpt-4o-mini" in raw.headers["x-weir-route"], raw.headers["x-weir-route"]
    assert breakers.state(key) == "closed"


# --- after the first token --------------------------------------------------------------------------


def test_a_client_that_leaves_mid_stream_ends_the_upstream_and_is_not_resumed(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    tasks = _tasks(gateway)
    fake_openai.fail_next(Fault.slow_stream(0.2))
    stream = _client(gateway, 10).chat.completions.create(model="leave-resume", messages=HI, stream=True)
    assert next(iter(stream)).choices
    stream.close()
    assert _events(gateway, 1) == [("openai", 499)]
    time.sleep(0.3)
    assert not fake_anthropic.requests
    _nothing_left(gateway, tasks)


def test_a_client_that_leaves_while_the_continuation_opens_cancels_it(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The stream breaks after its first words and the gateway opens its continuation on the next
    candidate, which is slow; the client leaves meanwhile. The continuation is cancelled at once
    (the client's 499), not waited for and then streamed into a closed connection."""
    tasks = _tasks(gateway)
    fake_openai.fail_next(Fault.cut_stream(after=3))
    fake_anthropic.set_latency(first_token=SLOW)
    stream = _client(gateway, 10).chat.completions.create(model="leave-resume", messages=HI, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break  # the first words: the cut follows them
    assert _until(lambda: len(fake_anthropic.requests) == 1)  # the continuation is being opened
    left = time.monotonic()
    stream.close()
    events = _events(gateway, 2)
    assert time.monotonic() - left < 1.5, "the continuation ran on after its client left"
    assert events == [("openai", 502), ("anthropic", 499)]
    _nothing_left(gateway, tasks)


# --- while the request waits for its admission (Redis) -----------------------------------------------


class _SlowRedis(TcpProxy):
    """127.0.0.1:<port> -> Redis, whose answers are held back `delay` seconds while it is set: a
    shared state slow to answer, so that a client can leave while its request is being admitted."""

    delay = 0.0

    async def forward(self, data: bytes, dst: asyncio.StreamWriter, upstream: bool) -> None:
        if not upstream and self.delay:
            await asyncio.sleep(self.delay)
        await super().forward(data, dst, upstream)


ADMITTED_CONFIG = (
    GATEWAY_CONFIG  # the shared gateway's, and a route that keeps a breaker
    + """\
routes:
  - {name: auto, candidates: [{model: gpt-4o-mini}], breaker: {failures: 3, cooldown: 0.5}, probe_interval: null}
"""
)


@dataclass
class _Admitted:
    """A gateway whose shared state is a real Redis behind a proxy that can be made slow."""

    url: str
    weir: Weir
    slow: _SlowRedis


@pytest.fixture
def admitted(
    fake_openai: FakeOpenAI,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[_Admitted]:
    slow = _SlowRedis(REDIS_PORT)
    proxy = ThreadedProxy(slow)
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    monkeypatch.setenv("WEIR_REDIS_URL", f"redis://127.0.0.1:{slow.port}/{REDIS_URL.rsplit('/', 1)[-1]}")
    try:
        with sqlite_weir(ADMITTED_CONFIG, fake_openai, tmp_path, monkeypatch) as weir:
            yield _Admitted(weir.url, weir, slow)
    finally:
        proxy.close()


@pytest.mark.redis
def test_a_client_that_leaves_while_its_request_is_admitted_gives_its_reservation_back(
    admitted: _Admitted, fake_openai: FakeOpenAI
) -> None:
    """Redis is slow to answer the admission; the client leaves meanwhile. The budget reservation
    the shared state made for it must be given back, not held for its 10-minute TTL: the tenant's
    next request, which fits its budget only without it, is answered, not refused as over budget."""
    url, slow = admitted.url, admitted.slow
    # 1,000 micro-USD a month. A request asking for 1,000 output tokens reserves ~600.
    _, _, key = admitted.weir.tenant_with_key("leaver", budget_usd_monthly="0.001")
    client = admitted.weir.client(key)
    client.chat.completions.create(model="auto", messages=HI, max_tokens=5)  # seeds the budget
    slow.delay = 0.4  # under the shared state's own 1 s timeout: slow, not down
    leaver = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=0.15)
    with pytest.raises(openai.APITimeoutError):
        leaver.chat.completions.create(model="auto", messages=HI, max_tokens=1000)
    leaver.close()
    time.sleep(1.0)  # the admission's answer arrives, after the client left
    slow.delay = 0.0
    time.sleep(0.3)  # settlements land
    answer = client.chat.completions.create(model="auto", messages=HI, max_tokens=1000)
    assert answer.choices[0].message.content == HI[0]["content"]
    assert len(fake_openai.requests) == 2  # the leaver's request never went upstream


@pytest.mark.redis
def test_a_client_that_leaves_while_its_request_is_refused_at_admission_made_no_attempt(
    admitted: _Admitted, fake_openai: FakeOpenAI
) -> None:
    """Redis is slow to answer the admission, the client leaves meanwhile, and the admission then
    refuses the request (over budget). Nothing went upstream and no usage event was written: as any
    refusal by the gateway, it is no attempt, not a `cancelled` one in the route's metrics."""
    url, slow = admitted.url, admitted.slow
    _, _, key = admitted.weir.tenant_with_key("refused-leaver", budget_usd_monthly="0.001")
    admitted.weir.client(key).chat.completions.create(model="auto", messages=HI, max_tokens=5)
    slow.delay = 0.4  # under the shared state's own 1 s timeout: slow, not down
    leaver = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=0.15)
    with pytest.raises(openai.APITimeoutError):  # ~6,000 micro-USD reserved: over the budget
        leaver.chat.completions.create(model="auto", messages=HI, max_tokens=10_000)
    leaver.close()
    time.sleep(1.0)  # the admission's refusal arrives, after the client left
    slow.delay = 0.0
    attempts = {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        if family.name == "weir_route_attempts"
        for sample in family.samples
        if sample.name == "weir_route_attempts_total" and sample.labels["route"] == "auto"
    }
    assert attempts == {"ok": 1.0}
    assert len(fake_openai.requests) == 1  # the leaver's request never went upstream
