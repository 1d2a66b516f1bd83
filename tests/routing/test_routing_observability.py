"""What an operator sees of routing and failover: the ledger's per-attempt status, `/metrics`, the
`x-weir-route` header and the log, driven through a real gateway with the fakes failing on cue.

Each signal must say who was at fault, once: a backend too slow for the route's TTFT timeout is the
backend's 504 (not a client that left), a hedge the gateway cancelled is not a client that left
either, the gateway's own 429 (limits, before anything is sent) is no upstream attempt, and a failed
request names the candidate whose failure the client got. The shipped alert rules and dashboard read
these series as the gateway exports them: a retried failure is not an outage, and each `model` filter
selects the series of the traffic it offers.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import openai
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from gateway.logging import add_request_fields
from routing.breaker import Breakers
from routing.routes import Breaker as BreakerSettings
from tests.deploy.metrics import dashboard, queries, rules
from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway
from tests.gateway.request_logs import logged, tagged_logs
from tests.routing.routed import (
    ROUTES,
    fresh,
    ledger,
    route_header,
    routed_config_text,
    routed_gateway,
    runtime,
    settled,
)

HI = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
ONE_STREAM_KEY = "sk-weir-one-stream-0123456789"
# A tenant allowed one stream at a time: its second is refused by the gateway itself (429), before
# anything goes upstream.
ONE_STREAM = '  - {name: one-stream, api_keys: ["${ONE_STREAM_KEY}"], max_concurrent_streams: 1}'
# A completions route: gpt-instruct answers natively; its stream cut after the first token ends with
# an SSE error (completions are not resumed).
INSTRUCT = (
    "  - {name: instruct-route, retry: {attempts: 1}, probe_interval: null, "
    "candidates: [{model: gpt-instruct}, {model: gpt-4o-mini}]}\n"
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def gateway_config() -> str:
    return routed_config_text(ROUTES + INSTRUCT).replace("\nserver:\n", f"\n{ONE_STREAM}\nserver:\n", 1)


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {"ONE_STREAM_KEY": ONE_STREAM_KEY}  # tenant keys come from the environment, never the file


def samples(gateway: RunningGateway) -> Samples:
    text = httpx.get(f"{gateway.url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(scraped: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        value
        for (sample, have), value in scraped.items()
        if sample == name and labels.items() <= dict(have).items()
    )


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def stream_text(raw: object) -> str:
    return "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)  # type: ignore[attr-defined]


def test_a_ttft_timeout_is_the_backends_504_in_ledger_metrics_and_breaker(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The route's TTFT timeout cancels an attempt because its backend is too slow for the route: the
    ledger says so (504, not 499 "client closed") and so do the error metrics (`upstream_error`,
    which the shipped WeirBackendDown alert reads, not `client_disconnected`). Before, an operator saw
    a backend that never answered in time as clients hanging up. (Its breaker counts it only where no
    route there waits longer: tests/routing/test_retries_breakers_hedges.py.)"""
    before = samples(gateway)
    fake_openai.fail_next(Fault.delay(3), times=2)
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="impatient-route", messages=HI, stream=True
    )
    assert stream_text(raw) == ECHO
    assert route_header(raw)["tried"] == "gpt-4o-mini:504,gpt-4o-mini:504,claude-sonnet:ok"
    settled(gateway, 3)
    assert ledger(gateway) == [("openai", 504), ("openai", 504), ("anthropic", 200)]
    after = samples(gateway)
    errors = "weir_errors_total"
    assert delta(before, after, errors, backend="openai", type="client_disconnected") == 0
    assert delta(before, after, errors, backend="openai", type="upstream_error") == 2
    assert delta(before, after, errors, backend="anthropic") == 0
    attempts = "weir_route_attempts_total"
    assert (
        delta(before, after, attempts, route="impatient-route", candidate="gpt-4o-mini", outcome="504") == 2
    )
    breaker = runtime(gateway).router.breakers.get(Breakers.key("openai", "gpt-4o-mini"))
    assert breaker.failures == 0  # `resilient` waits for gpt-4o-mini as long as it takes

    # Every candidate too slow: the client's 504 says so, and no attempt blames a client.
    fresh(gateway)  # closed breakers: each candidate is tried twice
    before = samples(gateway)
    fake_openai.fail_next(Fault.delay(3), times=2)
    fake_anthropic.fail_next(Fault.delay(3), times=2)
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().chat.completions.create(model="impatient-route", messages=HI, stream=True)
    assert caught.value.status_code == 504 and "first token" in caught.value.message
    settled(gateway, 4)
    assert sorted(status for _, status in ledger(gateway)) == [504] * 4
    after = samples(gateway)
    assert delta(before, after, errors, type="client_disconnected") == 0


def test_a_streamed_hedge_the_gateway_cancelled_is_not_a_client_that_left(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """The hedge loser keeps its 499 in the ledger (the attempt was cancelled, not answered), but it
    was the gateway that cancelled it: the error metrics say `cancelled`, as they do for a
    non-streamed loser, not `client_disconnected` (which an operator reads as clients hanging up)."""
    before = samples(gateway)
    fake_openai.set_latency(first_token=2.0)
    raw = gateway.openai().chat.completions.with_raw_response.create(model="hedged", messages=HI, stream=True)
    assert stream_text(raw) == ECHO and route_header(raw)["hedged"] == "deepseek-chat"
    settled(gateway, 2)
    assert sorted(ledger(gateway)) == [("deepseek", 200), ("openai", 499)]
    after = samples(gateway)
    errors = "weir_errors_total"
    assert delta(before, after, errors, backend="openai", type="client_disconnected") == 0
    assert delta(before, after, errors, backend="openai", type="cancelled") == 1
    attempts = "weir_route_attempts_total"
    assert delta(before, after, attempts, route="hedged", candidate="gpt-4o-mini", outcome="cancelled") == 1
    assert delta(before, after, attempts, route="hedged", candidate="deepseek-chat", outcome="ok") == 1


def test_hedges_are_counted_started_won_and_capped(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """Whether hedging works, and whether a tenant's cap has switched it off, is an alert: the header
    says it per request, `weir_route_hedges_total{route,result}` in sum."""
    hedges = "weir_route_hedges_total"
    before = samples(gateway)
    fake_openai.set_latency(first_token=1.0)  # the primary is slow: the hedge starts and wins
    raw = gateway.openai().chat.completions.with_raw_response.create(model="hedged", messages=HI)
    assert route_header(raw)["candidate"] == "deepseek-chat"
    fake_openai.set_latency(first_token=0.4)  # a cap of 0: no hedge is sent
    raw = gateway.openai().chat.completions.with_raw_response.create(model="hedged-capped", messages=HI)
    assert route_header(raw)["hedge"] == "capped"
    fake_openai.set_latency()
    chat_ok = gateway.openai().chat.completions.create(model="hedged", messages=HI)  # fast: no hedge
    assert chat_ok.choices[0].message.content == ECHO
    after = samples(gateway)
    assert delta(before, after, hedges, route="hedged", result="started") == 1
    assert delta(before, after, hedges, route="hedged", result="won") == 1
    assert delta(before, after, hedges, route="hedged-capped", result="capped") == 1
    assert delta(before, after, hedges, route="hedged-capped", result="started") == 0


def test_a_client_leaving_mid_stream_is_still_client_disconnected(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """What the two fixes above must not take away: a client that really hangs up is counted so."""
    before = samples(gateway)
    fake_openai.fail_next(Fault.slow_stream(0.2))
    stream = gateway.openai().chat.completions.create(model="resilient", messages=HI, stream=True)
    assert next(iter(stream)).choices
    stream.close()
    settled(gateway, 1)
    assert ledger(gateway) == [("openai", 499)]
    after = samples(gateway)
    assert delta(before, after, "weir_errors_total", backend="openai", type="client_disconnected") == 1


def test_the_gateways_own_429_is_no_upstream_attempt(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A tenant over its own limit is refused before anything goes upstream: `x-weir-route` must say
    `attempts=0`, and `weir_route_attempts_total` must not count a `429` for the candidate (an
    operator reads that as the vendor rate-limiting Weir)."""
    client = gateway.openai(ONE_STREAM_KEY)
    fake_openai.fail_next(Fault.slow_stream(0.3))
    held = client.chat.completions.create(model="resilient", messages=HI, stream=True)
    try:
        assert next(iter(held)).choices  # one stream open: the tenant's only slot
        before = samples(gateway)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="resilient", messages=HI, stream=True)
        assert caught.value.body["code"] == "concurrent_streams_exceeded"  # type: ignore[index]
        header = route_header(caught.value.response)
        assert header["route"] == "resilient" and header["attempts"] == "0", header
        assert "tried" not in header
        after = samples(gateway)
        assert delta(before, after, "weir_route_attempts_total", route="resilient") == 0
        assert len(fake_openai.requests) == 1  # only the stream that holds the slot went upstream
    finally:
        held.close()


def test_a_hedges_failure_is_logged_with_the_request_it_hedged(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """The hedge runs in a task of its own, started for the request: its lines name the request (the
    client's own `x-request-id` here) and the route the client asked for."""
    fake_openai.set_latency(first_token=0.6)  # the primary is slow: the hedge starts, and breaks
    fake_deepseek.fail_next(Fault.reset())
    with capture_logs(processors=[add_request_fields]) as logs:
        raw = gateway.openai().chat.completions.with_raw_response.create(
            model="hedged", messages=HI, extra_headers={"x-request-id": "hedge-trace-3"}
        )
    assert raw.parse().choices[0].message.content == ECHO
    assert raw.headers["x-request-id"] == "hedge-trace-3"
    [broken] = [e for e in logs if e["event"] == "upstream_request_broken"]
    assert (broken["backend"], broken["request_id"], broken["model"], broken["tenant"]) == (
        "deepseek",
        "hedge-trace-3",
        "hedged",
        "demo",
    )


def test_a_breaker_a_request_opened_is_logged_with_that_request(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """`resilient` opens gpt-4o-mini's breaker at its third failure in a row: in the second request
    here (two tries each), whose id the `breaker_opened` line carries."""
    fake_openai.fail_next(503, times=3)
    ids = []
    with capture_logs(processors=[add_request_fields]) as logs:
        for _ in range(2):
            raw = gateway.openai().chat.completions.with_raw_response.create(model="resilient", messages=HI)
            ids.append(raw.headers["x-request-id"])
    [opened] = [e for e in logs if e["event"] == "breaker_opened"]
    assert opened["breaker"] == Breakers.key("openai", "gpt-4o-mini")
    assert (opened["request_id"], opened["model"]) == (ids[1], "resilient")


LATENCY_ROUTES = """\
routes:
  - {name: patient, retry: {attempts: 1}, breaker: {failures: 3, cooldown: 30}, probe_interval: null, candidates: [{model: gpt-4o-mini}]}
  - {name: tight, ttft_timeout: 0.3, retry: {attempts: 1}, breaker: {failures: 2, cooldown: 30}, probe_interval: null, candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}]}
"""


def test_a_routes_latency_breakers_are_exported_while_the_route_is_in_force(
    fake_vendors: FakeVendors, fresh_fakes: None, fake_openai: FakeOpenAI
) -> None:
    """`tight` gives gpt-4o-mini 0.3 s to its first token where `patient` waits as long as it takes:
    its two timeouts open its own latency breaker there, which only routes/status showed. /metrics
    has it beside the shared breaker (still closed), labelled by route and backend/model, and a route
    table without `tight` leaves no series of it behind."""
    with routed_gateway(fake_vendors, LATENCY_ROUTES) as gateway:
        fake_openai.set_latency(first_token=0.6)
        messages: Any = HI
        for _ in range(2):
            raw = gateway.openai().chat.completions.with_raw_response.create(
                model="tight", messages=messages, stream=True
            )
            assert stream_text(raw) == ECHO
            assert route_header(raw)["tried"] == "gpt-4o-mini:504,claude-sonnet:ok"
        scraped = samples(gateway)
        latency = "weir_route_latency_breaker_state"
        mini = Breakers.key("openai", "gpt-4o-mini")
        assert scraped[(latency, (("breaker", mini), ("route", "tight")))] == 2  # open
        assert [labels for name, labels in scraped if name == latency] == [
            (("breaker", mini), ("route", "tight"))
        ]
        assert scraped[("weir_route_breaker_state", (("breaker", mini),))] == 0

        router = runtime(gateway).router

        async def without_tight() -> None:  # on the gateway's loop, as the route store does it
            router.set_routes(router.routes["patient"])

        session = runtime(gateway).transport._session
        assert session is not None
        asyncio.run_coroutine_threadsafe(without_tight(), session._loop).result(5)
        assert not [labels for name, labels in samples(gateway) if name == latency]


def test_breaker_transitions_are_logged_and_their_history_is_bounded() -> None:
    """An operator learns when a breaker opened and closed from the log, not only from a gauge sampled
    every scrape (a short opening falls between two). The history kept for that must not grow for
    ever on a gateway whose breakers flap for months."""
    breakers = Breakers()
    key = Breakers.key("openai", "gpt-4o-mini")
    breakers.get(key, BreakerSettings(failures=1, cooldown=60))

    async def flap(times: int) -> None:
        for _ in range(times):
            await breakers.failure(key)
            await breakers.success(key)

    with capture_logs() as logs:
        asyncio.run(flap(1))
    events = [
        (e["event"], e["log_level"], e.get("breaker")) for e in logs if e["event"].startswith("breaker_")
    ]
    assert events == [("breaker_opened", "warning", key), ("breaker_closed", "info", key)]
    with capture_logs():
        asyncio.run(flap(5000))
    assert len(breakers.transitions) <= 1000


def test_model_names_clients_invent_mint_no_series(gateway: RunningGateway) -> None:
    """Label values come from the config (models, routes, backends), never from what a client sends."""
    invented = "invented-model-7f3a9c"
    with pytest.raises(openai.NotFoundError):
        gateway.openai().chat.completions.create(model=invented, messages=HI)
    with pytest.raises(openai.NotFoundError):
        gateway.openai().chat.completions.create(model=invented, messages=HI, stream=True)
    assert invented not in httpx.get(f"{gateway.url}/metrics").text


def test_a_failed_requests_header_names_the_candidate_whose_failure_the_client_got(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Every candidate of `resilient` fails (503): the client's error is claude-sonnet's, the last
    attempt's, as is the ledger's last row. x-weir-route and the request log line name claude-sonnet
    too; they named the plan's first choice (gpt-4o-mini), so an admin reading them blamed the wrong
    model."""
    fake_openai.fail_next(503, times=2)
    fake_anthropic.fail_next(503, times=2)
    with tagged_logs() as logs:
        with pytest.raises(openai.InternalServerError) as caught:
            gateway.openai().chat.completions.create(model="resilient", messages=HI)
        line = logged(logs, "request")
    header = route_header(caught.value.response)
    assert header["tried"] == "gpt-4o-mini:503,gpt-4o-mini:503,claude-sonnet:503,claude-sonnet:503"
    assert header["candidate"] == "claude-sonnet", header
    assert line["route"] == caught.value.response.headers["x-weir-route"]
    settled(gateway, 4)
    last = max(gateway.sink.events, key=lambda e: e.attempt)
    assert last.backend == "anthropic" and "candidate=claude-sonnet;" in (last.routing or "")


def test_a_candidate_skipped_for_its_open_breaker_is_not_named_for_the_failure(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """`recovering`'s first choice, deepseek-chat, has its breaker open: skipped, nothing sent. Then
    claude-sonnet fails twice, and the header names it, not the candidate that was never asked."""
    runtime(gateway).router.breakers.get(Breakers.key("deepseek", "deepseek-chat")).trip()  # 2 s cooldown
    fake_anthropic.fail_next(503, times=2)
    with pytest.raises(openai.InternalServerError) as caught:
        gateway.openai().chat.completions.create(model="recovering", messages=HI)
    header = route_header(caught.value.response)
    assert header["tried"] == "deepseek-chat:open,claude-sonnet:503,claude-sonnet:503"
    assert header["candidate"] == "claude-sonnet", header


def test_a_completions_stream_cut_after_its_first_token_says_so_in_the_request_log_line(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A completions stream that breaks after its first token ends with an SSE error and
    `weir_route_attempts_total` counts the attempt `cut`: the request log line's `route` (the
    decision as the response ended) says so too, as a chat stream's does. It read `attempts=1` and
    no `tried`: the header as it went out with the first token."""
    fake_openai.fail_next(Fault.cut_stream(2))
    before = samples(gateway)
    received = []
    with tagged_logs() as logs:
        with pytest.raises(openai.APIError) as caught:
            for chunk in gateway.openai().completions.create(
                model="instruct-route", prompt="one two three", stream=True
            ):
                received.append(chunk)
        line = logged(logs, "request")
    assert received and caught.value.code == "upstream_stream_interrupted"
    assert "attempts=1;" in line["route"] and "tried=gpt-instruct:ok,gpt-instruct:cut" in line["route"]
    cut = delta(before, samples(gateway), "weir_route_attempts_total", route="instruct-route", outcome="cut")
    assert cut == 1


def _per_backend(side: Any, before: Samples, after: Samples) -> dict[str, float]:
    """`sum by (backend) (rate(name{label="value", ...}[5m]))` over counters that all started within
    the window: their increase, by backend."""
    assert isinstance(side, promql_parser.AggregateExpr) and side.modifier.labels == ["backend"]
    assert isinstance(side.expr, promql_parser.Call) and side.expr.func.name == "rate"
    selector = side.expr.args[0].vector_selector
    wanted = {(m.name, m.value) for m in selector.matchers.matchers}
    assert all(m.op == promql_parser.MatchOp.Equal for m in selector.matchers.matchers)
    out: dict[str, float] = {}
    for (name, labels), value in after.items():
        if name == selector.name and wanted <= set(labels):
            backend = dict(labels)["backend"]
            out[backend] = out.get(backend, 0.0) + value - before.get((name, labels), 0.0)
    return out


def test_a_retried_failure_reads_as_half_the_backends_attempts_failing_not_an_outage(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """WeirBackendDown (critical) pages when over half of a backend's upstream attempts fail. One
    request on openai failed once and succeeded on its retry there: half its attempts failed, and the
    shipped recording rule, evaluated over what the gateway exports, reads 0.5. It divided the failed
    attempts by the requests (each counted once, under its last attempt's backend) and read 1.0: a
    page for one retried blip, and with a 34% failure rate and the default two tries a backend paged."""
    before = samples(gateway)
    fake_openai.fail_next(503)
    chat = gateway.openai().chat.completions.create(model="resilient", messages=HI)
    assert chat.choices[0].message.content == ECHO
    settled(gateway, 2)
    assert ledger(gateway) == [("openai", 503), ("openai", 200)]
    after = samples(gateway)
    [rule] = [r for r in rules() if r.get("record") == "weir:backend_errors:ratio_rate5m"]
    ratio = promql_parser.parse(rule["expr"])
    assert isinstance(ratio, promql_parser.BinaryExpr) and str(ratio.op) == "/"
    failed, tried = _per_backend(ratio.lhs, before, after), _per_backend(ratio.rhs, before, after)
    assert (failed["openai"], tried["openai"]) == (1, 2)
    assert delta(before, after, "weir_upstream_attempts_total", backend="openai", model="gpt-4o-mini") == 2


def test_upstream_attempts_are_counted_by_status_class_whatever_codes_a_backend_answers(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """`weir_upstream_attempts_total` made a series of every status code each configured model's
    backend ever answered (a CDN's 520-527, a vendor's 529, a proxy's 418), for as long as the process
    ran. It counts classes now, and keeps apart the codes that mean something else than their class:
    429 (the backend's rate limit) here."""
    before = samples(gateway)
    codes = (500, 502, 503, 520, 529, 418, 429)
    for code in codes:
        fake_openai.fail_next(code)
        with pytest.raises(openai.APIStatusError):
            gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=HI)  # type: ignore[arg-type]
    gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=HI)  # type: ignore[arg-type]
    settled(gateway, len(codes) + 1)
    after = samples(gateway)
    labels = {"backend": "openai", "model": "gpt-4o-mini"}
    by_status = {
        status: delta(before, after, "weir_upstream_attempts_total", **labels, status=status)
        for status in ("2xx", "4xx", "429", "5xx")
    }
    assert by_status == {"2xx": 1, "4xx": 1, "429": 1, "5xx": 5}
    statuses = {
        dict(have)["status"]
        for (name, have) in after
        if name == "weir_upstream_attempts_total" and labels.items() <= dict(have).items()
    }
    assert statuses <= {"0", "2xx", "4xx", "429", "499", "5xx"}, statuses


def test_the_dashboards_model_filters_select_a_routed_requests_series(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """The dashboard filters `model` by two variables, each offering the values of its own source
    series: `$route` the names clients send (a route's, for this traffic `resilient`), for the
    request-level series, and `$model` the configured model each attempt went to (`gpt-4o-mini`), for
    the attempt-level ones (time to first token, errors). Each filter must select this traffic's
    series: with one `$model` offering the names sent, picking the route emptied the TTFT and error
    panels, whose series label `model` with the attempt's model."""
    before = samples(gateway)
    fake_openai.fail_next(503)  # one failed attempt (an error series), then the answer (a TTFT series)
    stream = gateway.openai().chat.completions.create(model="resilient", messages=HI, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ECHO
    settled(gateway, 2)
    after = samples(gateway)
    grew = [
        (name, dict(labels))
        for (name, labels), value in after.items()
        if value > before.get((name, labels), 0)
    ]
    board = dashboard()
    sources = {
        v["name"]: re.fullmatch(r"label_values\((\w+), model\)", v["query"]["query"])
        for v in board["templating"]["list"]
        if v["type"] == "query"
    }
    filtered: dict[str, set[str]] = {}
    for _, expr in queries(board):
        for metric, variable in re.findall(r'(weir_\w+)\{[^}]*model=~"\$(\w+)"', expr):
            filtered.setdefault(variable, set()).add(metric)
    offers: dict[str, set[str]] = {}
    for variable, metrics in sorted(filtered.items()):
        source = sources[variable]
        assert source is not None, f"${variable} filters `model` but does not offer its values"
        offers[variable] = {labels["model"] for name, labels in grew if name == source.group(1)}
        # Web searches are Claude's server tool: chat traffic to OpenAI makes none (their `model`
        # label is the name sent, as weir_tokens_total's: tests/gateway/test_server_tools.py).
        for metric in sorted(metrics - {"weir_server_tool_uses_total"}):
            selected = [
                labels for name, labels in grew if name == metric and labels["model"] in offers[variable]
            ]
            assert selected, (
                f'{metric}{{model=~"${variable}"}} selects none of this traffic ({offers[variable]})'
            )
    assert offers == {"route": {"resilient"}, "model": {"gpt-4o-mini"}}
    assert {"weir_time_to_first_token_seconds_bucket", "weir_errors_total"} <= filtered["model"]
    assert {"weir_requests_total", "weir_tokens_total"} <= filtered["route"]
