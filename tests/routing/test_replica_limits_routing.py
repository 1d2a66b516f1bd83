"""Routed traffic across gateway replicas sharing PostgreSQL and Redis, against tenants' limits.

Three in-process gateways (one PostgreSQL admin DB, one Redis key prefix reached through a proxy a
test can take down) in front of two fake OpenAI-compatible vendors, with the official `openai` SDK as
the client. What a tenant sees while its requests retry, fail over, hedge or resume mid-stream: each
request counted once against RPM; what every attempt used (failed, cut and cancelled ones included)
counted against TPM and the budget, as the ledger bills it; the gateway's own 429 with `retry-after`
and OpenAI's error shape, sending nothing upstream; every budget reservation given back; route edits
made on one replica live on the others; and a budget that holds while Redis is away and after, or
loses it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from gateway.accounting import admission
from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.db import REDIS_PORT, REDIS_URL, fresh_pg_database
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.reliability.proxy import ThreadedProxy
from tests.routing.routed import route_header

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

ADMIN = "admin-token-replica-limits"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
FAST = "probe_interval: null, breaker: {failures: 50, cooldown: 1}"
CONFIG = f"""\
server: {{log_level: warning}}
backends:
  - {{name: openai, type: openai, base_url: "${{OPENAI_URL}}", api_key: "${{OPENAI_KEY}}"}}
  - {{name: deepseek, type: openai, base_url: "${{DEEPSEEK_URL}}", api_key: "${{DEEPSEEK_KEY}}"}}
models:
  - {{name: gpt-4o-mini, backend: openai, price: {{input: 0.15, output: 0.60}}}}
  - {{name: deepseek-chat, backend: deepseek, price: {{input: 0.27, output: 1.10}}}}
database_url: "${{DB_URL}}"
redis_url: "${{REDIS_URL}}"
routes:
  - {{name: failover, retry: {{attempts: 2, backoff: 0.01, max_backoff: 0.02}}, {FAST}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}]}}
  - {{name: hedged, retry: {{attempts: 1}}, hedge: {{delay: 0.1}}, {FAST}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}]}}
  - {{name: editable, retry: {{attempts: 1}}, {FAST}, candidates: [{{model: gpt-4o-mini}}]}}
  - {{name: doomed, retry: {{attempts: 1}}, {FAST}, candidates: [{{model: gpt-4o-mini}}]}}
"""
LEDGER = (
    "SELECT status, input_tokens + cached_input_tokens + cache_write_5m_tokens + cache_write_1h_tokens"
    " + output_tokens, cost_pico_usd FROM usage_events WHERE tenant_id = $1"
)


@dataclass
class Replicas:
    urls: list[str]
    prefix: str  # the replicas' keys in Redis
    database: str  # PostgreSQL URL (asyncpg's form)
    proxy: ThreadedProxy  # between the replicas and Redis: `stop()` takes Redis away from them

    def admin(self, replica: int = 0) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.urls[replica]}/admin/api/v1",
            headers={"authorization": f"Bearer {ADMIN}"},
            timeout=10,
        )

    def client(self, key: str, replica: int) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[replica]}/v1", api_key=key, max_retries=0, timeout=10)

    def tenant(self, **limits: Any) -> tuple[str, str]:
        """A new tenant with `limits` and a key for it: (tenant id, key)."""
        with self.admin() as admin:
            made = admin.post("/tenants", json={"name": f"t-{uuid.uuid4().hex[:8]}", **limits})
            assert made.status_code == 201, made.text
            key = admin.post(f"/tenants/{made.json()['id']}/keys", json={})
            assert key.status_code == 201, key.text
        return made.json()["id"], key.json()["key"]

    def budget(self, tenant_id: str) -> tuple[int, int]:
        """(spent, reserved) of the tenant's budget this month in pico-dollars, as Redis holds it."""
        month = admission.month_of(dt.datetime.now(dt.UTC))
        with redis.Redis.from_url(REDIS_URL) as shared:
            spent, reserved = shared.hmget(
                self.prefix + admission.budget_key("tenant", tenant_id, month), "spent", "reserved"
            )
        return int(spent or 0), int(reserved or 0)

    def counted(self, kind: str, tenant_id: str) -> int:
        """What the tenant's `rpm` or `tpm` window holds in Redis."""
        with redis.Redis.from_url(REDIS_URL) as shared:
            return int(shared.hget(f"{self.prefix}{kind}:tenant:{tenant_id}", "t") or 0)

    def ledger(self, tenant_id: str, rows: int) -> list[tuple[int, int, int]]:
        """(status, tokens, cost in pico-USD) of the tenant's attempts, once `rows` are written."""

        async def read() -> list[tuple[int, int, int]]:
            conn = await asyncpg.connect(self.database.replace("postgresql+asyncpg://", "postgresql://"))
            try:
                return [tuple(r) for r in await conn.fetch(LEDGER, tenant_id)]
            finally:
                await conn.close()

        deadline = time.monotonic() + 5
        while len(found := asyncio.run(read())) < rows:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        return found


@pytest.fixture(scope="module")
def replicas(
    _fake_openai_server: FakeOpenAI,
    _fake_deepseek_server: FakeOpenAI,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Replicas]:
    prefix = f"weirtest:{uuid.uuid4().hex[:10]}:"
    proxy = ThreadedProxy(REDIS_PORT)
    workdir = tmp_path_factory.mktemp("replica-limits")
    try:
        with (
            fresh_pg_database("weir_replicas") as db_url,
            pytest.MonkeyPatch.context() as env,
            ExitStack() as up,
        ):
            env.setenv("WEIR_ADMIN_TOKEN", ADMIN)
            env.setenv("WEIR_REDIS_PREFIX", prefix)
            env.delenv("WEIR_DATABASE_URL", raising=False)
            env.delenv("WEIR_REDIS_URL", raising=False)
            values = {
                "OPENAI_URL": _fake_openai_server.base_url,
                "OPENAI_KEY": _fake_openai_server.api_key,
                "DEEPSEEK_URL": _fake_deepseek_server.base_url,
                "DEEPSEEK_KEY": _fake_deepseek_server.api_key,
                "DB_URL": db_url,
                "REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0",
            }
            urls = []
            for i in range(3):  # one after the other: the first migrates the DB and seeds the routes
                env.setenv("WEIR_USAGE_SPOOL", str(workdir / f"spool-{i}"))
                urls.append(up.enter_context(serve(create_app(parse_config(CONFIG, values)), free_port())))
            yield Replicas(urls, prefix, db_url, proxy)
    finally:
        proxy.close()
        with redis.Redis.from_url(REDIS_URL) as shared:
            if keys := list(shared.scan_iter(match=f"{prefix}*")):
                shared.delete(*keys)


@pytest.fixture
def cluster(replicas: Replicas, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI) -> Replicas:
    """The replicas, with fresh fakes."""
    return replicas


def eventually(check: Callable[[], bool], within: float, what: str) -> None:
    """Polls `check` until it holds."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {within:g} s"
        time.sleep(0.02)


def books_match(cluster: Replicas, tenant_id: str, rows: int) -> None:
    """Redis's books for the tenant's budget come to exactly what the ledger bills, with nothing left
    reserved."""
    billed = sum(cost for _, _, cost in cluster.ledger(tenant_id, rows))
    deadline = time.monotonic() + 3
    while (books := cluster.budget(tenant_id)) != (billed, 0):
        assert time.monotonic() < deadline, f"(spent, reserved) {books}, billed {billed}"
        time.sleep(0.02)


def lose_budget(cluster: Replicas, tenant_id: str) -> None:
    """What Redis holds of the tenant's budget this month is gone, as after a restart without its
    data, a failover to a replica behind it or an eviction (spent, reservations and their expiries,
    the seed mark, the attempts settled without one)."""
    key = cluster.prefix + admission.budget_key(
        "tenant", tenant_id, admission.month_of(dt.datetime.now(dt.UTC))
    )
    with redis.Redis.from_url(REDIS_URL) as shared:
        assert shared.delete(key, key + ":res", key + ":exp", key + ":unseeded") >= 1


def degraded(cluster: Replicas) -> float:
    """How many of the replicas' shared states run without Redis (one process: the metric counts all)."""
    match = re.search(
        r"^weir_shared_state_degraded (\S+)$", httpx.get(f"{cluster.urls[0]}/metrics").text, re.M
    )
    assert match, "the metric is exported"
    return float(match.group(1))


def ask(client: openai.OpenAI, model: str = "failover", **kw: Any) -> int:
    """The HTTP status the client got for one chat request."""
    try:
        reply = client.chat.completions.create(model=model, messages=HI, max_tokens=10, **kw)
    except openai.APIStatusError as exc:
        return exc.status_code
    assert reply.choices[0].message.content == ECHO
    return 200


def stream_text(client: openai.OpenAI, model: str, **kw: Any) -> str:
    chunks = client.chat.completions.create(model=model, messages=HI, max_tokens=10, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def chats(fake: FakeOpenAI) -> int:
    """Chat requests the vendor got (not the health probes' model lists)."""
    return sum(r.path.endswith("/chat/completions") for r in fake.requests)


# --- rate limits: counted once per request, the gateway's own 429 ----------------------------------


def test_a_request_that_retries_and_fails_over_counts_once_and_our_own_429_goes_nowhere(
    cluster: Replicas, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """RPM 3 shared by three replicas. The first request fails twice on gpt-4o-mini and is answered by
    its fallback: one request, three attempts, counted once. Two more on the other replicas fit; the
    fourth gets the gateway's own 429 (OpenAI's error body, `retry-after`, no attempt in
    `x-weir-route`), and neither a retry nor a fallback sends anything upstream for it, even on a
    hedged route whose primary is slow."""
    tenant_id, key = cluster.tenant(rpm=3)
    fake_openai.fail_next(500, times=2)
    raw = cluster.client(key, 0).chat.completions.with_raw_response.create(model="failover", messages=HI)
    assert route_header(raw)["tried"] == "gpt-4o-mini:502,gpt-4o-mini:502,deepseek-chat:ok"
    assert cluster.counted("rpm", tenant_id) == 1
    assert [ask(cluster.client(key, i)) for i in (1, 2)] == [200, 200]

    sent = chats(fake_openai), chats(fake_deepseek)
    fake_openai.set_latency(first_token=0.3)  # a hedge would start after 0.1 s
    for replica, model in ((0, "failover"), (1, "hedged"), (2, "hedged")):
        with pytest.raises(openai.RateLimitError) as caught:
            cluster.client(key, replica).chat.completions.create(model=model, messages=HI)
        assert caught.value.body == {
            "message": caught.value.body["message"],  # type: ignore[index]
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
        assert 1 <= int(caught.value.response.headers["retry-after"]) <= 60
        header = route_header(caught.value.response)
        assert header["route"] == model and header["attempts"] == "0" and "tried" not in header
    time.sleep(0.3)  # long enough for a hedge to have been sent
    assert (chats(fake_openai), chats(fake_deepseek)) == sent
    assert cluster.counted("rpm", tenant_id) == 3


def test_hedged_requests_through_three_replicas_admit_exactly_the_limit(
    cluster: Replicas, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """RPM 6, twelve concurrent hedged requests spread over the replicas while the primary is slow:
    each admitted request is one unit however many attempts it makes, so exactly six are answered,
    the other six are refused before anything goes upstream, and every reservation comes back."""
    tenant_id, key = cluster.tenant(rpm=6, budget_usd_monthly="10")
    fake_openai.set_latency(first_token=0.4)
    clients = [cluster.client(key, i) for i in range(3)]
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda i: ask(clients[i % 3], "hedged"), range(12)))
    assert sorted(statuses) == [200] * 6 + [429] * 6
    assert cluster.counted("rpm", tenant_id) == 6
    assert chats(fake_openai) == 6 and chats(fake_deepseek) <= 6
    books_match(cluster, tenant_id, 12)  # each answered request: its winner and its cancelled loser


# --- what every attempt used: TPM and the budget, as the ledger bills it ----------------------------


def test_failed_cut_and_cancelled_attempts_count_against_tpm_and_budget_as_billed(
    cluster: Replicas, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """On three replicas: a request whose first candidate fails (500) and its fallback answers; a
    hedged one whose slow primary is cancelled; a stream cut after three words that resumes on the
    other candidate; a stream whose client leaves mid-way. The tenant's TPM window and its budget's
    `spent` in Redis must equal what the ledger bills, attempt by attempt (cut and cancelled ones
    too), and nothing may stay reserved."""
    tenant_id, key = cluster.tenant(tpm=2000, budget_usd_monthly="5")  # too small a TPM to lease
    fake_openai.fail_next(500)
    assert ask(cluster.client(key, 0)) == 200
    fake_openai.set_latency(first_token=0.3)
    assert ask(cluster.client(key, 1), "hedged") == 200
    fake_openai.set_latency(per_token=0.05)
    fake_openai.fail_next(Fault.cut_stream(after=3))
    assert stream_text(cluster.client(key, 2), "failover") == ECHO
    chunks = cluster.client(key, 0).chat.completions.create(
        model="failover",
        messages=HI,
        max_tokens=10,
        stream=True,
    )
    next(iter(chunks))
    chunks.close()  # the client leaves after its first chunk
    rows = cluster.ledger(tenant_id, 7)
    assert sorted(status for status, _, _ in rows) == [200, 200, 200, 499, 499, 500, 502]
    eventually(
        lambda: cluster.counted("tpm", tenant_id) == sum(tokens for _, tokens, _ in rows),
        3,
        "the TPM window holding the ledger's tokens",
    )
    books_match(cluster, tenant_id, len(rows))


def test_a_client_that_reuses_one_request_id_gets_every_reservation_and_estimate_back(
    cluster: Replicas, fake_openai: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client may send its own `x-request-id` and the gateway keeps it as given, random or not: an
    SDK built with `default_headers={"x-request-id": trace_id}` sends one id on every request. What
    admission keeps per request (the budget reservation, the token estimate) was keyed by that id
    alone, so requests sharing it settled and released each other's: concurrent ones left money
    reserved for 10 minutes and token estimates counted for the minute (the tenant then gets 429s
    it has not earned), and a request still streaming when an earlier one with its id was forgotten
    (10 s after that one ended) was forgotten with it, its reservation never released."""
    monkeypatch.setattr(admission, "FINISHED_GRACE_S", 0.2)  # forgotten 0.2 s after the end, not 10 s
    monkeypatch.setattr(admission, "EXPIRE_EVERY_S", 0.05)
    tenant_id, key = cluster.tenant(tpm=2000, budget_usd_monthly="5")
    client = openai.OpenAI(
        base_url=f"{cluster.urls[0]}/v1",
        api_key=key,
        max_retries=0,
        timeout=10,
        default_headers={"x-request-id": "trace-4711"},
    )
    fake_openai.set_latency(first_token=0.3)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: ask(client), range(4))) == [200] * 4
    fake_openai.set_latency(per_token=0.1)
    assert stream_text(client, "failover") == ECHO
    slow = threading.Thread(target=lambda: stream_text(client, "failover"))
    slow.start()  # the same id, streaming for 0.5 s: the first one is forgotten meanwhile
    time.sleep(0.3)
    assert ask(cluster.client(key, 0)) == 200  # an admission forgets what is due
    slow.join(5)
    rows = cluster.ledger(tenant_id, 7)
    assert [status for status, _, _ in rows] == [200] * 7
    books_match(cluster, tenant_id, len(rows))
    assert cluster.counted("tpm", tenant_id) == sum(tokens for _, tokens, _ in rows)


# --- route edits through the admin API while traffic flows ----------------------------------------


def test_a_route_edited_on_one_replica_takes_effect_on_the_others_within_two_seconds(
    cluster: Replicas, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """Requests keep flowing to every replica while the admin API on replica 0 moves `editable` from
    gpt-4o-mini to deepseek-chat. Documented: live everywhere within about a second. No request may
    fail meanwhile, and no replica may go back to the old candidate once it served the new one."""
    _, key = cluster.tenant(rpm=1000)
    clients = [cluster.client(key, i) for i in range(3)]
    served: list[tuple[float, int, str]] = []  # (when, replica, candidate)
    stop = threading.Event()

    def traffic(replica: int) -> None:
        while not stop.is_set():
            raw = clients[replica].chat.completions.with_raw_response.create(model="editable", messages=HI)
            served.append((time.monotonic(), replica, route_header(raw)["candidate"]))

    with ThreadPoolExecutor(3) as pool, cluster.admin(0) as admin:
        running = [pool.submit(traffic, i) for i in range(3)]
        try:
            route = next(r for r in admin.get("/routes").json()["data"] if r["name"] == "editable")
            route["candidates"] = [{"model": "deepseek-chat"}]
            edited = admin.put(
                f"/routes/{route['id']}", json=route, headers={"if-match": route["updated_at"]}
            )
            assert edited.status_code == 200, edited.text
            at = time.monotonic()
            switched = lambda: {r for t, r, c in served if c == "deepseek-chat"} == {0, 1, 2}  # noqa: E731
            eventually(switched, 2.0, "the edit reaching every replica")
        finally:
            stop.set()
        for done in running:
            done.result()  # no request failed
    for replica in range(3):
        mine = [(t, c) for t, r, c in served if r == replica]
        first_new = next(i for i, (_, c) in enumerate(mine) if c == "deepseek-chat")
        assert all(c == "deepseek-chat" for _, c in mine[first_new:]), f"replica {replica} went back"
        assert mine[first_new][0] - at < 2.0
    assert fake_openai.requests and fake_deepseek.requests


def test_a_route_deleted_mid_stream_finishes_that_stream_and_then_is_gone_everywhere(
    cluster: Replicas, fake_openai: FakeOpenAI
) -> None:
    """A stream on replica 1 is under way when the route is deleted through replica 0: it still ends
    as it would have (the plan it started with stands), billed and released; after that every
    replica answers the route's name with 404 model_not_found within two seconds."""
    tenant_id, key = cluster.tenant(budget_usd_monthly="5")
    fake_openai.set_latency(per_token=0.1)
    chunks = iter(
        cluster.client(key, 1).chat.completions.create(
            model="doomed",
            messages=HI,
            max_tokens=10,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in [next(chunks)] if c.choices)
    with cluster.admin(0) as admin:
        route = next(r for r in admin.get("/routes").json()["data"] if r["name"] == "doomed")
        assert admin.delete(f"/routes/{route['id']}").status_code == 204
    deleted = time.monotonic()
    text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ECHO
    fake_openai.set_latency()

    answered = [1]  # the stream; and requests a replica answered before the deletion reached it

    def gone(replica: int) -> bool:
        try:
            cluster.client(key, replica).chat.completions.create(model="doomed", messages=HI, max_tokens=5)
        except openai.NotFoundError as exc:
            assert exc.body["code"] == "model_not_found"  # type: ignore[index]
            return True
        answered.append(1)
        return False

    for replica in range(3):
        eventually(lambda: gone(replica), 2.0 - (time.monotonic() - deleted), f"404 on replica {replica}")  # noqa: B023
    books_match(cluster, tenant_id, len(answered))


# --- Redis going away --------------------------------------------------------------------------------


def test_an_exhausted_budget_stays_exhausted_on_every_replica_while_redis_is_away(
    cluster: Replicas, fake_openai: FakeOpenAI
) -> None:
    """Documented: while Redis is unreachable, limits and budgets hold per replica. A tenant whose
    budget is spent is refused by Redis; with Redis gone, a replica must still know what was spent
    (from its own settlements, or the ledger), not start the month again from zero: each replica
    admitted the tenant's requests again up to a whole budget."""
    tenant_id, key = cluster.tenant(budget_usd_monthly="0.000019")  # 19 micro-dollars: two requests
    assert [ask(cluster.client(key, i)) for i in (0, 1, 0)] == [200, 200, 429]
    cluster.ledger(tenant_id, 2)
    cluster.proxy.stop()
    try:
        for replica in range(3):
            with pytest.raises(openai.RateLimitError) as caught:
                cluster.client(key, replica).chat.completions.create(
                    model="failover", messages=HI, max_tokens=10
                )
            assert caught.value.body["code"] == "insufficient_quota"  # type: ignore[index]
    finally:
        cluster.proxy.start()
    assert chats(fake_openai) == 2


def test_what_was_settled_while_redis_was_away_reaches_it_once_it_is_back(
    cluster: Replicas, fake_openai: FakeOpenAI
) -> None:
    """A stream admitted through Redis is under way when Redis goes away; it ends, and two more
    requests are answered, all settled in process. Once Redis is back, its books must hold what the
    ledger bills (it missed the outage's spend for the rest of the month, so the budget could be
    overspent by that much) and nothing reserved (the stream's reservation was held for 10 minutes)."""
    tenant_id, key = cluster.tenant(budget_usd_monthly="0.001")  # too small a budget to pool
    assert ask(cluster.client(key, 0)) == 200
    fake_openai.set_latency(per_token=0.1)
    chunks = iter(
        cluster.client(key, 1).chat.completions.create(
            model="failover",
            messages=HI,
            max_tokens=10,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in [next(chunks)] if c.choices)
    cluster.proxy.stop()
    try:
        text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ECHO
        fake_openai.set_latency()
        assert [ask(cluster.client(key, i)) for i in (0, 1)] == [200, 200]
    finally:
        cluster.proxy.start()
    time.sleep(1.1)  # a replica tries Redis again a second after it failed
    assert [ask(cluster.client(key, i)) for i in (0, 1)] == [200, 200]
    books_match(cluster, tenant_id, 6)


def test_a_request_settled_after_redis_lost_the_budget_counts_once_when_it_is_seeded_again(
    cluster: Replicas, fake_openai: FakeOpenAI
) -> None:
    """A request in flight when Redis loses the tenant's budget settles into Redis without the seed
    mark, and its usage event reaches the ledger within milliseconds. The next request (on another
    replica) seeds the budget again from the ledger, whose spend holds that cost already: Redis must
    count it once (it counted it twice, refusing the tenant that much early for the rest of the
    month), so that its books equal what the ledger bills."""
    tenant_id, key = cluster.tenant(budget_usd_monthly="0.001")  # too small a budget to pool
    assert ask(cluster.client(key, 0)) == 200  # seeds the budget from the (empty) ledger
    books_match(cluster, tenant_id, 1)

    fake_openai.set_latency(first_token=0.5)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(ask, cluster.client(key, 1))
        eventually(lambda: chats(fake_openai) == 2, 5, "the second request reaching the vendor")
        lose_budget(cluster, tenant_id)
        assert in_flight.result() == 200
    fake_openai.set_latency()
    cluster.ledger(tenant_id, 2)  # the in-flight request's cost is in the ledger now

    assert ask(cluster.client(key, 2)) == 200  # finds the budget lost: seeds it again, then admits
    books_match(cluster, tenant_id, 3)


def test_what_a_replica_settled_while_redis_was_away_counts_once_if_redis_lost_the_budget(
    cluster: Replicas, fake_openai: FakeOpenAI
) -> None:
    """A replica answers a request while Redis is away and owes Redis its cost; Redis comes back
    without the tenant's budget (restarted empty). The replica hands the cost back, the request's
    spooled usage event reaches the ledger, and the next request seeds the budget again from the
    ledger, which holds that cost already: Redis must count it once."""
    tenant_id, key = cluster.tenant(budget_usd_monthly="0.001")
    assert ask(cluster.client(key, 0)) == 200
    books_match(cluster, tenant_id, 1)
    cluster.proxy.stop()
    try:
        assert ask(cluster.client(key, 0)) == 200  # settled in replica 0's process
        lose_budget(cluster, tenant_id)
    finally:
        cluster.proxy.start()
    eventually(lambda: degraded(cluster) == 0, 5, "the replica sharing its state through Redis again")
    cluster.ledger(tenant_id, 2)  # the spool reached the ledger

    assert ask(cluster.client(key, 0)) == 200  # finds the budget lost: seeds it again, then admits
    books_match(cluster, tenant_id, 3)
