"""Accounting and visibility of routed requests, as a tenant of a production gateway sees them: the
control plane (admin DB, and Redis where a test needs it) in front of the fake vendors, routes with
hedges and fallbacks, tenants with rate limits and budgets, the official OpenAI SDK as the client.

- A hedge must not answer a request the tenant's own rate limit or budget refused (the primary's
  admission may still be waiting for Redis when the hedge starts).
- A failed first attempt must not give back the request's budget reservation while its fallback is
  still on its way: concurrent requests would be admitted into money already being spent.
- Each attempt's usage event names its own candidate (hedged attempts run at once), and the admin
  API's request log shows a hedged request by the attempt that answered, not by the hedge that lost.
- An attempt has one price, the ledger's: resolved per token class from the catalog, and the same
  for the reports, `cheapest`'s estimate, the usage sinks and the hedge cap.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.accounting.money import pico_to_usd
from gateway.app import create_app
from gateway.config import parse_config
from gateway.usage_sink import ListSink
from routing.plan import Choice, Features
from routing.policies import expected_cost
from routing.routes import Candidate
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.db import REDIS_URL, migrated_sqlite
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.vendor_gateway import fakes_env, full_config_text
from tests.routing.routed import counted_micro_usd, route_header

ADMIN = "admin-token-for-tests"
HI = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
ROUTES = """\
database_url: "${DB_URL}"
routes:
  - {name: hedge-now, hedge: {delay: 0}, retry: {attempts: 1}, probe_interval: null, candidates: [{model: gpt-4o-mini}, {model: deepseek-chat}]}
  - {name: hedge-race, hedge: {delay: 0.15}, retry: {attempts: 1}, probe_interval: null, candidates: [{model: gpt-4o-mini}, {model: deepseek-chat}]}
  - {name: hedge-capped, hedge: {delay: 0.15, max_spend_usd_per_hour: 0.012}, retry: {attempts: 1}, probe_interval: null, candidates: [{model: gpt-4o-mini}, {model: deepseek-chat}]}
  - {name: to-anthropic, retry: {attempts: 1}, probe_interval: null, candidates: [{model: gpt-4o-mini}], fallbacks: [claude-sonnet]}
"""


class Weir:
    def __init__(self, url: str, sink: ListSink, app: Any) -> None:
        self.url, self.sink, self.app = url, sink, app
        self.admin = httpx.Client(
            base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"}, timeout=20
        )

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=20)

    def tenant_key(self, name: str, **limits: Any) -> str:
        tenant = self.admin.post("/tenants", json={"name": name, **limits})
        assert tenant.status_code == 201, tenant.text
        key = self.admin.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "app"})
        assert key.status_code == 201, key.text
        return str(key.json()["key"])

    def attempts(self, request_id: str, count: int) -> dict[int, dict[str, Any]]:
        """The request's attempts as the admin request log shows them, once the ledger has `count`."""
        deadline = time.monotonic() + 15
        while True:
            listed = self.admin.get("/requests", params={"limit": 20}).json()["data"]
            entry = next((r for r in listed if r["request_id"] == request_id), None)
            if entry is not None and len(entry["attempts"]) >= count:
                return {a["attempt"]: a for a in entry["attempts"]}
            assert time.monotonic() < deadline, listed
            time.sleep(0.1)

    def tenant_id(self, name: str) -> str:
        return str(next(t["id"] for t in self.admin.get("/tenants").json()["data"] if t["name"] == name))

    def settled(self, count: int) -> None:
        deadline = time.monotonic() + 5
        while len(self.sink.events) < count and time.monotonic() < deadline:
            time.sleep(0.01)


@contextmanager
def weir_gateway(
    fakes: tuple[FakeOpenAI, FakeAnthropic, FakeGemini, FakeOpenAI],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_prefix: str | None = None,
) -> Iterator[Weir]:
    """The gateway with an SQLite admin DB, and Redis as its shared state when `redis_prefix` is given."""
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    if redis_prefix is not None:
        monkeypatch.setenv("WEIR_REDIS_URL", REDIS_URL)
        monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    else:
        monkeypatch.delenv("WEIR_REDIS_URL", raising=False)
    env = {**fakes_env(*fakes), "DB_URL": migrated_sqlite(f"sqlite+aiosqlite:///{tmp_path}/weir.db")}
    sink = ListSink()
    app = create_app(parse_config(full_config_text() + ROUTES, env), usage_sink=sink)
    with serve(app, free_port()) as url:
        yield Weir(url, sink, app)


@pytest.fixture
def fakes(
    fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini, fake_deepseek: FakeOpenAI
) -> tuple[FakeOpenAI, FakeAnthropic, FakeGemini, FakeOpenAI]:
    return fake_openai, fake_anthropic, fake_gemini, fake_deepseek


@pytest.fixture
def weir(
    fakes: tuple[FakeOpenAI, FakeAnthropic, FakeGemini, FakeOpenAI],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Weir]:
    with weir_gateway(fakes, tmp_path, monkeypatch) as gateway:
        yield gateway


@pytest.fixture
def weir_redis(
    fakes: tuple[FakeOpenAI, FakeAnthropic, FakeGemini, FakeOpenAI],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_prefix: str,
) -> Iterator[Weir]:
    with weir_gateway(fakes, tmp_path, monkeypatch, redis_prefix) as gateway:
        yield gateway


# --- limits and budgets with hedges and fallbacks ---------------------------------------------------


@pytest.mark.redis
def test_a_hedge_never_answers_a_request_the_tenants_own_limits_refused(
    weir_redis: Weir, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """With Redis, the primary's admission is a round trip; a hedge with no delay starts meanwhile.
    When the admission says no (RPM spent, budget spent), the client must get that 429, not the
    hedge's answer: no limit or budget may be passed by asking a hedged route."""
    client = weir_redis.client(weir_redis.tenant_key("one-a-minute", rpm=1))
    first = client.chat.completions.with_raw_response.create(model="hedge-now", messages=HI)
    assert first.parse().choices[0].message.content == ECHO
    for _ in range(3):
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="hedge-now", messages=HI)
        assert caught.value.body["code"] == "rate_limit_exceeded"
        assert caught.value.response.headers["retry-after"]
        assert route_header(caught.value.response)["route"] == "hedge-now"  # our own 429 says it too

    # A budget of 100 micro-dollars; each request reserves ~600 (1,000 output tokens of gpt-4o-mini).
    client = weir_redis.client(weir_redis.tenant_key("broke", budget_usd_monthly="0.0001"))
    for _ in range(3):
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="hedge-now", messages=HI, max_tokens=1000)
        assert caught.value.body["code"] == "insufficient_quota"
    # Nothing was answered past the limits: the only answers in the ledger are the first request's.
    time.sleep(0.3)  # a cancelled hedge records its event as it unwinds
    answered = {e.request_id for e in weir_redis.sink.events if e.ok}
    assert answered == {first.headers["x-request-id"]}


def test_a_failed_attempt_keeps_the_budget_reserved_for_its_fallback(
    weir: Weir, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Budget 1,000 micro-dollars; a request for 1,000 output tokens of gpt-4o-mini reserves ~606.
    The first request's gpt-4o-mini attempt fails at once and its fallback (Claude) takes 1.5 s:
    while it runs, the request is still in flight, so a second one must not fit (606 + 606 > 1,000)."""
    client = weir.client(weir.tenant_key("frugal", budget_usd_monthly="0.001"))
    fake_openai.fail_next(500)
    fake_anthropic.set_latency(first_token=1.5)
    outcome: list[object] = []

    def first() -> None:
        reply = client.chat.completions.with_raw_response.create(
            model="to-anthropic", messages=HI, max_tokens=1000
        )
        outcome.append(route_header(reply))

    thread = threading.Thread(target=first)
    thread.start()
    deadline = time.monotonic() + 5
    while not fake_anthropic.posts:  # the fallback is on its way
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="to-anthropic", messages=HI, max_tokens=1000)
    assert caught.value.body["code"] == "insufficient_quota"
    thread.join(10)
    assert outcome and outcome[0]["candidate"] == "claude-sonnet"  # type: ignore[index]
    assert len(fake_openai.requests) == 1  # the second request never went upstream

    # Once the first request ended, its reservation is back: the next one fits again.
    reply = client.chat.completions.create(model="to-anthropic", messages=HI, max_tokens=1000)
    assert reply.choices[0].message.content == ECHO


def test_when_every_attempt_fails_the_reservation_is_given_back(
    weir: Weir, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """A request whose every attempt failed spent nothing: its reservation must not linger (for the
    10 minutes a lost one takes to expire) and refuse the tenant's next requests."""
    client = weir.client(weir.tenant_key("unlucky", budget_usd_monthly="0.001"))
    fake_openai.fail_next(500)
    fake_anthropic.fail_next(500)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="to-anthropic", messages=HI, max_tokens=1000)
    assert caught.value.status_code == 502
    assert route_header(caught.value.response)["tried"] == "gpt-4o-mini:502,claude-sonnet:502"
    reply = client.chat.completions.create(model="to-anthropic", messages=HI, max_tokens=1000)
    assert reply.choices[0].message.content == ECHO


def test_the_hedge_cap_counts_what_a_hedge_is_billed_at_the_catalogs_prices(
    weir: Weir, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """deepseek-chat has no price in the config; the admin prices it at $100 per 1M tokens, which is
    what its attempts are billed (the ledger). The route caps hedges at $0.012 an hour. The first
    hedge (estimated $0.0094: 44 prompt tokens, a chat template's allowance included, and 50 output)
    fits, wins and is billed $0.0045 (45 tokens): the cap must count that, so the second request's
    hedge ($0.0045 + $0.0094) is refused.
    Counted at the config's price (nothing), the cap would let every hedge through."""
    prices = [
        {
            "backend": "deepseek",
            "model": "deepseek-chat",
            "token_class": token_class,
            "usd_per_1m_tokens": "100",
        }
        for token_class in ("input", "output")
    ]
    assert weir.admin.put("/prices", json={"prices": prices}).status_code == 200
    client = weir.client(weir.tenant_key("hedger"))
    fake_openai.set_latency(first_token=1.0)  # the primary is slow: the hedge answers first
    fake_deepseek.set_next_usage(input_tokens=5, output_tokens=40)
    first = client.chat.completions.with_raw_response.create(model="hedge-capped", messages=HI, max_tokens=50)
    assert (
        route_header(first)["hedged"] == "deepseek-chat"
        and route_header(first)["candidate"] == "deepseek-chat"
    )
    assert Decimal(weir.attempts(first.headers["x-request-id"], 2)[2]["cost_usd"]) == Decimal("0.0045")

    second = client.chat.completions.with_raw_response.create(
        model="hedge-capped", messages=HI, max_tokens=50
    )
    header = route_header(second)
    assert header.get("hedge") == "capped" and header["candidate"] == "gpt-4o-mini", header
    assert len(fake_deepseek.requests) == 1


def test_a_400_the_request_caused_ends_a_hedged_request_as_it_ends_a_plain_one(
    weir: Weir, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """A 400 caused by the request never fails over; with a hedge already on its way, the hedge must
    not answer in its place either (the tenant would be billed for the hedge and see an answer from
    another model to a request the primary refused)."""
    client = weir.client(weir.tenant_key("asks-badly"))
    fake_openai.fail_next(400)
    fake_deepseek.set_latency(first_token=0.5)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="hedge-now", messages=HI)
    assert route_header(caught.value.response)["tried"].startswith("gpt-4o-mini:400")


def test_the_hedges_own_400_does_not_end_a_request_the_primary_answers(
    weir: Weir, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """Unhedged, the partner is asked only after the primary failed over: its 400 (a parameter that
    model refuses, say) must not take the place of the primary's answer still on its way."""
    client = weir.client(weir.tenant_key("asks-well"))
    fake_openai.set_latency(first_token=0.5)
    fake_deepseek.fail_next(400)
    raw = client.chat.completions.with_raw_response.create(model="hedge-now", messages=HI)
    assert raw.parse().choices[0].message.content == ECHO
    assert route_header(raw)["candidate"] == "gpt-4o-mini"
    assert len(fake_deepseek.requests) == 1  # the hedge was sent, and refused


# --- what the ledger and the admin API say ------------------------------------------------------------


def test_a_hedged_requests_attempts_each_name_their_own_candidate(
    weir: Weir, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """The primary (gpt-4o-mini, 0.5 s) answers after the hedge (deepseek-chat, 3 s) started at
    0.15 s, and wins. Its usage event must say gpt-4o-mini answered (feedback training reads the
    candidate from the answering attempt's `routing`), the loser's that it was the hedge; the admin
    request log shows the request as answered (200 by gpt-4o-mini), not as the loser's 499."""
    client = weir.client(weir.tenant_key("watched"))
    fake_openai.set_latency(first_token=0.5)
    fake_deepseek.set_latency(first_token=3.0)
    raw = client.chat.completions.with_raw_response.create(model="hedge-race", messages=HI)
    assert raw.parse().choices[0].message.content == ECHO
    header = route_header(raw)
    assert header["candidate"] == "gpt-4o-mini" and header["hedged"] == "deepseek-chat"
    request_id = raw.headers["x-request-id"]

    weir.settled(2)
    events = {e.backend: e for e in weir.sink.events if e.request_id == request_id}
    assert events["openai"].status == 200 and events["deepseek"].status == 499
    assert "candidate=gpt-4o-mini" in (events["openai"].routing or "")
    assert "candidate=deepseek-chat" in (events["deepseek"].routing or "")

    deadline = time.monotonic() + 15
    while True:
        listed = weir.admin.get("/requests", params={"limit": 10}).json()["data"]
        entry = next((r for r in listed if r["request_id"] == request_id), None)
        if entry is not None and len(entry["attempts"]) == 2:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.1)
    assert entry["status"] == 200 and entry["backend"] == "openai" and entry["model"] == "gpt-4o-mini"
    assert "candidate=gpt-4o-mini" in entry["routing"]
    by_attempt = {a["attempt"]: a for a in entry["attempts"]}
    assert "candidate=gpt-4o-mini" in by_attempt[1]["routing"]
    assert "candidate=deepseek-chat" in by_attempt[2]["routing"]
    errors = weir.admin.get("/requests", params={"status": "error"}).json()["data"]
    assert request_id not in {r["request_id"] for r in errors}  # it was answered


def test_a_streamed_hedge_winner_records_the_final_decision(
    weir: Weir, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """A stream records its usage event when it ends, after the race was decided: the winner's
    event says it won as a hedge, as the header does."""
    client = weir.client(weir.tenant_key("streamed-hedge"))
    fake_openai.set_latency(first_token=3.0)
    raw = client.chat.completions.with_raw_response.create(model="hedge-race", messages=HI, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    header = route_header(raw)
    assert header["candidate"] == "deepseek-chat" and header["hedged"] == "deepseek-chat"
    weir.settled(2)
    events = {e.backend: e for e in weir.sink.events if e.request_id == raw.headers["x-request-id"]}
    assert events["deepseek"].status == 200 and "hedged=deepseek-chat" in (events["deepseek"].routing or "")
    assert "candidate=gpt-4o-mini" in (events["openai"].routing or "")


def test_a_whole_answer_that_won_a_hedge_race_records_the_final_decision(
    weir: Weir, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """A whole answer records its usage event as it takes the race, before the race is looked at:
    its row said it as of its start, without `hedged=`, so the admin request log's decision for a
    request a hedge answered did not say so (a streamed winner's did)."""
    client = weir.client(weir.tenant_key("whole-hedge"))
    fake_openai.set_latency(first_token=3.0)
    raw = client.chat.completions.with_raw_response.create(model="hedge-race", messages=HI)
    assert raw.parse().choices[0].message.content == ECHO
    header = route_header(raw)
    assert (header["candidate"], header["hedged"], header["attempts"]) == ("deepseek-chat",) * 2 + ("2",)
    attempts = weir.attempts(raw.headers["x-request-id"], 2)
    assert (attempts[1]["backend"], attempts[1]["status"]) == ("openai", 499)
    assert (attempts[2]["backend"], attempts[2]["status"]) == ("deepseek", 200)
    won = dict(part.split("=", 1) for part in attempts[2]["routing"].split("; "))
    assert (won["candidate"], won["hedged"], won["attempts"]) == ("deepseek-chat", "deepseek-chat", "2")
    assert "hedged" not in dict(part.split("=", 1) for part in attempts[1]["routing"].split("; "))


def test_the_request_log_shows_each_attempts_every_token_class_and_whether_it_was_estimated(
    weir: Weir, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """A stream cut on gpt-4o-mini (billed an estimate) resumed on Claude, which writes its prompt
    cache. The request log showed each attempt's input, cache reads and output only: not the cache
    writes its cost includes (at 1.25x and 2x the input price), nor the reasoning, nor which attempt
    was billed an estimate rather than its vendor's count, which the ledger holds."""
    client = weir.client(weir.tenant_key("cache-writer"))
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    reported = (10, 1000, 300, 50, 4, 0)  # input, cache reads, writes (5m, 1h), output, reasoning
    classes = ("input_tokens", "cached_input_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens")
    every = (*classes, "output_tokens", "reasoning_tokens")
    fake_anthropic.set_next_usage(**dict(zip(every, reported, strict=True)))
    raw = client.chat.completions.with_raw_response.create(model="to-anthropic", messages=HI, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    attempts = weir.attempts(raw.headers["x-request-id"], 2)
    cut, continued = attempts[1], attempts[2]
    assert (cut["backend"], cut["estimated"]) == ("openai", True)
    assert (continued["backend"], continued["estimated"]) == ("anthropic", False)
    assert tuple(continued[c] for c in every) == reported
    ledger = {e.attempt: e for e in weir.sink.events if e.request_id == raw.headers["x-request-id"]}
    for number, shown in attempts.items():
        assert [shown[c] for c in classes] == [getattr(ledger[number].usage, c) for c in classes]
        assert Decimal(shown["cost_usd"]) == pico_to_usd(ledger[number].cost_pico_usd)


def test_requests_that_share_a_clients_x_request_id_stay_apart_in_the_log_and_the_uptime_report(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    """An SDK built with a trace id in its default headers sends one `x-request-id` on every request.
    The gateway keeps and echoes it, but the ledger grouped attempts by it: the request log showed
    the two requests below as one (two "first" attempts), and the uptime report counted one request
    for the tenant, answered, where one of the two had failed. Each is its own entry now, with the
    gateway's own `exchange_id`, still found by the client's id."""
    key = weir.tenant_key("one-trace-id")
    client = openai.OpenAI(
        base_url=f"{weir.url}/v1",
        api_key=key,
        max_retries=0,
        timeout=20,
        default_headers={"x-request-id": "trace-4711"},
    )
    answered = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=HI)
    assert answered.headers["x-request-id"] == "trace-4711"
    fake_openai.fail_next(Fault.status(503))
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model="gpt-4o-mini", messages=HI)
    assert failed.value.response.headers["x-request-id"] == "trace-4711"

    deadline = time.monotonic() + 15
    while (
        len(
            entries := [
                r for r in weir.admin.get("/requests").json()["data"] if r["request_id"] == "trace-4711"
            ]
        )
        < 2
    ):
        assert time.monotonic() < deadline, entries
        time.sleep(0.1)
    assert len(entries) == 2 and len({e["exchange_id"] for e in entries}) == 2
    assert sorted(e["status"] for e in entries) == [200, 503]
    assert [len(e["attempts"]) for e in entries] == [1, 1]
    tenant = weir.tenant_id("one-trace-id")
    uptime = weir.admin.get("/reports/uptime").json()["tenants"]
    assert [(t["requests"], t["succeeded"]) for t in uptime if t["tenant"] == tenant] == [(2, 1)]


# --- one price for the ledger, the reports, the routing estimates and the spend caps ---------------


def test_a_backend_price_for_some_token_classes_leaves_the_others_at_the_any_backend_prices(
    weir: Weir, fake_deepseek: FakeOpenAI
) -> None:
    """The admin prices deepseek-chat's cache reads on any backend ($0.50 per 1M tokens), and its
    input and output on the deepseek backend ($1, $3). Its attempts bill cache reads at the `*` price
    and input and output at the backend's: the ledger, the usage report and `cheapest`'s expected
    cost agree. Priced from the backend's rows alone, cache reads billed the input price ($1)."""
    prices = [
        {"backend": backend, "model": "deepseek-chat", "token_class": token_class, "usd_per_1m_tokens": usd}
        for backend, token_class, usd in (
            ("*", "cached_input", "0.5"),
            ("deepseek", "input", "1"),
            ("deepseek", "output", "3"),
        )
    ]
    assert weir.admin.put("/prices", json={"prices": prices}).status_code == 200
    client = weir.client(weir.tenant_key("special-output"))
    fake_deepseek.set_next_usage(input_tokens=1000, cached_input_tokens=4000, output_tokens=100)
    raw = client.chat.completions.with_raw_response.create(model="deepseek-chat", messages=HI)
    billed = Decimal("0.0033")  # 1000 x $1 + 4000 x $0.50 + 100 x $3, per 1M tokens
    ledger = weir.attempts(raw.headers["x-request-id"], 1)[1]
    assert Decimal(ledger["cost_usd"]) == billed

    day = dt.date.fromisoformat(ledger["ts"][:10])
    report = weir.admin.get(
        "/reports/usage",
        params={
            "start": day.isoformat(),
            "end": (day + dt.timedelta(days=1)).isoformat(),
            "group_by": "tenant",
        },
    ).json()
    [row] = [r for r in report["rows"] if r["tenant_name"] == "special-output"]
    assert Decimal(row["cost_usd"]) == billed

    # `cheapest` expects what a request like it is billed (its cache share as observed: 4000 of 5000).
    gateway = weir.app.state.gateway
    feats = Features(
        prompt="",
        history_chars=None,
        last_user="",
        prompt_tokens=5000,
        requested_output_tokens=None,
        tools=False,
        images=False,
        metadata={},
        tags=frozenset(),
        tenant=None,
        key_id=None,
    )
    choice = Choice(gateway.models.targets["deepseek-chat"], Candidate(model="deepseek-chat"))
    assert expected_cost(choice, feats, 100, gateway.router.context) == pytest.approx(float(billed), rel=1e-9)


def test_the_usage_sinks_are_handed_the_price_the_ledger_bills(weir: Weir) -> None:
    """gpt-4o-mini's config price ($0.15 input, $0.60 output per 1M tokens) seeded the catalog; the
    admin raises it to $2 and $8. The usage event every sink in the process is handed (the
    embedder's `usage_sink` here; the metrics and the routing stats too) carries the cost the ledger
    bills: they were handed the config's price, which the sink then re-priced for the ledger only."""
    prices = [
        {"backend": "openai", "model": "gpt-4o-mini", "token_class": token_class, "usd_per_1m_tokens": usd}
        for token_class, usd in (("input", "2"), ("output", "8"))
    ]
    assert weir.admin.put("/prices", json={"prices": prices}).status_code == 200
    client = weir.client(weir.tenant_key("repriced"))
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=HI)
    request_id = raw.headers["x-request-id"]
    ledger = weir.attempts(request_id, 1)[1]
    [event] = [e for e in weir.sink.events if e.request_id == request_id]
    usage = raw.parse().usage
    assert usage is not None
    assert event.cost_pico_usd == usage.prompt_tokens * 2_000_000 + usage.completion_tokens * 8_000_000
    assert Decimal(ledger["cost_usd"]) == pico_to_usd(event.cost_pico_usd)
    assert event.prices == {
        "input": 2_000_000,
        "cached_input": 75_000,  # the config's, not changed
        "cache_write_5m": 2_000_000,
        "cache_write_1h": 2_000_000,
        "output": 8_000_000,
    }


def test_the_hedge_cap_counts_what_the_ledger_bills_when_the_price_changes_mid_attempt(
    weir: Weir, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """deepseek-chat costs $100 per 1M tokens, and $10 from 2 s on (a change set ahead, as the docs
    advise). The hedge (started at 0.15 s, answering after 3 s) is billed at the price valid when it
    started, $0.0045 for 45 tokens: the cap must count that, not the price in force once it
    answered ($0.00045), which it counted when it priced the attempt again itself."""
    now = dt.datetime.now(dt.UTC)
    prices = [
        {
            "backend": "deepseek",
            "model": "deepseek-chat",
            "token_class": token_class,
            "usd_per_1m_tokens": usd,
            "effective_from": at.isoformat(),
        }
        for usd, at in (("100", now), ("10", now + dt.timedelta(seconds=2)))
        for token_class in ("input", "output")
    ]
    assert weir.admin.put("/prices", json={"prices": prices}).status_code == 200
    client = weir.client(weir.tenant_key("mid-change"))
    fake_openai.set_latency(first_token=5.0)  # the primary is slow: the hedge answers first
    fake_deepseek.set_latency(first_token=3.0)
    fake_deepseek.set_next_usage(input_tokens=5, output_tokens=40)
    raw = client.chat.completions.with_raw_response.create(model="hedge-capped", messages=HI, max_tokens=50)
    assert route_header(raw)["candidate"] == "deepseek-chat"
    hedge = weir.attempts(raw.headers["x-request-id"], 2)[2]
    assert Decimal(hedge["cost_usd"]) == Decimal("0.0045")
    hedges = weir.app.state.gateway.executor.hedges
    assert counted_micro_usd(hedges, weir.tenant_id("mid-change"), "hedge-capped", 4500, 1)
