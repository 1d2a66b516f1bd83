"""What a circuit breaker takes for a verdict on its backend: a trial the health probes let through
that fails refutes the probes' word (a backend that answers its model list but fails requests).

End to end: a real gateway with a fast health loop in front of a fake OpenAI that answers its model
list but resets every chat connection, with a spare candidate the requests fail over to. Unit: the
breakers of one replica, or of two over one shared state, driven step by step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from gateway.config import parse_config
from gateway.state import MemoryState
from routing.breaker import OPENED, OPENED_UNREACHABLE, PREFIX, Breakers, CircuitBreaker, State
from routing.routes import Breaker as BreakerSettings
from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway, running_gateway
from tests.routing.routed import route_header, runtime

KEY = Breakers.key("crashing", "gpt-4o-mini")
DEMO_KEY = "sk-weir-breaker-verdicts-demo"
HI = [{"role": "user", "content": "hello breaker"}]
PROBE_INTERVAL = 0.1

CRASHING = f"""\
backends:
  - {{name: crashing, type: openai, base_url: "${{CRASHING_URL}}", api_key: "${{BACKEND_KEY}}"}}
  - {{name: spare, type: openai, base_url: "${{SPARE_URL}}", api_key: "${{BACKEND_KEY}}"}}
models:
  - {{name: gpt-4o-mini, backend: crashing}}
  - {{name: spare-mini, backend: spare, model: gpt-4o-mini}}
tenants:
  - {{name: demo, api_keys: ["{DEMO_KEY}"]}}
routes:
  - name: spared
    probe_interval: {PROBE_INTERVAL}
    retry: {{attempts: 1}}
    breaker: {{failures: 1, cooldown: 30}}
    candidates: [{{model: gpt-4o-mini}}, {{model: spare-mini}}]
"""


@pytest.fixture
def crashing() -> Iterator[FakeOpenAI]:
    """A backend that lists its models but crashes on every chat: the connection reset before any
    answer (the gateway reads that as `DroppedBeforeAnswer`, as for a backend it cannot reach)."""
    with FakeOpenAI() as fake:
        fake.fail_next(Fault.reset(), times=1000)  # POSTs only: the model list still answers
        yield fake


@pytest.fixture
def spared(crashing: FakeOpenAI) -> Iterator[RunningGateway]:
    with FakeOpenAI(api_key=crashing.api_key) as spare:
        env = {
            "CRASHING_URL": crashing.base_url,
            "SPARE_URL": spare.base_url,
            "BACKEND_KEY": crashing.api_key,
        }
        with running_gateway(parse_config(CRASHING, env)) as gateway:
            yield gateway


def _chats(fake: FakeOpenAI) -> int:
    return len([r for r in fake.requests if r.method == "POST"])


def test_a_backend_that_answers_its_probes_but_crashes_on_requests_gets_one_trial_per_cooldown(
    spared: RunningGateway, crashing: FakeOpenAI
) -> None:
    """The first chat's connection is reset: the breaker opens as for a backend unreachable, and the
    next probe round, which reaches the backend, half-opens it. That trial is reset too: the probes'
    word is refuted, and the breaker waits out its 30 s cooldown. Every probe round half-opened it
    again, so the backend got one failed (failed-over) request per probe interval."""
    client = openai.OpenAI(base_url=f"{spared.url}/v1", api_key=DEMO_KEY, max_retries=0, timeout=10)
    breakers = runtime(spared).router.breakers
    tried = []

    def chat() -> None:
        raw = client.chat.completions.with_raw_response.create(model="spared", messages=HI)  # type: ignore[arg-type]
        assert raw.parse().choices[0].message.content == HI[0]["content"]  # the spare answered
        tried.append(route_header(raw)["tried"])

    deadline = time.monotonic() + 5
    while _chats(crashing) < 2:  # the opening, then the trial a probe let through
        assert time.monotonic() < deadline, "no probe round half-opened the breaker"
        chat()
        time.sleep(PROBE_INTERVAL / 4)
    assert tried[0] == tried[-1] == "gpt-4o-mini:502,spare-mini:ok"
    for _ in range(8):  # over five more probe rounds
        time.sleep(PROBE_INTERVAL / 1.5)
        chat()
    assert _chats(crashing) == 2, "a probe round half-opened the breaker again"
    assert tried[-8:] == ["gpt-4o-mini:open,spare-mini:ok"] * 8
    assert breakers.state(KEY) is State.OPEN and breakers.get(KEY).refuted


# --- the breakers, step by step -------------------------------------------------------------------------


def _breakers(shared: MemoryState | None = None) -> Breakers:
    breakers = Breakers(shared)
    breakers.get(KEY, BreakerSettings(failures=1, cooldown=30))
    return breakers


async def test_a_failed_trial_on_the_probes_word_waits_out_its_cooldown_until_a_request_succeeds() -> None:
    """Refuted, the probes' word counts for nothing on that backend: a probe that reaches it half-opens
    no opening, through the trials the cooldown lets through, until a request succeeds there. Then
    an opening for a backend unreachable half-opens on a probe's reach again."""
    shared = MemoryState()
    breakers = _breakers(shared)
    breaker = breakers.get(KEY)
    await breakers.failure(KEY, unreachable=True)  # a connection reset: unreachable
    assert breaker.unreachable and await shared.kv_get(PREFIX + KEY) == OPENED_UNREACHABLE
    breakers.reached(KEY)
    assert breakers.state(KEY) is State.HALF_OPEN and await breakers.allow(KEY)  # the probes' trial...
    await breakers.failure(KEY, unreachable=True)  # ...reset too
    assert await shared.kv_get(PREFIX + KEY) == OPENED  # a plain opening: no replica contests it on probes
    breakers.reached(KEY)
    assert breakers.state(KEY) is State.OPEN  # the probes no longer half-open it

    breaker.trip(now=time.monotonic() - 30)  # its cooldown passed: the trial it lets through...
    assert breaker.allow()
    await breakers.failure(KEY, unreachable=True)  # ...reset as well: still refuted
    breakers.reached(KEY)
    assert breakers.state(KEY) is State.OPEN

    breaker.trip(now=time.monotonic() - 30)
    assert breaker.allow()
    await breakers.success(KEY)  # the backend answers requests again
    assert breakers.state(KEY) is State.CLOSED
    await breakers.failure(KEY, unreachable=True)
    breakers.reached(KEY)
    assert breakers.state(KEY) is State.HALF_OPEN  # the probes' word counts again


async def test_only_a_requests_failure_refutes_the_probes_word() -> None:
    """A probe that fails while the probes' trial is pending says the backend went down, not that the
    probes were wrong: the opening it makes still half-opens on the next probe that reaches it. A trial
    that a request's success let through (another replica's recovery) refutes nothing either."""
    breakers = _breakers()
    await breakers.failure(KEY, probe=True)
    breakers.reached(KEY)
    await breakers.failure(KEY, probe=True)
    breakers.reached(KEY)
    assert breakers.state(KEY) is State.HALF_OPEN

    recovered = _breakers()
    await recovered.failure(KEY, unreachable=True)
    recovered.get(KEY).half_open()  # as another replica's recovery half-opens it
    assert await recovered.allow(KEY)
    await recovered.failure(KEY, unreachable=True)
    recovered.reached(KEY)
    assert recovered.state(KEY) is State.HALF_OPEN


@pytest.mark.parametrize("word", ["probe", "request"])
async def test_a_contested_trial_that_fails_refutes_the_probes_word_only_if_it_rested_on_them(
    word: str,
) -> None:
    """Replica B contests A's opening for a backend unreachable. On a probe's reach alone, B's failed
    trial refutes the probes' word: B publishes a plain opening, which a third replica C, whose probes
    reach the backend too, adopts rather than contests. On a request that answered B lately, the
    failure refutes nothing the probes said: B publishes an opening for a backend unreachable (the
    backend went down), which C contests on its probes."""
    shared = MemoryState()
    a, b, c = _breakers(shared), _breakers(shared), _breakers(shared)
    if word == "probe":
        b.reached(KEY)
    else:
        await b.success(KEY)
    c.reached(KEY)
    await a.failure(KEY, unreachable=True)
    await b.sync()
    assert b.state(KEY) is State.HALF_OPEN and await b.allow(KEY)  # contested: B's own trial...
    await b.failure(KEY, unreachable=True)  # ...reset
    refuted = word == "probe"
    assert await shared.kv_get(PREFIX + KEY) == (OPENED if refuted else OPENED_UNREACHABLE)
    await c.sync()
    assert c.state(KEY) is (State.OPEN if refuted else State.HALF_OPEN)


async def test_only_its_half_open_trial_closes_a_breaker_that_is_not_closed() -> None:
    """A success that was no trial (a request let through while the breaker was closed, answering
    after it opened) closes neither an open breaker nor a half-open one, whose trial decides. On a
    closed breaker it starts the count of failures again, as any success."""
    breakers = Breakers()
    breaker = breakers.get(KEY, BreakerSettings(failures=2, cooldown=30))
    await breakers.failure(KEY)
    await breakers.success(KEY, trial=None)
    await breakers.failure(KEY)
    assert breakers.state(KEY) is State.CLOSED  # one failure in a row, not two
    await breakers.failure(KEY)
    await breakers.success(KEY, trial=None)
    assert breakers.state(KEY) is State.OPEN
    breaker.trip(now=time.monotonic() - 30)
    assert breaker.allow()  # the trial, under way
    await breakers.success(KEY, trial=None)
    assert breakers.state(KEY) is State.HALF_OPEN and not breaker.allow()
    await breakers.success(KEY)  # the trial's
    assert breakers.state(KEY) is State.CLOSED


async def test_a_trial_let_through_before_the_latest_opening_does_not_close_the_breaker() -> None:
    """Trial A, silent for a cooldown, no longer holds the breaker: B goes as the trial, fails, and
    opens the breaker again. Then A answers. Let through before that opening, it says nothing of it
    (B's failure is the latest word on the backend), as a request let through while the breaker was
    closed says nothing: the breaker stays open, and no recovery goes to the fleet. It closed the
    breaker and published that. A trial let through after the opening closes it."""
    shared = MemoryState()
    breakers = _breakers(shared)
    breaker = breakers.get(KEY)
    now = time.monotonic()
    breaker.trip(now=now - 61)
    assert breaker.allow(now=now - 31)  # A, half-open's trial...
    a = breaker.trial()
    assert a is not None and await breakers.allow(KEY)  # ...silent for a cooldown: B is the trial
    await breakers.failure(KEY)  # B fails: open again
    await breakers.success(KEY, a)  # A's answer
    assert breakers.state(KEY) is State.OPEN, "a trial let through before the opening closed it"
    assert await shared.kv_get(PREFIX + KEY) == OPENED
    breaker.trip(now=time.monotonic() - 30)
    assert breaker.allow()  # C, let through after the opening
    await breakers.success(KEY, breaker.trial())
    assert breakers.state(KEY) is State.CLOSED


def test_a_trials_end_without_a_verdict_frees_the_breaker_only_while_that_trial_holds_it() -> None:
    """Trial A, silent for a cooldown, no longer holds the breaker: request C goes as the trial. A
    then ends without a verdict (a hedge's loser, its client left): that freed C's hold, and a third
    request went beside C. Only C's own end frees it now."""
    breaker = CircuitBreaker(BreakerSettings(failures=1, cooldown=0.2))
    breaker.trip(now=100.0)
    assert breaker.allow(now=100.2)
    a = breaker.trial()
    assert a is not None and not breaker.admits(now=100.3)
    assert breaker.allow(now=100.41)  # A silent for a cooldown: C is the trial
    c = breaker.trial()
    assert c is not None and c != a
    breaker.release(a)
    assert not breaker.admits(now=100.42), "A's end freed C's trial: a second one went beside it"
    breaker.release(c)
    assert breaker.admits(now=100.42) and breaker.allow(now=100.42)  # the next request's trial
