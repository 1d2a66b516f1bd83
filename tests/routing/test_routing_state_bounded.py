"""State the routing and failover path keeps per route, head and model stays bounded by what is in
force, however long a replica runs: routes are created, renamed and deleted through the admin API and
trained heads are retrained and swapped while a gateway replica runs for weeks. Each test drives that
churn (in-process, or through a real gateway with the fakes) and checks the sizes afterwards."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp
import httpx
import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import Principal
from gateway.config import parse_config
from gateway.metrics import Metrics
from gateway.router_basic import ModelTable
from gateway.usage import Usage
from routing.breaker import Breakers, State
from routing.compare import Comparer, RecentRanking
from routing.heads import TrainedHead
from routing.health import HealthProber
from routing.router import Router
from routing.routes import Breaker as BreakerSettings
from routing.routes import Candidate, Compare, Conditions, Route
from tests.fakes import FakeOpenAI, Fault
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway
from tests.routing.in_process_router import ACME, CONFIG, affinity, ask, difficulty, routed_event, router
from tests.routing.routed import FAST, routed_gateway, runtime, sent, settled

T = TypeVar("T")


# --- strong-share windows -----------------------------------------------------------------------------


async def test_strong_share_windows_of_deleted_renamed_and_reconditioned_routes_are_let_go() -> None:
    """Each strong-share window holds up to 2,000 scores. They were kept for every route name (and
    every `when:`) ever in force: a replica whose routes are edited through the admin API grew by one
    window with each, for as long as it ran."""
    r = router()
    for i in range(120):
        # A route renamed, and a route of a shared name whose conditions are edited.
        routes = [difficulty(f"d-{i}"), difficulty("shared", when=Conditions(tenants=["acme", f"t{i}"]))]
        r.set_routes(routes)
        for name in ("d-", "shared"):
            for j in range(3):
                await sent(r.plan(f"d-{i}" if name == "d-" else "shared", ACME, ask(f"q{j}")))
    assert len(r.context.calibrators) == 2
    assert {key[0] for key in r.context.calibrators} == {"d-119", "shared"}
    r.set_routes([])  # every route deleted
    assert r.context.calibrators == {}


async def test_a_retrained_head_replaces_its_routes_window_and_the_shipped_heads_stays() -> None:
    """A trained head is labelled with its digest, so its window is keyed by the version: every
    retraining (a new bundle stored under the head's name) started a window and kept the old one."""
    r = router(difficulty("smart", head="acme"))
    current: list[TrainedHead | None] = [None]
    rng = random.Random(2)
    classifier = SimpleNamespace(score=lambda prompt: rng.random())
    r.context.heads = SimpleNamespace(  # type: ignore[assignment]
        get=lambda name: current[0], status=lambda name: "loading"
    )
    await sent(r.plan("smart", ACME, ask("while the head loads: the shipped head scores")))
    for version in range(60):
        current[0] = TrainedHead("acme", f"{version:012x}" + "0" * 52, classifier)  # type: ignore[arg-type]
        for j in range(3):
            await sent(r.plan("smart", ACME, ask(f"q{j}")))
    assert set(r.context.calibrators) == {("smart", "static"), ("smart", f"acme@{59:012x}")}
    # The route names another head: the old one's window goes with the edit; the shipped head's stays.
    r.set_routes([difficulty("smart", head="other")])
    assert set(r.context.calibrators) == {("smart", "static")}


async def test_a_preview_and_routes_sharing_a_name_keep_their_windows() -> None:
    """What pruning must not take: the windows of two routes of one name told apart by `when:`, and
    a route re-applied unchanged (another route edited)."""
    acme = difficulty("d", when=Conditions(tenants=["acme"]))
    r = router(acme, difficulty("d"))
    other = Principal(tenant_id="t2", tenant_name="other", key_id="k2")
    for j in range(60):
        await sent(r.plan("d", ACME, ask(f"q{j}")))
        await sent(r.plan("d", other, ask(f"q{j}", other), record=j % 2 == 0))
    before = {key: len(c._recent) for key, c in r.context.calibrators.items()}
    assert len(before) == 2
    r.set_routes([acme, difficulty("d"), affinity("new")])
    assert {key: len(c._recent) for key, c in r.context.calibrators.items()} == before


# --- prefix affinity counts ---------------------------------------------------------------------------


async def test_prefix_affinity_counts_of_deleted_routes_are_let_go() -> None:
    """Hit counts and cached prompt tokens per prefix_affinity route (in /metrics and the routes status)
    stayed for every route name ever in force, deleted routes included."""
    r = router()
    for i in range(50):
        r.set_routes([affinity(f"p-{i}"), difficulty("d")])
        plan = await sent(r.plan(f"p-{i}", ACME, ask("a prompt " * 40)))
        r.stats.record(routed_event(f"p-{i}", plan.header()))
    assert set(r.context.affinity) == {"p-49"} and set(r.stats.affinity_tokens) == {"p-49"}
    assert r.context.affinity["p-49"] == [1, 1]  # the route in force keeps its counts
    r.set_routes([difficulty("d")])
    assert r.context.affinity == {} and r.stats.affinity_tokens == {}
    r.stats.record(routed_event("p-49", plan.header()))  # a request of p-49 still running then
    assert r.stats.affinity_tokens == {}


# --- shared breakers ----------------------------------------------------------------------------------


async def test_a_breaker_no_route_uses_any_more_goes_and_a_later_route_starts_afresh() -> None:
    """The breaker of a backend/model that no route with a breaker uses any more stayed, with the
    state and settings of the last table that used it: on /metrics and routes/status for as long as
    the process ran, and a route using the model again met the opening a route long deleted had
    made (an hour's cooldown), not a breaker of its own settings."""
    registry = CollectorRegistry()
    r = Router(ModelTable(parse_config(CONFIG, {})), (), registry=registry)
    small = Breakers.key("openai", "small")
    r.set_routes([fixed("careful", breaker=BreakerSettings(failures=1, cooldown=3600))])
    await r.breakers.failure(small)
    assert r.breakers.state(small) is State.OPEN
    r.set_routes([fixed("elsewhere", "big"), fixed("unguarded", breaker=None)])
    assert set(r.breakers.breakers) == {Breakers.key("other", "big")}
    exported_breakers = {
        sample.labels["breaker"]
        for family in registry.collect()
        if family.name == "weir_route_breaker_state"
        for sample in family.samples
    }
    assert exported_breakers == {Breakers.key("other", "big")}
    r.set_routes([fixed("later", breaker=BreakerSettings(failures=3, cooldown=5))])
    breaker = r.breakers.breakers[small]
    assert (breaker.state, breaker.failures, breaker.settings) == (
        State.CLOSED,
        0,
        BreakerSettings(failures=3, cooldown=5),
    )


async def test_late_verdicts_and_probes_of_a_deleted_route_bring_back_no_breaker() -> None:
    """A request or probe of a route with a breaker that was under way when the route was deleted
    reported afterwards, and re-created the breaker the table change had dropped, with default
    settings and what it was told (failures in a row, an opening), until the next table change.
    What they report now goes nowhere; a Breakers used on its own, without a route table (tests,
    tools), still makes one."""
    r = Router(ModelTable(parse_config(CONFIG, {})), ())
    small = Breakers.key("openai", "small")
    r.set_routes([fixed("careful", breaker=BreakerSettings(failures=1, cooldown=3600))])
    stale = {"openai": (r.models.targets["small"].backend, [small])}  # a probe round's, taken before
    r.set_routes([fixed("elsewhere", "big", breaker=BreakerSettings())])
    await r.breakers.failure(small)
    await r.breakers.success(small)
    await r.breakers.too_slow(small, 1.0, fixed("careful", breaker=BreakerSettings(), ttft_timeout=1.0))
    r.breakers.get(small).release(0.0)
    assert await r.breakers.allow(small)  # a request of the old table failing over: let through
    prober = HealthProber(SimpleNamespace(session=Unreachable()), r.breakers, interval=1)
    prober.watch(stale)
    await prober.run_once()
    assert set(r.breakers.breakers) == {Breakers.key("other", "big")}
    assert r.breakers.state(small) is State.CLOSED

    alone = Breakers()
    await alone.failure(small)
    assert alone.breakers[small].failures == 1


class Unreachable:
    """An aiohttp session whose every connection is refused."""

    def get(self, url: str, **kwargs: Any) -> Any:
        raise aiohttp.ClientConnectionError("refused")


def test_a_request_that_fails_after_its_route_was_deleted_brings_back_no_breaker(
    fake_vendors: FakeVendors, fresh_fakes: None, fake_openai: FakeOpenAI
) -> None:
    """The route's request was waiting upstream when the route was deleted, then failed. Its verdict
    re-created the backend/model's breaker, with default settings and that failure counted: /metrics
    showed it in `weir_route_breaker_state` until the next table change, and a route added meanwhile
    that uses the model would have met its state (open, after enough such requests)."""
    routes = "routes:\n  - {name: doomed, candidates: [{model: gpt-4o-mini}], retry: {attempts: 1}, "
    routes += "breaker: {failures: 1, cooldown: 60}, probe_interval: null}\n"
    key = Breakers.key("openai", "gpt-4o-mini")
    with routed_gateway(fake_vendors, routes) as gateway:
        router = runtime(gateway).router
        assert key in router.breakers.breakers
        fake_openai.fail_next(Fault.hang())
        headers = {"authorization": f"Bearer {DEMO_KEY}"}

        async def delete_then_fail() -> int:
            async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=10) as client:
                sent = asyncio.create_task(_status(client, "doomed", False))
                while not fake_openai.posts:  # waiting upstream
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(on_loop, gateway, lambda: router.set_routes([]))
                assert key not in router.breakers.breakers
                fake_openai.reset()  # the hung request is answered now: 503
                return await sent

        assert asyncio.run(delete_then_fail()) >= 500
        settled(gateway, 1)
        assert key not in router.breakers.breakers
        scraped = list(text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text))
    breakers = [s.labels for f in scraped if f.name == "weir_route_breaker_state" for s in f.samples]
    assert breakers == []


# --- recent head rankings (compare) -------------------------------------------------------------------


def test_recent_rankings_keep_the_latest_version_of_each_head() -> None:
    """Each version of a trained head got its own 1,000-row window on /metrics, kept for ever: the AUC
    of a head retrained away still fired WeirDifficultyHeadWorseThanChance (which advises retraining)
    until the replica restarted."""
    ranking = RecentRanking()
    rng = random.Random(3)
    for version in range(40):
        for _ in range(30):
            # Worse than chance: the requests that needed the strong model score low.
            needs = rng.random() < 0.5
            ranking.add("smart", f"acme@{version:012x}", rng.random() * (0.5 if needs else 1), needs)
            ranking.add("smart", "static", rng.random(), rng.random() < 0.5)  # the fallback's rows
            ranking.add("other", f"acme@{0:012x}", rng.random(), rng.random() < 0.5)  # another route's
    assert set(ranking.rows) == {
        ("smart", f"acme@{39:012x}"),
        ("smart", "static"),
        ("other", f"acme@{0:012x}"),
    }
    heads = {sample.labels["head"] for family in ranking.collect() for sample in family.samples}
    assert heads == {f"acme@{39:012x}", "static", f"acme@{0:012x}"}


def fixed(name: str, model: str = "small", **fields: Any) -> Route:
    return Route(name=name, candidates=[Candidate(model=model)], probe_interval=None, **fields)


def exported(metrics: Iterator[Any], family: str, label: str) -> dict[str, float]:
    """The sum of `family`'s samples by the value of `label`, as a scrape would see them."""
    found: dict[str, float] = {}
    for metric in metrics:
        for sample in metric.samples if metric.name == family else ():
            if sample.name in (family + "_total", family + "_count"):
                found[sample.labels[label]] = found.get(sample.labels[label], 0.0) + sample.value
    return found


def test_route_attempt_outcomes_are_bounded_whatever_statuses_backends_answer() -> None:
    """`weir_route_attempts_total`'s `outcome` was the raw status: every code a backend answered (a
    proxy's 418, Cloudflare's 520-527...) a series of its own per route and candidate. Well-known
    statuses and the outcome words stay as they are; any other status is its class."""
    registry = CollectorRegistry()
    r = Router(ModelTable(parse_config(CONFIG, {})), (), registry=registry)
    assert r.metrics is not None
    r.set_routes([fixed("r")])
    words = ["ok", "cut", "cancelled", "open", "slow"]
    known = [
        "400",
        "401",
        "403",
        "404",
        "408",
        "409",
        "413",
        "422",
        "429",
        "499",
        "500",
        "502",
        "503",
        "504",
        "529",
    ]
    others_4xx = [str(s) for s in range(402, 499) if str(s) not in known]  # 402, 405, 418, 451...
    others_5xx = [str(s) for s in (501, *range(505, 529), *range(530, 600))]  # 520-527: Cloudflare's
    for outcome in words + known + others_4xx + others_5xx:
        r.metrics.attempt("r", "small", outcome)
    exported = {
        sample.labels["outcome"]: sample.value
        for family in registry.collect()
        if family.name == "weir_route_attempts"
        for sample in family.samples
        if sample.name == "weir_route_attempts_total"
    }
    assert exported == {
        **dict.fromkeys(words + known, 1.0),
        "4xx": float(len(others_4xx)),
        "5xx": float(len(others_5xx)),
    }


def test_route_series_of_deleted_and_renamed_routes_leave_metrics() -> None:
    """`weir_route_attempts` and `weir_route_hedges` kept a series for every route name ever in
    force. A name still in force keeps its series, however its routes change (two of one name told
    apart by `when:`, one of them deleted); a deleted name used again counts afresh."""
    registry = CollectorRegistry()
    r = Router(ModelTable(parse_config(CONFIG, {})), (), registry=registry)
    assert r.metrics is not None
    shared = [fixed("s", when=Conditions(tenants=["acme"])), fixed("s", "big")]
    for i in range(40):
        routes = [fixed(f"r-{i}"), *shared[: 1 + i % 2]]
        r.set_routes(routes)
        for route in routes:  # as the executor counts each attempt and hedge
            r.metrics.attempts.labels(route.name, route.candidates[0].model, "ok").inc()
            r.metrics.hedges.labels(route.name, "started").inc()
    assert exported(registry.collect(), "weir_route_attempts", "route") == {"r-39": 1, "s": 60}
    assert exported(registry.collect(), "weir_route_hedges", "route") == {"r-39": 1, "s": 60}
    r.set_routes([fixed("r-0")])
    r.metrics.attempts.labels("r-0", "small", "ok").inc()
    assert exported(registry.collect(), "weir_route_attempts", "route") == {"r-0": 1}
    assert exported(registry.collect(), "weir_route_hedges", "route") == {}


def test_gateway_series_of_a_deleted_route_go_and_come_back_with_it() -> None:
    """`weir_requests`, `weir_request_duration_seconds`, `weir_tokens` and `weir_server_tool_uses` are
    labelled with the model name the client sent, a route's name for routed requests: a deleted route's
    series stayed. Those of plain models stay, and a name used again is exported again (its cached
    child is let go too)."""
    metrics = Metrics()
    for model in ("gone", "small"):
        metrics.request_done("chat", "openai", model, 200, 0.1)
        metrics.record_tokens("openai", model, Usage(input_tokens=3, output_tokens=2))
        metrics.record_server_tools("anthropic", model, "t", Usage(web_search_requests=2))
    metrics.forget_models({"gone"})
    for family in ("weir_requests", "weir_request_duration_seconds"):
        assert exported(metrics.registry.collect(), family, "model") == {"small": 1}
    assert exported(metrics.registry.collect(), "weir_tokens", "model") == {"small": 5}
    assert exported(metrics.registry.collect(), "weir_server_tool_uses", "model") == {"small": 2}
    metrics.request_done("chat", "openai", "gone", 200, 0.1)  # a route of that name, added again
    metrics.record_tokens("openai", "gone", Usage(output_tokens=4))
    metrics.record_server_tools("anthropic", "gone", "t", Usage(web_search_requests=1))
    assert exported(metrics.registry.collect(), "weir_requests", "model") == {"small": 1, "gone": 1}
    assert exported(metrics.registry.collect(), "weir_tokens", "model") == {"small": 5, "gone": 4}
    assert exported(metrics.registry.collect(), "weir_server_tool_uses", "model") == {"small": 2, "gone": 1}


def test_comparisons_and_rankings_of_routes_no_longer_comparing_are_let_go() -> None:
    """A deleted difficulty route's comparison outcomes and head rankings stayed on /metrics (an AUC
    below chance kept WeirDifficultyHeadWorseThanChance firing); so did the rows of a head the route
    no longer names. Kept: the rankings of routes in force, of their heads and of the shipped ones."""
    registry = CollectorRegistry()
    r = Router(ModelTable(parse_config(CONFIG, {})), (), registry=registry)
    comparer = Comparer(None, None, r.context, lambda principal: True, registry)  # type: ignore[arg-type]
    r.listeners.append(comparer.forget)
    judged = Compare(judge="big")
    r.set_routes([difficulty("smart", head="acme", compare=judged), difficulty("old", compare=judged)])
    for route, head in (("smart", "acme@1"), ("smart", "beta@1"), ("smart", "static"), ("old", "static")):
        comparer.recent.add(route, head, 0.5, True)
        comparer.outcomes.labels(route, "judged").inc()
    r.set_routes([difficulty("smart", head="acme", compare=judged), difficulty("old")])
    assert set(comparer.recent.rows) == {("smart", "acme@1"), ("smart", "static")}
    r.set_routes([difficulty("smart", head="acme", compare=judged)])
    assert exported(registry.collect(), "weir_route_comparisons", "route") == {"smart": 3}


# --- through a real gateway ---------------------------------------------------------------------------

HI = [{"role": "user", "content": "one two three four five six"}]


def on_loop(gateway: RunningGateway, fn: Callable[[], T]) -> T:
    """Run `fn` on the gateway's event loop (as the route store's task calls set_routes) and wait."""
    router = runtime(gateway).router
    assert router.prober is not None and router.prober._task is not None
    loop = router.prober._task.get_loop()
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # handed to the waiting thread
            done.set_exception(exc)

    loop.call_soon_threadsafe(call)
    return done.result(timeout=10)


# How many route tables the churn test goes through. Every change of table drops the names of the one
# before, so a name kept past its table shows from the second on; ten changes with traffic in flight
# across each are as telling as thirty were, in a third of the time.
TABLES = 10
LAST = TABLES - 1


def churned_routes(i: int) -> list[Route]:
    """A table as an admin might leave it after edit number `i`: names rotate, one route's conditions
    change, and one route is in every table."""
    text = f"""
- {{name: kept, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
- {{name: d-{i}, policy: difficulty, strong_share: 0.3, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
- {{name: p-{i}, policy: prefix_affinity, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
- {{name: h-{i}, hedge: {{delay: 0.05}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
- {{name: f-{i}, when: {{tenants: [demo, t{i}]}}, candidates: [{{model: gpt-4o-mini}}], fallbacks: [claude-sonnet], {FAST}}}
"""
    return msgspec.convert(yaml.safe_load(text), list[Route])


@pytest.fixture(scope="module")
def _churned(fake_vendors: FakeVendors) -> Iterator[RunningGateway]:
    first = (
        "routes:\n  - {name: kept, candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}], "
        + FAST
        + "}\n"
    )
    with routed_gateway(fake_vendors, first) as gateway:
        yield gateway


async def _request(
    client: httpx.AsyncClient, model: str, stream: bool, leave: bool, timeout: float = 10
) -> None:
    body = {"model": model, "messages": HI, "stream": stream}
    try:
        if not stream:
            await client.post("/v1/chat/completions", json=body, timeout=timeout)
            return
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as response:
            async for _ in response.aiter_bytes():
                if leave:
                    return  # the client leaves mid-stream
    except httpx.TimeoutException:
        pass  # a client that gave up waiting for the first token


async def _hedged_once(url: str, headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as client:
        response = await client.post("/v1/chat/completions", json={"model": f"h-{LAST}", "messages": HI})
        assert "hedged=" in response.headers["x-weir-route"], response.headers["x-weir-route"]


def test_requests_in_flight_when_their_route_is_deleted_bring_back_no_series(
    fake_vendors: FakeVendors, fresh_fakes: None, fake_openai: FakeOpenAI
) -> None:
    """Requests still waiting for their answers when their route was deleted counted their attempts,
    requests and tokens after the table change had dropped the route's series: those came back,
    until the name was deleted again. They count nothing under the name now; a plain model's
    request, in flight at the same time, still counts."""
    routes = "routes:\n  - {name: doomed, candidates: [{model: gpt-4o-mini}], " + FAST + "}\n"
    with routed_gateway(fake_vendors, routes) as gateway:
        router = runtime(gateway).router
        fake_openai.set_latency(first_token=0.5)
        headers = {"authorization": f"Bearer {DEMO_KEY}"}

        async def delete_while_answering() -> list[int]:
            async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=10) as client:
                sent = [
                    asyncio.create_task(_status(client, model, stream))
                    for model, stream in (("doomed", False), ("doomed", True), ("gpt-4o-mini", False))
                ]
                while len(fake_openai.posts) < len(sent):  # all three are waiting upstream
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(on_loop, gateway, lambda: router.set_routes([]))
                return await asyncio.gather(*sent)

        assert asyncio.run(delete_while_answering()) == [200, 200, 200]
        settled(gateway, 3)
        scraped = list(text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text))
    named = {
        family: set(exported(iter(scraped), family, label))
        for family, label in (
            ("weir_route_attempts", "route"),
            ("weir_requests", "model"),
            ("weir_request_duration_seconds", "model"),
            ("weir_tokens", "model"),
        )
    }
    assert named == {family: {"gpt-4o-mini"} for family in named}


async def _status(client: httpx.AsyncClient, model: str, stream: bool) -> int:
    body = {"model": model, "messages": HI, "stream": stream}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        await response.aread()
        return response.status_code


def test_traffic_over_churned_routes_leaves_state_bounded_by_what_is_in_force(
    _churned: RunningGateway, fresh_fakes: None, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """70 requests on each of TABLES route tables in turn (renamed routes, edited conditions): plain
    answers, retries and fallbacks after 5xx, hedges past a slow first candidate, mid-stream failover,
    clients that leave mid-stream or before the first token. Afterwards what routing keeps is sized by the routes and models in
    force, not by the traffic or the tables it went through, and nothing counts as in flight."""
    gateway = _churned
    router = runtime(gateway).router
    rng = random.Random(7)
    on_loop(gateway, lambda: setattr(router.context, "scorer", lambda prompt: rng.random()))
    headers = {"authorization": f"Bearer {DEMO_KEY}"}

    async def drive(i: int) -> None:
        async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=10) as client:
            jobs = []
            for j in range(70):
                model = ("kept", f"d-{i}", f"p-{i}", f"h-{i}", f"f-{i}")[j % 5]
                # Some clients leave mid-stream, some give up before the first token.
                timeout = 0.05 if j % 11 == 0 else 10
                jobs.append(_request(client, model, stream=j % 3 != 0, leave=j % 7 == 0, timeout=timeout))
            await asyncio.gather(*jobs)

    comparer = runtime(gateway).comparer
    for i in range(TABLES):
        on_loop(gateway, lambda i=i: router.set_routes(churned_routes(i)))  # type: ignore[misc]
        if i == 0:  # as a comparison of d-0 would leave them (none runs: no admin DB here)
            on_loop(gateway, lambda: comparer.recent.add("d-0", "static", 0.5, True))
            on_loop(gateway, lambda: comparer.outcomes.labels("d-0", "judged").inc())
        fake_openai.fail_next(Fault.status(503), times=4)  # retries, fallbacks
        fake_openai.fail_next(Fault.delay(0.15), times=3)  # hedges
        fake_openai.fail_next(Fault.cut_stream(after=2), times=2)  # mid-stream failover
        fake_deepseek.fail_next(Fault.status(500), times=2)
        asyncio.run(drive(i))

    def sizes() -> dict[str, Any]:
        context = router.context
        return {
            "calibrators": {key[0] for key in context.calibrators},
            "affinity": set(context.affinity),
            "affinity_tokens": set(context.stats.affinity_tokens),
            "in_flight": {model: n for model, n in context.in_flight.items() if n},
        }

    found = on_loop(gateway, sizes)
    for _ in range(200):  # cut and abandoned attempts unwind after their clients are gone
        if not found["in_flight"]:
            break
        asyncio.run(asyncio.sleep(0.05))
        found = on_loop(gateway, sizes)
    # A stream its client left may report its usage after the next table: it counts nothing then.
    assert found["affinity_tokens"] <= {f"p-{LAST}"}
    del found["affinity_tokens"]
    assert found == {"calibrators": {f"d-{LAST}"}, "affinity": {f"p-{LAST}"}, "in_flight": {}}

    async def give_up_on_the_retry() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, headers=headers) as client:
            await _request(client, "kept", stream=True, leave=False, timeout=0.5)

    # One client that gives up while its retry waits, so an abandoned later attempt is in the traffic
    # however the timing above fell (on a busy machine none of its clients may leave on a retry).
    # Its breaker closed and its faults its own, as for the hedge below.
    fake_openai.reset()
    on_loop(gateway, router.breakers.breakers.clear)
    fake_openai.fail_next(Fault.status(503))
    fake_openai.fail_next(Fault.delay(3.0))
    asyncio.run(give_up_on_the_retry())
    # The traffic was what it says: first attempts and later ones answered, failed and abandoned.
    for _ in range(100):  # the gateway settles an attempt after it sees its client gone
        outcomes = {(event.status, event.attempt > 1) for event in gateway.sink.events}
        if (499, True) in outcomes:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert {(200, False), (200, True), (503, False), (499, True)} <= outcomes, outcomes
    assert len(router.breakers.breakers) <= len(router.models.targets)
    assert len(router.stats.models) <= len(router.models.targets)
    # One hedge on the last table for certain (which requests met the faults above is up to the
    # scheduler): the series of a name in force are there, beside those of names gone. The traffic's
    # 503s leave the backend's breaker open for its cooldown (late answers close none), which kept
    # some of the faults queued above from it: this request meets a closed breaker and its own fault.
    fake_openai.reset()
    on_loop(gateway, router.breakers.breakers.clear)
    fake_openai.fail_next(Fault.delay(0.3))
    asyncio.run(_hedged_once(gateway.url, headers))
    # /metrics names the routes in force and the plain models, not every route ever in force.
    # ("none": a request no backend answered, e.g. every candidate's breaker open: one series.)
    last = {f"{kind}-{LAST}" for kind in "dphf"}
    named = {"kept", *last, "none", *router.models.targets}
    scraped = list(text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text))
    for family, label in (
        ("weir_route_attempts", "route"),
        ("weir_route_hedges", "route"),
        ("weir_route_comparisons", "route"),
        ("weir_route_head_ranking_comparisons", "route"),
        ("weir_requests", "model"),
        ("weir_tokens", "model"),
    ):
        found = set(exported(iter(scraped), family, label))
        # The last attempts of the table before, landing after it, add none back.
        assert found <= named, (family, found - named)
    assert {"kept", f"h-{LAST}"} <= set(exported(iter(scraped), "weir_route_attempts", "route"))
    assert f"h-{LAST}" in exported(iter(scraped), "weir_route_hedges", "route")
