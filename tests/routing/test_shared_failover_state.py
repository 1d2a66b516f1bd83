"""State shared across gateway replicas for failover: circuit breakers published through Redis and
adopted by the other replicas' health loops, and what each replica's own probes then make of them.

Two replicas here are either two breaker sets with their own health probers over one Redis (driven
round by round, so the order of events is exact), or two real gateways (their own SQLite admin DB
each, one Redis) in front of a fake OpenAI backend, with the official SDK as client. Also: openings
adopted while the route table changes, and routed traffic while Redis is away and after it returns.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import redis

from gateway.admin import control_plane
from gateway.app import create_app
from gateway.config import parse_config
from gateway.router_basic import ModelTable
from gateway.runtime import Gateway
from gateway.state import MemoryState
from gateway.state.degradable import DegradableState
from gateway.state.redis import RedisState
from gateway.transport import Transport
from routing.breaker import OPENED, OPENED_UNREACHABLE, PREFIX, TRIAL_RECHECK_S, Breakers, State
from routing.health import HealthProber
from routing.router import Router
from routing.routes import Breaker as BreakerSettings
from routing.routes import Candidate, Route
from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.db import REDIS_PORT, REDIS_URL
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.reliability.proxy import ThreadedProxy

pytestmark = pytest.mark.redis

KEY = Breakers.key("openai", "gpt-4o-mini")
DEMO_KEY = "sk-weir-shared-failover-demo"
HI = [{"role": "user", "content": "hello replicas"}]

# --- two replicas' breakers and probers, round by round ----------------------------------------------


@pytest.fixture
def backend() -> Iterator[FakeOpenAI]:
    """A fake OpenAI of this test's own: it is taken down and brought back on the same port."""
    with FakeOpenAI() as fake:
        yield fake


@asynccontextmanager
async def _states(
    redis_prefix: str, count: int = 2, redis_url: str = REDIS_URL
) -> AsyncIterator[list[DegradableState]]:
    """The shared states of `count` replicas over one Redis (at `redis_url`), closed after."""
    states = [DegradableState(RedisState.from_url(redis_url, prefix=redis_prefix)) for _ in range(count)]
    try:
        yield states
    finally:
        for state in states:
            await state.close()


def _holding(states: Sequence[object], settings: BreakerSettings, tripped: bool = False) -> list[Breakers]:
    """A breaker set per replica's state, each holding `KEY` with `settings`; `tripped`: open, its
    cooldown just over."""
    replicas = [Breakers(state) for state in states]
    for breakers in replicas:
        breaker = breakers.get(KEY, settings)
        if tripped:
            breaker.trip(now=time.monotonic() - settings.cooldown)
    return replicas


@asynccontextmanager
async def probed_replicas(
    base_url: str, redis_prefix: str, settings: BreakerSettings, count: int = 2
) -> AsyncIterator[list[tuple[Breakers, HealthProber]]]:
    """`count` replicas over one Redis: each a breaker set holding `KEY` with `settings`, and a health
    prober of its own watching the backend at `base_url` (driven with `run_once`)."""
    config = parse_config(
        f'backends:\n  - {{name: openai, type: openai, base_url: "{base_url}", api_key: k}}\n'
        "models:\n  - {name: gpt-4o-mini, backend: openai}\n",
        {},
    )
    transport = Transport()
    async with _states(redis_prefix, count) as states:
        replicas = []
        for breakers in _holding(states, settings):
            prober = HealthProber(transport, breakers, interval=60, timeout=1.0)
            prober.watch({"openai": (config.backends[0], [KEY])})
            replicas.append((breakers, prober))
        try:
            yield replicas
        finally:
            await transport.close()


async def test_an_adopted_probe_opening_half_opens_when_this_replicas_probes_reach_the_backend(
    backend: FakeOpenAI, redis_prefix: str
) -> None:
    """The backend goes down. Replica A's probes open its breaker (two failed rounds) and publish it;
    replica B, one failed round behind, adopts the opening on that round. The backend comes back:
    A's next probe half-opens its breaker at once (documented: a breaker the probes opened goes
    half-open as soon as a probe reaches the backend again). B's probe reaches it too, so B must
    half-open as well, not refuse a backend it can reach for the rest of a 30 s cooldown (it did:
    the adopted opening lost the fact that probes caused it)."""
    async with probed_replicas(backend.base_url, redis_prefix, BreakerSettings(failures=2, cooldown=30)) as (
        (a, a_prober),
        (b, b_prober),
    ):
        backend.stop()
        await a_prober.run_once()
        await a_prober.run_once()  # A: two failures, open, published
        assert a.state(KEY) is State.OPEN
        await b_prober.run_once()  # B: one failure of its own, then it adopts A's opening
        assert b.state(KEY) is State.OPEN and (KEY, State.OPEN) in b.transitions

        backend.start()
        await a_prober.run_once()
        assert a.state(KEY) is State.HALF_OPEN  # A's own probe opening: half-open at once
        await b_prober.run_once()
        assert b.state(KEY) is State.HALF_OPEN, "B's probe reached the backend, yet B still refuses it"
        assert b.get(KEY).allow() and not b.get(KEY).allow()  # one trial on B, as on A


async def test_a_probe_opening_is_one_trial_on_a_replica_whose_probes_reach_the_backend(
    backend: FakeOpenAI, redis_prefix: str
) -> None:
    """A partition seen by the probes: A's cannot reach the backend (A's breaker opens, published as
    the probes' opening), B's reach it. B's probe round reads the opening after its own probe reached
    the backend: B half-opens at once (`cause=contested`), its next request being its trial, rather
    than refusing the backend until its next probe round."""
    async with probed_replicas(backend.base_url, redis_prefix, BreakerSettings(failures=1, cooldown=30)) as (
        (a, _),
        (b, prober),
    ):
        await a.failure(KEY, probe=True)  # A's probe could not reach it
        await prober.run_once()  # B's reaches it, then B reads A's opening
        assert b.state(KEY) is State.HALF_OPEN and (KEY, State.OPEN) not in b.transitions
        assert await b.allow(KEY) and not await b.allow(KEY)  # one trial, B's own


async def test_an_adopted_opening_for_bad_answers_still_waits_out_its_cooldown(
    backend: FakeOpenAI, redis_prefix: str
) -> None:
    """The other side of the same rule: an opening caused by failed requests (5xx answers, which a
    model list cannot show are over) is adopted as such, so B's healthy probes do not half-open it."""
    async with probed_replicas(backend.base_url, redis_prefix, BreakerSettings(failures=2, cooldown=30)) as (
        (a, _),
        (b, prober),
    ):
        for _ in range(2):
            await a.failure(KEY)  # two 500s answered on A
        await prober.run_once()  # B's probe is fine; it adopts A's opening
        assert b.state(KEY) is State.OPEN
        await prober.run_once()
        assert b.state(KEY) is State.OPEN  # the probes cannot tell the answers are good again


# --- two real gateways over one Redis -----------------------------------------------------------------

# What each gateway of a fleet has besides its config: an admin DB of its own, the one Redis, a tenant.
PLUMBING = """\
database_url: "${DB_URL}"
redis_url: "${REDIS_URL}"
tenants:
  - {name: demo, api_keys: ["${DEMO_KEY}"]}
"""


def _runtime(app: object) -> Gateway:
    return app.state.gateway  # type: ignore[attr-defined]


class _Fleet:
    """Gateways over one Redis, each with its own admin DB and usage spool."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp_path, self.monkeypatch = tmp_path, monkeypatch

    @contextmanager
    def start(
        self, config: str, base_urls: Sequence[str], backend_key: str, **env: str
    ) -> Iterator[tuple[list[str], list[Breakers]]]:
        """A gateway on `config` (and `PLUMBING`) for each of `base_urls`, its `${BACKEND_URL}`: their
        URLs and breakers. `env` sets the config's other variables, or others than the usual ones."""
        with ExitStack() as stack:
            urls, breakers = [], []
            for i, base_url in enumerate(base_urls):
                self.monkeypatch.setenv("WEIR_USAGE_SPOOL", str(self.tmp_path / f"spool{i}"))
                values = {
                    "BACKEND_URL": base_url,
                    "BACKEND_KEY": backend_key,
                    "DB_URL": f"sqlite+aiosqlite:///{self.tmp_path}/weir{i}.db",
                    "REDIS_URL": REDIS_URL,
                    "DEMO_KEY": DEMO_KEY,
                    **env,
                }
                app = create_app(parse_config(config + PLUMBING, values))
                urls.append(stack.enter_context(serve(app, free_port())))
                breakers.append(_runtime(app).router.breakers)
            yield urls, breakers


@pytest.fixture
def fleet(redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Fleet:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", "admin-token-shared-failover")
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    return _Fleet(tmp_path, monkeypatch)


REPLICA = """\
backends:
  - {name: openai, type: openai, base_url: "${BACKEND_URL}", api_key: "${BACKEND_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
routes:
  - name: solo
    probe_interval: 0.2
    retry: {attempts: 1}
    breaker: {failures: 2, cooldown: 30}
    candidates: [{model: gpt-4o-mini}]
"""


def _status(url: str, model: str = "solo") -> int:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=DEMO_KEY, max_retries=0, timeout=10)
    try:
        client.chat.completions.create(model=model, messages=HI)  # type: ignore[arg-type]
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def test_a_replica_that_reaches_the_backend_serves_it_while_another_replica_cannot(
    backend: FakeOpenAI, fleet: _Fleet
) -> None:
    """A partition: replica 0 cannot reach the backend (its probes open the breaker and publish it),
    replica 1 can. Replica 1 reads the opening after its own probes reached the backend: it half-opens
    (`cause=contested`), never open, and serves its very next request from the backend. It answered
    every request to the one-candidate route with 503 for the whole 30 s cooldown once, and later
    until its next probe round."""
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with fleet.start(REPLICA, (dead, backend.base_url), backend.api_key) as (urls, (cut_off, reaching)):
        assert _next_move(reaching, 0) is State.HALF_OPEN, "replica 1 refused a backend it reaches"
        assert cut_off.state(KEY) is State.OPEN
        assert _status(urls[1]) == 200
        assert reaching.state(KEY) is State.CLOSED  # its trial answered
        assert _status(urls[0]) == 503  # replica 0 still cannot reach it, and says so


# --- another replica's opening against this replica's own word ----------------------------------------

CONTESTED = """\
backends:
  - {name: openai, type: openai, base_url: "${BACKEND_URL}", api_key: "${BACKEND_KEY}"}
  - {name: spare, type: openai, base_url: "${SPARE_URL}", api_key: "${BACKEND_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
  - {name: spare-mini, backend: spare, model: gpt-4o-mini, price: {input: 0.15, output: 0.60}}
routes:
  - name: solo
    probe_interval: null
    retry: {attempts: 1}
    breaker: {failures: 1, cooldown: 30}
    candidates: [{model: gpt-4o-mini}]
  - name: spared
    probe_interval: null
    retry: {attempts: 1}
    breaker: {failures: 1, cooldown: 30}
    candidates: [{model: gpt-4o-mini}, {model: spare-mini}]
  # No breaker, no probes of its own: its interval only paces the health loop, whose rounds sync
  # the breakers across the replicas (openings here come from requests, not probes).
  - {name: pacer, probe_interval: 0.1, breaker: null, candidates: [{model: gpt-4o-mini}]}
"""


@pytest.fixture
def spare() -> Iterator[FakeOpenAI]:
    """The backend of `CONTESTED`'s `spare-mini`, which every replica reaches."""
    with FakeOpenAI() as fake:
        yield fake


def _next_move(breakers: Breakers, seen: int) -> State:
    """What `breakers` moved to after its first `seen` transitions, waiting for it (a health-loop
    round reads the shared state every 0.1 s here)."""
    deadline = time.monotonic() + 10
    while len(breakers.transitions) <= seen:
        assert time.monotonic() < deadline, "the breaker never moved: the shared state was not read"
        time.sleep(0.02)
    key, state = breakers.transitions[seen]
    assert key == KEY
    return state


def _posts(fake: FakeOpenAI) -> int:
    return len([r for r in fake.requests if r.method == "POST"])


def test_a_replica_cut_off_from_a_backend_does_not_take_it_from_a_replica_it_answers(
    backend: FakeOpenAI, spare: FakeOpenAI, fleet: _Fleet
) -> None:
    """A split network: replica A cannot reach the backend (its base URL is a dead port), B can and
    serves from it. A's failed request opens its breaker and publishes the opening. B saw the backend
    answer moments ago, so it must not refuse it: the opening makes B's next request its own trial
    (half-open, `cause=contested`), which answers, closes B's breaker and publishes a recovery. A reads
    that, tries once more (failing), publishes again, and so on: through every such cycle each of
    B's clients is served from the backend, B's trial being one of its own requests. B adopted each
    opening outright and answered 503 for a 30 s cooldown, again after every failure of A's."""
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with fleet.start(
        CONTESTED, (dead, backend.base_url), spare.api_key, SPARE_URL=spare.base_url
    ) as gateways:
        urls, (cut_off, reaching) = gateways
        assert _status(urls[1]) == 200  # B's own word: the backend answers it
        statuses = []
        for _ in range(3):
            a_moves, b_moves = len(cut_off.transitions), len(reaching.transitions)
            assert _status(urls[0]) == 503  # A's request (a trial after the first cycle) was sent...
            assert _next_move(cut_off, a_moves) is State.OPEN  # ...failed, and opened A's breaker: published
            assert _next_move(reaching, b_moves) is State.HALF_OPEN, "B refuses a backend that answers it"
            statuses.append(_status(urls[1]))  # B's trial: one of its clients' requests
            assert reaching.state(KEY) is State.CLOSED  # published as a recovery...
            assert _next_move(cut_off, a_moves + 1) is State.HALF_OPEN  # ...which A reads
        assert statuses == [200] * 3
        assert State.OPEN not in [state for _, state in reaching.transitions]
        assert _posts(backend) == 4  # B's four requests, nothing more; A's never arrived
        assert _posts(spare) == 0


@pytest.mark.parametrize("answered_here", [True, False], ids=["answered_here", "nothing_here"])
def test_in_an_outage_a_replica_that_saw_the_backend_answer_pays_one_failed_over_attempt(
    answered_here: bool, backend: FakeOpenAI, spare: FakeOpenAI, redis_prefix: str, fleet: _Fleet
) -> None:
    """The backend goes down for everyone. A's request fails over to the spare and A's breaker opens.
    B, which saw the backend answer before the outage, contests the opening: its next request tries
    the backend once (failing over to the spare, so its client sees nothing), and that opens B's
    breaker too; after it B skips the backend. A replica with no word of its own on the backend
    adopts the opening at once, as before, and never tries it."""
    with fleet.start(CONTESTED, (backend.base_url,) * 2, spare.api_key, SPARE_URL=spare.base_url) as gateways:
        urls, (_, b) = gateways
        if answered_here:
            assert _status(urls[1], "spared") == 200
        backend.stop()
        assert _status(urls[0], "spared") == 200  # the spare answered A
        assert _next_move(b, 0) is (State.HALF_OPEN if answered_here else State.OPEN)
        client = openai.OpenAI(base_url=f"{urls[1]}/v1", api_key=DEMO_KEY, max_retries=0, timeout=10)
        tried = []
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(model="spared", messages=HI)  # type: ignore[arg-type]
            assert raw.parse().choices[0].message.content == HI[0]["content"]  # answered by the spare
            route = raw.headers["x-weir-route"]
            tried.append(re.search(r"tried=gpt-4o-mini:(\w+)", route).group(1))  # type: ignore[union-attr]
        assert tried == (["503", "open", "open"] if answered_here else ["open"] * 3)
        assert b.state(KEY) is State.OPEN
        with redis.Redis.from_url(REDIS_URL) as shared:
            # B's own opening, published: its trial's connection was refused (the backend is down)
            assert shared.get(f"{redis_prefix}{PREFIX}{KEY}") == OPENED_UNREACHABLE


async def _after_a_probe_round(base_url: str, redis_prefix: str) -> State:
    """Replica B, which never sent the backend a request: its breaker after one health-probe round
    against `base_url` (its probe, then the openings published in Redis)."""
    async with probed_replicas(base_url, redis_prefix, BreakerSettings(failures=1, cooldown=30), 1) as [
        (breakers, prober)
    ]:
        await prober.run_once()
        return breakers.state(KEY)


@pytest.mark.parametrize(
    ("cause", "told", "published", "on_b"),
    [
        ("refused", 503, OPENED_UNREACHABLE, State.HALF_OPEN),
        ("reset", 502, OPENED_UNREACHABLE, State.HALF_OPEN),
        ("500", 502, OPENED, State.OPEN),
    ],
)
def test_a_replica_whose_probes_reach_the_backend_contests_an_opening_for_connections_that_failed(
    cause: str,
    told: int,
    published: bytes,
    on_b: State,
    backend: FakeOpenAI,
    spare: FakeOpenAI,
    redis_prefix: str,
    fleet: _Fleet,
) -> None:
    """A's request never reached the backend's answer: its connection was refused (A's base URL is a
    dead port: a partition) or dropped before any response. A's breaker opens as for a backend it
    cannot reach, and publishes that, as its probes would have: replica B, whose probes reach the
    backend but which sent it no request yet, contests it (half-open, its next request its own trial)
    rather than refusing for a cooldown a backend it reaches. It adopted it, since A's opening read as
    one for bad answers, which only a request of B's own could contest. A 500 is a bad answer: B
    adopts that opening, its probes notwithstanding."""
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    base_url = dead if cause == "refused" else backend.base_url
    with fleet.start(CONTESTED, (base_url,), spare.api_key, SPARE_URL=spare.base_url) as (urls, (a,)):
        if cause == "reset":
            backend.fail_next(Fault.reset())
        elif cause == "500":
            backend.fail_next(500)
        assert _status(urls[0], "solo") == told
        assert a.state(KEY) is State.OPEN
        assert asyncio.run(_after_a_probe_round(backend.base_url, redis_prefix)) is on_b
        assert _posts(backend) == (0 if cause == "refused" else 1)  # B sent nothing: its probe decided
        with redis.Redis.from_url(REDIS_URL) as shared:
            assert shared.get(f"{redis_prefix}{PREFIX}{KEY}") == published
        assert a.get(KEY).unreachable is (published == OPENED_UNREACHABLE)  # A's probes may half-open it


async def test_another_replicas_opening_is_one_trial_here_only_after_a_recent_success_here(
    shared_pair: list[object],
) -> None:
    """What B sets against A's opening is its own latest word on the backend, within a cooldown: a
    request that succeeded there. That trial is B's own, not the fleet's (sent though A holds the
    fleet's trial), and one: a second request waits for its verdict. Without such a word (never
    answered, answered longer than a cooldown ago, or failed since), B adopts the opening."""
    settings = BreakerSettings(failures=2, cooldown=30)
    a, b = _holding(shared_pair, settings)
    a.get(KEY).trip(now=time.monotonic() - 30)
    assert await a.allow(KEY)  # A claims the fleet's trial...
    await a.failure(KEY)  # ...which fails: A's opening is published, its claim stands
    await b.success(KEY)
    await b.sync()
    assert b.state(KEY) is State.HALF_OPEN and (KEY, State.OPEN) not in b.transitions
    assert await b.allow(KEY) and not await b.allow(KEY)
    await b.failure(KEY)  # the backend is down for B too: B's own opening
    assert b.state(KEY) is State.OPEN and not await b.allow(KEY)

    stale = time.monotonic() - settings.cooldown
    for word in ("never", "stale", "failed since"):
        other = Breakers(shared_pair[1])
        breaker = other.get(KEY, settings)
        if word == "stale":
            breaker.last_success = stale
        elif word == "failed since":
            await other.success(KEY)
            await other.failure(KEY)
        await other.sync()
        assert other.state(KEY) is State.OPEN, word


@pytest.mark.parametrize(
    ("word", "published"),
    [("answered", OPENED), ("reached", OPENED_UNREACHABLE), ("stale", OPENED_UNREACHABLE)],
)
async def test_a_trial_let_through_before_another_replicas_opening_does_not_close_the_breaker(
    word: str, published: bytes, redis_prefix: str
) -> None:
    """A's trial `old`, silent for a cooldown, no longer holds its breaker: the next request goes as
    the trial, answers, and closes it. Then B opens the breaker and publishes that, and A's sync meets
    the opening: contested, on a request that answered here lately or (an opening for a backend
    unreachable) on a probe's reach alone, or adopted (no word here within a cooldown), and then
    half-open on a probe's reach. Now `old` answers: let through before that opening, it says nothing
    of it, and must close nothing, nor publish a recovery over B's opening. It closed the contested
    breaker, which kept the opening it half-opened from as its latest. A trial let through after the
    opening closes it."""
    settings = BreakerSettings(failures=1, cooldown=30)
    async with _states(redis_prefix) as states:
        a, b = _holding(states, settings)
        breaker = a.get(KEY)
        now = time.monotonic()
        breaker.trip(now=now - 61)
        assert breaker.allow(now=now - 31)  # `old`, half-open's trial...
        old = breaker.trial()
        admitted = await a.allow(KEY)  # ...silent for a cooldown: this request is the trial
        assert old is not None and admitted is not None and admitted.trial is not None
        await a.success(KEY, admitted.trial)
        assert a.state(KEY) is State.CLOSED
        if word == "reached":
            breaker.last_success = None  # A's latest word: its probe reached the backend
        elif word == "stale":
            breaker.last_success = breaker.last_reached = now - settings.cooldown

        await b.failure(KEY, unreachable=published == OPENED_UNREACHABLE)
        await a.sync()
        if word == "stale":
            assert a.state(KEY) is State.OPEN
            a.reached(KEY)  # an adopted opening for a backend unreachable: the probes' word
        assert a.state(KEY) is State.HALF_OPEN
        await a.success(KEY, old)
        assert a.state(KEY) is State.HALF_OPEN, "a trial let through before the opening closed it"
        assert await states[0].kv_get(PREFIX + KEY) == published  # no recovery over B's opening
        admitted = await a.allow(KEY)  # let through after the opening
        assert admitted is not None and admitted.trial is not None
        await a.success(KEY, admitted.trial)
        assert a.state(KEY) is State.CLOSED


# --- adopting openings while the route table changes ------------------------------------------------

TWO_MODELS = """\
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
models:
  - {name: gpt-4o-mini, backend: openai}
  - {name: gpt-5, backend: openai}
"""


class _RoutesEditedMeanwhile(MemoryState):
    """Shared state whose reads take a round trip, during which the admin API adds a route (the
    route store's poller calls `set_routes` from its own task)."""

    def __init__(self, edit: Callable[[], None]) -> None:
        super().__init__()
        self.edit: Callable[[], None] | None = edit

    async def _round_trip(self) -> None:
        if self.edit is not None:
            edit, self.edit = self.edit, None
            edit()
        await asyncio.sleep(0)

    async def kv_get(self, key: str) -> bytes | None:
        await self._round_trip()
        return await super().kv_get(key)

    async def kv_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        await self._round_trip()
        return await super().kv_get_many(keys)


async def test_openings_are_adopted_while_a_route_is_added() -> None:
    """A breaker created while the health loop reads the shared state (a route added meanwhile)
    must not abort the round: it did ("dictionary changed size during iteration"), and that round
    adopted none of the openings the other replicas had published."""
    models = ModelTable(parse_config(TWO_MODELS, {}))
    mini = Route(name="mini", candidates=[Candidate(model="gpt-4o-mini")])
    router = Router(models, [mini])
    five = Route(name="five", candidates=[Candidate(model="gpt-5")])
    state = _RoutesEditedMeanwhile(lambda: router.set_routes([mini, five]))
    router.breakers.shared = state
    await state.kv_set(PREFIX + KEY, OPENED, ttl_s=30)  # another replica opened it
    await router.breakers.sync()
    assert router.breakers.state(KEY) is State.OPEN
    assert router.breakers.state(Breakers.key("openai", "gpt-5")) is State.CLOSED


# --- Redis going away under routed traffic ----------------------------------------------------------

OUTAGE = """\
backends:
  - {name: openai, type: openai, base_url: "${BACKEND_URL}", api_key: "${BACKEND_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
  - {name: gpt-5, backend: openai, price: {input: 1.25, output: 10.0}}
routes:
  - name: solo
    probe_interval: null
    retry: {attempts: 1}
    breaker: {failures: 2, cooldown: 30}
    candidates: [{model: gpt-4o-mini}]
  - name: five
    probe_interval: null
    retry: {attempts: 1}
    breaker: {failures: 2, cooldown: 30}
    candidates: [{model: gpt-5}]
  - name: hedged
    probe_interval: null
    retry: {attempts: 1}
    hedge: {delay: 0.1}
    candidates: [{model: gpt-4o-mini}, {model: gpt-5}]
"""


def _degraded(url: str) -> float:
    match = re.search(r"^weir_shared_state_degraded (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    assert match, "the metric is exported"
    return float(match.group(1))


def test_routed_traffic_keeps_flowing_while_redis_is_away_and_shares_again_after(
    backend: FakeOpenAI, redis_prefix: str, fleet: _Fleet
) -> None:
    """Breakers and the hedge cap live in Redis; with Redis gone mid-run every routed request is still
    answered (breakers open and refuse in this process, hedges are counted here), and once Redis is
    back the breakers publish there again."""
    proxy = ThreadedProxy(REDIS_PORT)
    proxied = f"redis://127.0.0.1:{proxy.port}/0"
    try:
        with fleet.start(OUTAGE, (backend.base_url,), backend.api_key, REDIS_URL=proxied) as ([url], _):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=DEMO_KEY, max_retries=0, timeout=10)
            assert _status(url) == 200 and _degraded(url) == 0

            proxy.stop()
            assert [_status(url) for _ in range(3)] == [200] * 3
            backend.set_latency(first_token=0.4)  # slower than the hedge delay
            raw = client.chat.completions.with_raw_response.create(model="hedged", messages=HI)  # type: ignore[arg-type]
            assert raw.parse().choices[0].message.content == HI[0]["content"]
            assert "hedged=gpt-5" in raw.headers["x-weir-route"]  # the cap was counted in-process
            backend.set_latency()
            backend.fail_next(500, times=2)
            assert [_status(url) for _ in range(3)] == [502, 502, 503]  # opened here, refused here
            assert _degraded(url) == 1

            proxy.start()
            time.sleep(1.2)  # the state retries Redis after a second
            backend.fail_next(500, times=2)
            assert [_status(url, "five") for _ in range(2)] == [502, 502]
            with redis.Redis.from_url(REDIS_URL) as shared:
                stored = shared.get(f"{redis_prefix}{PREFIX}openai/gpt-5")
            assert stored == OPENED  # published in Redis again: the other replicas adopt it
            assert _degraded(url) == 0
    finally:
        proxy.close()


# --- recoveries and half-open trials across replicas ------------------------------------------------


async def test_a_recovery_on_one_replica_half_opens_the_breaker_the_others_hold_open(
    redis_prefix: str,
) -> None:
    """A's requests fail and open the breaker, B adopts the opening (30 s cooldown). The backend comes
    back and A's trial proves it: B must stop refusing it at its next sync, with one trial of its own
    (half-open, not closed: the success was A's; see Breakers._recovered_elsewhere). The recovery was
    published but never read: B refused the backend for the rest of its cooldown."""
    async with _states(redis_prefix) as states:
        a, b = _holding(states, BreakerSettings(failures=2, cooldown=30))
        for _ in range(2):
            await a.failure(KEY)
        await b.sync()
        assert b.state(KEY) is State.OPEN
        a.get(KEY).trip(now=time.monotonic() - 30)  # A's cooldown is over: its trial goes...
        assert await a.allow(KEY)
        await a.success(KEY)  # ...and answers
        assert a.state(KEY) is State.CLOSED

        await b.sync()
        assert b.state(KEY) is State.HALF_OPEN, "B refuses a backend A has seen answer"
        assert (KEY, State.HALF_OPEN) in b.transitions
        # B's own trial, though A still holds the fleet's claim: the backend was seen up.
        assert await b.allow(KEY) and not await b.allow(KEY)
        await b.success(KEY)
        assert b.state(KEY) is State.CLOSED
        await a.sync()  # B's recovery is no news to A, which is closed
        assert a.state(KEY) is State.CLOSED


class _Clocked(MemoryState):
    """One shared state for two replicas (as Redis is), on a clock the test moves."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000_000.0

    def _now(self) -> float:  # type: ignore[override]
        return self.now


async def test_a_recovery_outlives_a_sync_interval_longer_than_a_second() -> None:
    """The health loop syncs every probe interval (10 s by default). A recovery published for 1 s
    was gone by the time the other replica looked: it must last as long as an opening it can end."""
    shared = _Clocked()
    a, b = _holding([shared, shared], BreakerSettings(failures=1, cooldown=30))
    await a.failure(KEY)
    await b.sync()
    assert b.state(KEY) is State.OPEN
    a.get(KEY).trip(now=time.monotonic() - 30)
    assert await a.allow(KEY)
    await a.success(KEY)
    shared.now += 10  # B's next probe round
    await b.sync()
    assert b.state(KEY) is State.HALF_OPEN
    shared.now += 25  # past a cooldown, when every opening it could end has ended anyway
    assert await shared.kv_get(PREFIX + KEY) is None


async def test_one_half_open_trial_for_the_whole_fleet_and_a_dead_holder_blocks_it_one_cooldown(
    redis_prefix: str,
) -> None:
    """Both replicas' breakers are open on a dead backend and their cooldowns pass: only one trial
    goes to it for the fleet, not one per replica. A holder that dies with its trial (never reports)
    holds the fleet's trial no longer than a cooldown."""
    cooldown = 0.3
    async with _states(redis_prefix) as states:
        a, b = _holding(states, BreakerSettings(failures=1, cooldown=cooldown), tripped=True)
        assert await a.allow(KEY)  # A's trial is the fleet's
        assert not await b.allow(KEY), "B sent a second trial to the dead backend"
        assert b.state(KEY) is State.HALF_OPEN and not b.get(KEY).admits()  # policies skip it too
        started = time.monotonic()
        while not await b.allow(KEY):  # A died with its trial: B takes over once the claim lapses
            assert time.monotonic() - started < cooldown + 1, "a dead replica's trial blocks the fleet"
            await asyncio.sleep(0.02)
        await b.failure(KEY)  # still dead: the next trial, anywhere, a cooldown after B's claim
        a.get(KEY).release(a.get(KEY).trial_started)  # A's trial ends without a verdict
        assert not await a.allow(KEY)


async def test_without_redis_each_replica_sends_its_own_half_open_trial(redis_prefix: str) -> None:
    """Redis down degrades the fleet's trial to today's per-replica one, never to refusing the
    backend: through the in-process fallback, and with a state that has none."""
    proxy = ThreadedProxy(REDIS_PORT)
    bare = RedisState.from_url(f"redis://127.0.0.1:{free_port()}/0", prefix=redis_prefix)
    try:
        async with _states(redis_prefix, redis_url=f"redis://127.0.0.1:{proxy.port}/0") as states:
            replicas = _holding([*states, bare], BreakerSettings(failures=1, cooldown=30), tripped=True)
            proxy.stop()
            started = time.monotonic()
            for breakers in replicas:
                assert await breakers.allow(KEY)
                assert not await breakers.allow(KEY)  # one trial per replica, as ever
            assert time.monotonic() - started < 5
    finally:
        await bare.close()
        proxy.close()


TRIALS = """\
backends:
  - {name: openai, type: openai, base_url: "${BACKEND_URL}", api_key: "${BACKEND_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
routes:
  - name: solo
    probe_interval: null
    retry: {attempts: 1}
    breaker: {failures: 1, cooldown: 30}
    candidates: [{model: gpt-4o-mini}]
"""


@contextmanager
def _two_gateways_past_their_cooldown(fleet: _Fleet, backend: FakeOpenAI) -> Iterator[list[str]]:
    """Two gateways over one Redis (`TRIALS`), each with the backend's breaker open and its cooldown
    over: their URLs."""
    with fleet.start(TRIALS, (backend.base_url,) * 2, backend.api_key) as (urls, replicas):
        for breakers in replicas:
            breakers.get(KEY).trip(now=time.monotonic() - 30)
        yield urls


def test_two_gateways_send_one_half_open_trial_to_a_backend_that_is_still_down(
    backend: FakeOpenAI, fleet: _Fleet
) -> None:
    """Two gateways over one Redis, each with the backend's breaker open and its cooldown over; the
    backend still fails. The first gateway's request is the trial (502) and re-opens its breaker;
    the second gateway's request must not be a second trial to the same dead backend: it is refused
    (503, retry later) while the fleet's trial holds. It went to the backend too."""
    with _two_gateways_past_their_cooldown(fleet, backend) as urls:
        backend.fail_next(500, times=2)
        assert [_status(url) for url in urls] == [502, 503]
        assert len([r for r in backend.requests if r.method == "POST"]) == 1


def test_a_gateway_refused_the_fleets_trial_serves_once_that_trial_succeeds(
    backend: FakeOpenAI, fleet: _Fleet
) -> None:
    """Two gateways over one Redis, the backend's breaker open on both and its cooldown over; the
    backend is back. The first gateway's request is the fleet's trial (slow: a second); the second
    gateway's, meanwhile, is refused (503) while it runs. The trial answers and publishes the
    recovery: the second gateway must serve the backend again within a recheck, not refuse it until
    its health loop reads the recovery or the claim lapses (30 s here, no probes)."""
    with _two_gateways_past_their_cooldown(fleet, backend) as urls:
        backend.fail_next(Fault.delay(1.0))
        with ThreadPoolExecutor(1) as pool:
            trial = pool.submit(_status, urls[0])
            while not backend.posts:
                time.sleep(0.01)
            assert _status(urls[1]) == 503  # the fleet's trial is under way on the first
            assert trial.result() == 200
        answered = time.monotonic()
        while _status(urls[1]) != 200:
            waited = time.monotonic() - answered
            assert waited < 2 * TRIAL_RECHECK_S + 1, "refused a backend the fleet's trial found answering"
            time.sleep(0.05)


@pytest.fixture(params=["redis", "memory"])
async def shared_pair(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[list[object]]:
    """The states of two replicas: each its own over one Redis, or one in-process state for both."""
    if request.param == "memory":
        shared = MemoryState()
        yield [shared, shared]
        return
    async with _states(redis_prefix) as states:
        yield list(states)


async def test_a_replica_refused_the_fleets_trial_takes_its_own_once_that_trial_succeeded(
    shared_pair: list[object],
) -> None:
    """B was refused the fleet's trial while A's ran; A's trial answered (A closes, and publishes the
    recovery). Without a health-loop round in between, B's next requests must reach the backend
    within TRIAL_RECHECK_S: one trial of B's own, as after a sync that read the recovery. It refused
    the backend until the claim lapsed (a cooldown: 30 s)."""
    a, b = _holding(shared_pair, BreakerSettings(failures=1, cooldown=30), tripped=True)
    assert await a.allow(KEY)  # A's trial is the fleet's
    assert not await b.allow(KEY)
    await a.success(KEY)
    answered = time.monotonic()
    while not await b.allow(KEY):
        assert time.monotonic() - answered < TRIAL_RECHECK_S + 1, "B refuses a backend A's trial found up"
        await asyncio.sleep(0.02)
    assert b.state(KEY) is State.HALF_OPEN and not await b.allow(KEY)  # one trial, B's own
    await b.success(KEY)
    assert b.state(KEY) is State.CLOSED


async def test_a_replica_whose_cooldown_ends_after_the_fleets_trial_succeeded_is_not_refused(
    shared_pair: list[object],
) -> None:
    """A's trial answered; B's breaker (opened later, by its own requests) comes out of its cooldown
    while A's claim still stands. The claim is of a trial that is over and found the backend up: B
    sends its own trial at once, rather than being refused until the claim lapses."""
    a, b = Breakers(shared_pair[0]), Breakers(shared_pair[1])
    a.get(KEY, BreakerSettings(failures=1, cooldown=30)).trip(now=time.monotonic() - 30)
    assert await a.allow(KEY)
    await a.success(KEY)
    b.get(KEY, BreakerSettings(failures=1, cooldown=30)).trip(now=time.monotonic() - 30)
    assert await b.allow(KEY)
    assert not await b.allow(KEY)


def test_a_redis_url_without_a_database_says_that_replicas_share_no_breakers(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis is the control plane's shared state, which is on only with a database: a fleet given
    `redis_url` alone kept breakers and hedge caps per replica without a word."""
    monkeypatch.delenv("WEIR_DATABASE_URL", raising=False)
    monkeypatch.delenv("WEIR_REDIS_URL", raising=False)
    config = parse_config(f"redis_url: {REDIS_URL}\nbackends: []\nmodels: []\n", {})
    with caplog.at_level("WARNING", logger=control_plane.__name__):
        assert control_plane.from_config(config) is None
    assert any("redis_url is set but no database_url" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger=control_plane.__name__):
        assert control_plane.from_config(parse_config("backends: []\nmodels: []\n", {})) is None
    assert not caplog.records  # no Redis, no database: nothing to say
