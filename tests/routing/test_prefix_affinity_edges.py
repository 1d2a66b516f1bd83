"""`prefix_affinity` at its edges: replicas overloaded or behind an open breaker, routes edited while
prefixes are remembered, prompts with no text or a few-shot template, and the in-flight counts
`max_in_flight` reads when attempts are cancelled or their client leaves. Planned in-process (no HTTP)
except where the client's side of the exchange is what is under test."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest

from gateway.auth import Principal
from gateway.config import parse_config
from gateway.pipeline import Call, RequestInfo
from gateway.router_basic import ModelTable
from gateway.types import ChatRequest
from routing.breaker import Breakers
from routing.execute import Executor, Operation
from routing.plan import Choice, Features, Plan, features
from routing.policies import PolicyContext
from routing.prefixes import cuts, prefix_keys
from routing.router import Router
from routing.routes import Candidate, Hedge, Route
from routing.stats import RoutingStats
from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import engine_replicas, route_header, runtime, sent, settled

CONFIG = """\
backends:
  - {name: e1, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
  - {name: e2, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
  - {name: e3, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
models:
  - {name: r1, backend: e1}
  - {name: r2, backend: e2}
  - {name: r3, backend: e3}
"""
ANYONE = Principal(tenant_id="t", tenant_name="t", key_id="k")
TEXT = random.Random()


@pytest.fixture(autouse=True)
def _same_text() -> None:
    TEXT.seed(7)  # each test its own text, whichever tests run before it


def words(n: int, rng: random.Random = TEXT) -> str:
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(6)) for _ in range(n))


def affinity(*models: str, max_in_flight: int | None = None, **fields: object) -> Route:
    return Route(
        name="chat",
        policy="prefix_affinity",
        candidates=[Candidate(model=m, max_in_flight=max_in_flight) for m in models],
        probe_interval=None,
        **fields,  # type: ignore[arg-type]
    )


def router(*routes: Route) -> Router:
    r = Router(ModelTable(parse_config(CONFIG, {})), routes)
    r.context.rng = random.Random(0)
    return r


def chat(*turns: str | list[dict[str, Any]], system: str | None = None) -> Features:
    """A request whose messages alternate user, assistant, user, ... (after an optional system one)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, content in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    request = msgspec.convert({"model": "chat", "messages": messages}, ChatRequest)
    return features(request, ANYONE.tenant_name, ANYONE.key_id)


def header(plan: Plan) -> dict[str, str]:
    return dict(part.split("=", 1) for part in plan.header().split("; "))


def key(choice: Choice) -> str:
    return Breakers.key(choice.target.backend.name, choice.target.upstream_model)


def served(r: Router, plan: Plan) -> Choice:
    """The candidate the executor takes: the first whose breaker lets a request through."""
    plan.chosen = next(c for c in plan.choices if r.breakers.get(key(c), plan.route.breaker).allow())
    return plan.chosen


# --- overload and breakers --------------------------------------------------------------------------


async def test_with_every_replica_overloaded_the_preferred_one_still_takes_the_request() -> None:
    r = router(affinity("r1", "r2", "r3", max_in_flight=2))
    document = words(200)
    first = (
        (await sent(r.plan("chat", ANYONE, chat(document + " first question")))).choices[0].candidate.model
    )
    for model in ("r1", "r2", "r3"):
        r.context.in_flight[model] = 2
    plan = await sent(r.plan("chat", ANYONE, chat(document + " second question")))
    route = header(plan)
    # Nowhere to go that is not overloaded: the replica that has the document cached, said as such.
    assert (route["candidate"], route["reason"], route["affinity"]) == (first, "overloaded", "hit")
    assert [c.reason for c in plan.choices] == ["overloaded"] * 3
    r.context.in_flight[first] = 1  # its load passed: back to it, as the others still are
    assert (await sent(r.plan("chat", ANYONE, chat(document + " third")))).choices[0].candidate.model == first


async def test_a_replica_behind_an_open_breaker_is_skipped_as_overloaded_ones_are() -> None:
    """The executor skips a candidate whose breaker is open. The policy did not know: it counted the
    request a hit for the replica it never reached and remembered the conversation there, so each
    later turn went wherever the hash of its own first characters sent it among the others."""
    r = router(affinity("r1", "r2", "r3"))
    turns = [words(60)]
    plan = await sent(r.plan("chat", ANYONE, chat(*turns)))
    down = served(r, plan)
    r.breakers.get(key(down), plan.route.breaker).trip()  # its breaker opens
    went = set()
    for turn in range(4):
        turns += [f"answer {turn}: " + words(20), f"question {turn}: " + words(25)]
        plan = await sent(r.plan("chat", ANYONE, chat(*turns)))
        route = header(plan)
        assert plan.choices[0] is served(r, plan) and route["candidate"] != down.candidate.model
        # The first turn after it opened is a miss (not sent to the preferred replica); later ones
        # follow the conversation to the replica that has it now.
        assert route["affinity"] == ("miss" if turn == 0 else "hit"), route
        assert plan.choices[-1].candidate.model == down.candidate.model and plan.choices[-1].reason == "open"
        went.add(route["candidate"])
    assert len(went) == 1
    assert r.context.affinity_hit_rate("chat") == 4 / 5
    await r.breakers.success(key(down))  # it recovers: the conversation stays where it is cached now
    turns += ["answer 9", "question 9"]
    assert header(await sent(r.plan("chat", ANYONE, chat(*turns))))["candidate"] in went


async def test_a_documents_questions_return_to_its_replica_once_its_breaker_closes() -> None:
    r = router(affinity("r1", "r2", "r3"))
    document = words(400)  # longer than prefix_chars: its questions all hash alike
    plan = await sent(r.plan("chat", ANYONE, chat(document + " question 0")))
    down = served(r, plan)
    r.breakers.get(key(down), plan.route.breaker).trip()
    meanwhile = set()
    for q in range(1, 4):
        route = header(await sent(r.plan("chat", ANYONE, chat(document + f" question {q}"))))
        assert (route["affinity"], route["affinity_by"]) == ("miss", "shared")
        meanwhile.add(route["candidate"])
    assert len(meanwhile) == 1 and down.candidate.model not in meanwhile
    await r.breakers.success(key(down))
    route = header(await sent(r.plan("chat", ANYONE, chat(document + " question 4"))))
    assert (route["candidate"], route["affinity"]) == (down.candidate.model, "hit")


async def test_a_half_open_replica_takes_one_trial_and_the_others_meanwhile() -> None:
    r = router(affinity("r1", "r2", "r3"))
    document = words(200)
    plan = await sent(r.plan("chat", ANYONE, chat(document + " q0")))
    down = plan.choices[0]
    breaker = r.breakers.get(key(down), plan.route.breaker)
    breaker.trip(now=time.monotonic() - 60)  # opened long ago: half-open at the next look
    trial = await sent(r.plan("chat", ANYONE, chat(document + " q1")))
    assert served(r, trial) is trial.choices[0] and trial.choices[0].candidate.model == down.candidate.model
    meanwhile = await sent(r.plan("chat", ANYONE, chat(document + " q2")))  # the trial is still under way
    assert header(meanwhile)["candidate"] != down.candidate.model and header(meanwhile)["affinity"] == "miss"
    await r.breakers.success(key(down))
    assert (
        header(await sent(r.plan("chat", ANYONE, chat(document + " q3"))))["candidate"]
        == down.candidate.model
    )


# --- routes edited while prefixes are remembered ------------------------------------------------------


async def test_adding_a_replica_moves_only_its_share_and_a_removed_one_is_never_chosen() -> None:
    prompts = [f"prompt {i}: " + words(40) for i in range(60)]  # 256 characters and more: one cut
    two = router(affinity("r1", "r2", prefix_chars=100))
    before = {p: (await sent(two.plan("chat", ANYONE, chat(p)))).choices[0].candidate.model for p in prompts}
    three = router(affinity("r1", "r2", "r3", prefix_chars=100))  # where the hash alone sends them
    after = {p: (await sent(three.plan("chat", ANYONE, chat(p)))).choices[0].candidate.model for p in prompts}
    moved = [p for p in prompts if after[p] != before[p]]
    assert 8 <= len(moved) <= 35 and all(after[p] == "r3" for p in moved)

    # The same route edited: r3 leaves while it holds remembered prefixes.
    three.set_routes([affinity("r1", "r2", prefix_chars=100)])
    for p in prompts:
        plan = await sent(three.plan("chat", ANYONE, chat(p + " a follow-up")))
        assert {c.candidate.model for c in plan.choices} == {"r1", "r2"}
        # Its prefixes are remembered on r3: hashed among the others, as if never seen; the rest
        # follow their replica.
        route = header(plan)
        assert route["candidate"] == before[p], (p, after[p], route)
        assert route["affinity_by"] == ("prefix" if after[p] == "r3" else "shared")


async def test_a_prefix_remembered_on_a_removed_replica_gives_way_to_a_shorter_one_on_a_live_one() -> None:
    """A document's first part was sent to a replica still in the route, its whole to one removed
    since: the live replica's cache still holds most of the prompt. The longest prefix remembered
    named the removed replica, so the request was hashed as if none had been seen."""
    r = router(affinity("r1", "r2"))  # r3 has left the route
    prompt = words(500) + " What does it say?"
    ends = sorted({*cuts(len(prompt)), len(prompt)})
    keys = prefix_keys("chat", prompt, ends)
    hashed = (await r.plan("chat", ANYONE, chat(prompt), record=False)).choices[0].candidate.model
    live = "r2" if hashed == "r1" else "r1"
    r.context.prefixes.remember(keys[:-3], live)
    r.context.prefixes.remember(keys[-3:], "r3")
    plan = await sent(r.plan("chat", ANYONE, chat(prompt)))
    route = header(plan)
    assert (route["candidate"], route["affinity_by"]) == (live, "shared"), route
    assert float(route["affinity_shared"]) == pytest.approx(ends[-4] / len(prompt), abs=0.01)
    # What it sent beyond the live replica's prefix is now remembered there.
    assert await r.context.prefixes.longest(keys) == (len(keys) - 1, live)


# --- what a prompt has to follow ----------------------------------------------------------------------


async def test_a_few_shot_template_does_not_pull_every_request_to_one_replica() -> None:
    """Examples given as earlier turns look like a conversation's history to the policy. Every request
    repeats them, and no request was ever sent with just them: remembered as "history", they passed for
    every request's conversation and sent all of them to the replica of the first, whatever
    `prefix_share` said."""
    r = router(affinity("r1", "r2", "r3"))
    example = ["Classify the sentiment: 'I loved it'", "positive"]
    went = []
    for i in range(12):
        plan = await sent(
            r.plan("chat", ANYONE, chat(*example, f"Review {i}: " + words(450), system="One word."))
        )
        route = header(plan)
        assert route["affinity_by"] == "prefix", route  # the template is a sixtieth of the prompt
        went.append(route["candidate"])
    assert len(set(went)) >= 2, went
    # A real conversation still follows its history, whatever its share.
    turns = [*example, "Review: " + words(450)]
    first = header(await sent(r.plan("chat", ANYONE, chat(*turns, system="One word."))))["candidate"]
    turns += ["negative", "And this one? " + words(900)]
    route = header(await sent(r.plan("chat", ANYONE, chat(*turns, system="One word."))))
    assert (route["candidate"], route["affinity_by"]) == (first, "conversation")


@pytest.mark.parametrize(
    "content", ["", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]]
)
async def test_prompts_with_no_text_spread_over_the_replicas(content: str | list[dict[str, Any]]) -> None:
    """Token ids (completions, embeddings) and images read as no text: hashing the empty prefix sent
    every one of them to the same replica, which has nothing of theirs cached."""
    r = router(affinity("r1", "r2", "r3"))
    went = [(await sent(r.plan("chat", ANYONE, chat(content)))).choices[0].candidate.model for _ in range(30)]
    assert set(went) == {"r1", "r2", "r3"}, went
    assert not r.context.prefixes.recent  # nothing to remember them by


async def test_a_long_non_ascii_document_is_followed_and_planned_quickly() -> None:
    r = router(affinity("r1", "r2", "r3"))
    document = "".join(random.Random(3).choice("日本語のテキストé€😀 ") for _ in range(120_000))
    first = (await sent(r.plan("chat", ANYONE, chat(document + " 質問1")))).choices[0].candidate.model
    started = time.perf_counter()
    for q in range(20):
        route = header(await sent(r.plan("chat", ANYONE, chat(document + f" 質問{q + 2}"))))
        assert (route["candidate"], route["affinity_by"]) == (first, "shared")
    assert (time.perf_counter() - started) / 20 < 0.05  # measured ~1 ms; the bound is for loaded CI


# --- in-flight accounting ---------------------------------------------------------------------------


class HeldPipeline:
    """A pipeline whose streams open only once `opened` is set; counts the streams it closed."""

    admission = None  # no rate limits or budgets to wait for before a hedge

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.closed = 0

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[list[Any]]:
        await self.opened.wait()
        return self._batches()

    async def _batches(self) -> AsyncIterator[list[Any]]:
        try:
            for n in range(3):
                yield [f"chunk {n}"]
        finally:
            self.closed += 1


def hedged_plan() -> tuple[Plan, Features]:
    route = Route(
        name="h",
        candidates=[Candidate(model="r1"), Candidate(model="r2")],
        hedge=Hedge(delay=5.0),
        probe_interval=None,
    )
    provider = SimpleNamespace(chat_request=lambda *a: None, chat_stream=lambda *a: None)
    targets = [
        SimpleNamespace(backend=SimpleNamespace(name=f"e{i}"), upstream_model="m", provider=provider)
        for i in (1, 2)
    ]
    choices = [Choice(t, c) for t, c in zip(targets, route.candidates, strict=True)]  # type: ignore[arg-type]
    return Plan(route, choices), chat("hi")


async def test_a_request_cancelled_while_its_hedge_waits_gives_its_slot_back() -> None:
    """Cancelled during the hedge delay (the server shutting down, say), the first attempt ran on with
    no owner: its stream opened, was never closed, and held its in-flight slot for ever."""
    pipeline = HeldPipeline()
    ctx = PolicyContext(RoutingStats())
    executor = Executor(pipeline, Breakers(), ctx)  # type: ignore[arg-type]
    plan, feats = hedged_plan()
    call = Call(RequestInfo("req"), ANYONE, "chat")
    op = Operation(True, lambda target: (None, None))  # type: ignore[arg-type,return-value]
    request = asyncio.create_task(executor.first(call, plan, op, feats))
    await asyncio.sleep(0.05)
    assert ctx.in_flight == {"r1": 1}
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    pipeline.opened.set()  # the upstream would have answered now
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert ctx.in_flight == {"r1": 0} and pipeline.closed == 0  # cancelled before anything opened


ENGINE_ROUTES = """\
routes:
  - name: smol
    policy: prefix_affinity
    probe_interval: null
    candidates: [{model: smol-a, max_in_flight: 2}, {model: smol-b, max_in_flight: 2}]
"""


@pytest.fixture
def engines(fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI) -> Iterator[RunningGateway]:
    with engine_replicas(fake_openai, fake_deepseek, ENGINE_ROUTES) as gateway:
        yield gateway


def test_a_client_that_leaves_before_its_stream_begins_frees_the_replica(
    engines: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """A client that gives up while the replica prepares its first token: the gateway gets the first
    token after the client left, and the response that would have streamed it never starts."""
    for fake in (fake_openai, fake_deepseek):
        fake.set_latency(first_token=0.3)
    body = {"model": "smol", "stream": True, "messages": [{"role": "user", "content": "a long wait"}]}
    for _ in range(2):  # max_in_flight: 2; one leaked slot each would leave the replica overloaded
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{engines.url}/v1/chat/completions", json=body, timeout=0.1)
    in_flight = runtime(engines).router.context.in_flight
    deadline = time.monotonic() + 3
    while any(in_flight.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(in_flight.values()), in_flight


FALLBACK_ROUTES = """\
routes:
  - name: smol
    policy: prefix_affinity
    probe_interval: null
    retry: {attempts: 1}
    candidates: [{model: smol-a}, {model: smol-b}]
    fallbacks: [claude-sonnet]
"""


def test_a_fallback_vendors_answer_is_not_counted_in_the_replicas_hit_rate(
    fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The hit rate a prefix_affinity route reports (routes/status `prefix_affinity_cache`, /metrics
    `weir_prefix_affinity_prompt_tokens_total`) is its replicas' prefix caches': a request that both
    replicas failed and its fallback vendor answered counted that vendor's prompt tokens too, as
    computed by the replicas, and lowered the rate by whatever share of the traffic fell back."""
    messages: Any = [{"role": "user", "content": "a question for the replicas"}]
    with engine_replicas(fake_openai, fake_deepseek, FALLBACK_ROUTES, vendor=fake_anthropic) as gateway:
        client = gateway.openai()
        served = client.chat.completions.with_raw_response.create(model="smol", messages=messages)
        assert route_header(served)["candidate"] in {"smol-a", "smol-b"}
        on_replica = served.parse().usage
        for replica in (fake_openai, fake_deepseek):
            replica.fail_next(503)
        fell_back = client.chat.completions.with_raw_response.create(model="smol", messages=messages)
        assert route_header(fell_back)["candidate"] == "claude-sonnet"
        assert fell_back.parse().usage.prompt_tokens > 0  # type: ignore[union-attr]
        settled(gateway, 4)  # the replica's answer; two failures and the vendor's answer
        answered = [e.backend for e in gateway.sink.events if e.ok]
        assert answered[0] in {"replica-a", "replica-b"} and answered[1:] == ["vendor"]
        assert on_replica is not None
        cache = runtime(gateway).router.stats.affinity_cache("smol")
        assert cache == {"prompt_tokens": on_replica.prompt_tokens, "cached_tokens": 0, "hit_rate": 0.0}
        metrics = httpx.get(f"{gateway.url}/metrics").text
        line = f'weir_prefix_affinity_prompt_tokens_total{{route="smol",source="computed"}} {float(on_replica.prompt_tokens)}'
        assert line in metrics, metrics


FAILOVER_ROUTES = """\
routes:
  - name: smol
    policy: prefix_affinity
    probe_interval: null
    retry: {attempts: 1}
    candidates: [{model: smol-a}, {model: smol-b}]
"""


def affinity_requests(gateway: RunningGateway, route: str = "smol") -> dict[str, float]:
    """`weir_prefix_affinity_requests_total` of `route`, by result."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
        for result in ("hit", "miss"):
            if line.startswith(f'weir_prefix_affinity_requests_total{{result="{result}",route="{route}"}} '):
                counts[result] = float(line.split()[-1])
    return counts


def test_a_request_its_preferred_replica_fails_is_a_miss_where_another_replica_serves_it(
    fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """A conversation's preferred replica fails a turn and the other replica answers it. That turn was
    counted a hit (the replica it was sent to first) and remembered on the replica that failed, so the
    next turn went back there, to a cache without the turn it follows, and was counted a hit again."""
    with engine_replicas(fake_openai, fake_deepseek, FAILOVER_ROUTES) as gateway:
        client = gateway.openai()
        messages: list[Any] = [{"role": "user", "content": "about this document: " + words(80)}]
        turns: list[dict[str, str]] = []
        for turn in range(3):
            if turn == 1:  # the replica that has the conversation fails this turn
                (fake_openai if turns[0]["candidate"] == "smol-a" else fake_deepseek).fail_next(503)
            raw = client.chat.completions.with_raw_response.create(model="smol", messages=messages)
            turns.append(route_header(raw))
            reply = raw.parse().choices[0].message.content
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and {turn}?"}]
        home, failed_over, after = turns
        other = "smol-b" if home["candidate"] == "smol-a" else "smol-a"
        assert (home["affinity"], home["affinity_hit_rate"]) == ("hit", "1.000")
        assert failed_over["tried"] == f"{home['candidate']}:503,{other}:ok"
        assert (failed_over["candidate"], failed_over["affinity"]) == (other, "miss")
        assert failed_over["affinity_hit_rate"] == "0.500"
        # The next turn follows the conversation to the replica whose cache has its previous turn.
        assert (after["candidate"], after["affinity"], after["affinity_by"]) == (other, "hit", "conversation")
        assert after["affinity_hit_rate"] == "0.667"
        assert affinity_requests(gateway) == {"hit": 2.0, "miss": 1.0}
        assert runtime(gateway).router.context.affinity_hit_rate("smol") == 2 / 3


def test_the_hit_rate_counts_only_requests_affinity_could_apply_to(
    fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The hit rate's requests are those with text a replica served: a prompt of token ids (spread at
    random, no prefix to follow) and a request every replica failed and the fallback vendor answered
    were each counted a hit of the replica the policy put first, and raised the rate toward 1."""
    with engine_replicas(fake_openai, fake_deepseek, FALLBACK_ROUTES, vendor=fake_anthropic) as gateway:
        client = gateway.openai()
        messages: Any = [{"role": "user", "content": "a question for the replicas"}]
        first = route_header(
            client.chat.completions.with_raw_response.create(model="smol", messages=messages)
        )
        assert (first["affinity"], first["affinity_hit_rate"]) == ("hit", "1.000")
        for replica in (fake_openai, fake_deepseek):
            replica.fail_next(503)
        fell_back = route_header(
            client.chat.completions.with_raw_response.create(model="smol", messages=messages)
        )
        assert (fell_back["candidate"], fell_back["affinity"]) == ("claude-sonnet", "miss")
        assert fell_back["affinity_hit_rate"] == "1.000"  # this request not counted
        ids = route_header(client.completions.with_raw_response.create(model="smol", prompt=[[1, 2, 3]]))
        assert ids["candidate"] in {"smol-a", "smol-b"} and ids["affinity"] == "none", ids
        assert "affinity_by" not in ids and ids["affinity_hit_rate"] == "1.000"
        assert affinity_requests(gateway) == {"hit": 1.0, "miss": 0.0}
        assert runtime(gateway).router.context.affinity == {"smol": [1, 1]}
