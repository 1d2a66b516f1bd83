"""Three `weir serve` replicas sharing one PostgreSQL database and one Redis, with the official `openai`
SDK spreading requests over them round robin: limits and budgets hold exactly across replicas, a
revocation, a route edit and an open circuit reach every replica, each usage event lands once, the
usage report equals what the clients were told, and a replica killed mid-load loses nothing already
accounted while the SDK's retries move to the survivors."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.accounting.events import decode
from tests.fakes import FakeOpenAI
from tests.scaleout.cluster import DEMO_KEY, PRICES, REDIS_URL, Cluster, RoundRobin, cluster, pg_query

# Three gateway processes start once for the module (about 20-30 s on 2 shared cores).
pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture(scope="module")
def replicas(
    _fake_openai_server: FakeOpenAI,
    _fake_deepseek_server: FakeOpenAI,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    with cluster(
        3,
        openai_url=_fake_openai_server.base_url,
        openai_key=_fake_openai_server.api_key,
        flaky_url=_fake_deepseek_server.base_url,
        flaky_key=_fake_deepseek_server.api_key,
        workdir=tmp_path_factory.mktemp("scaleout"),
    ) as c:
        yield c


def balanced(
    c: Cluster, api_key: str, max_retries: int = 0, replicas: list[int] | None = None
) -> openai.OpenAI:
    bases = [c.bases[i] for i in (replicas if replicas is not None else range(len(c.bases)))]
    return openai.OpenAI(
        base_url=f"{bases[0]}/v1",
        api_key=api_key,
        max_retries=max_retries,
        http_client=httpx.Client(transport=RoundRobin(bases), timeout=30),
    )


def tenant_with_key(c: Cluster, **limits: Any) -> tuple[str, str, str]:
    """A new tenant with `limits`, and a key for it: (tenant id, key, key id)."""
    with c.admin() as admin:
        tenant = admin.post("/tenants", json={"name": f"scale-{uuid.uuid4().hex[:8]}", **limits})
        assert tenant.status_code == 201, tenant.text
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        assert key.status_code == 201, key.text
    return tenant.json()["id"], key.json()["key"], key.json()["id"]


def cost(model: str, prompt_tokens: int, completion_tokens: int) -> Decimal:
    price = PRICES[model]
    return (prompt_tokens * Decimal(price["input"]) + completion_tokens * Decimal(price["output"])) / 10**6


def eventually(check: Callable[[], bool], within: float, what: str) -> float:
    """Polls `check` until it holds; returns the seconds it took."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within, f"{what} did not happen within {within:g} s"
        time.sleep(0.05)
    return time.monotonic() - start


def ledger_rows(c: Cluster, tenant_id: str) -> list[Any]:
    return pg_query(
        c.database,
        "SELECT event_id, request_id, status, model, input_tokens, output_tokens, cost_pico_usd"
        " FROM usage_events WHERE tenant_id = $1",
        tenant_id,
    )


def wait_for_ledger(c: Cluster, tenant_id: str, rows: int, within: float = 20) -> list[Any]:
    eventually(lambda: len(ledger_rows(c, tenant_id)) >= rows, within, f"{rows} ledger rows")
    time.sleep(0.3)  # anything more than expected would be written by now
    return ledger_rows(c, tenant_id)


def chat(client: openai.OpenAI, text: str, request_id: str | None = None, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=kw.pop("model", "gpt-4o-mini"),
        messages=[{"role": "user", "content": text}],
        extra_headers={"x-request-id": request_id or uuid.uuid4().hex},
        **kw,
    )


def test_rpm_holds_exactly_and_every_admitted_request_is_billed_once(replicas: Cluster) -> None:
    tenant_id, key, _ = tenant_with_key(replicas, rpm=60)
    client = balanced(replicas, key)

    def one(i: int) -> tuple[str, Any]:
        request_id = f"rpm-{uuid.uuid4().hex[:12]}-{i}"
        try:
            return request_id, chat(client, f"request {i}", request_id)
        except openai.RateLimitError as exc:
            return request_id, exc

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(200)))
    served = {rid: r for rid, r in results if not isinstance(r, Exception)}
    refused = [r for _, r in results if isinstance(r, Exception)]
    assert len(served) == 60
    assert len(refused) == 140
    assert all(e.status_code == 429 and e.code == "rate_limit_exceeded" for e in refused)

    rows = wait_for_ledger(replicas, tenant_id, 60)
    assert len(rows) == 60  # exactly once each, though three writers share the stream
    assert {r["request_id"] for r in rows} == set(served)
    by_request = {r["request_id"]: r for r in rows}
    for rid, reply in served.items():
        row = by_request[rid]
        assert (row["input_tokens"], row["output_tokens"]) == (
            reply.usage.prompt_tokens,
            reply.usage.completion_tokens,
        )
    seen = sum(cost("gpt-4o-mini", r.usage.prompt_tokens, r.usage.completion_tokens) for r in served.values())
    # Each replica's admin API reports the same total, equal to the clients' usage at the list prices.
    for i in range(3):
        with replicas.admin(i) as admin:
            report = admin.get("/reports/usage", params={"group_by": "tenant"}).json()
        (row,) = [r for r in report["rows"] if r["tenant"] == tenant_id]
        assert row["requests"] == 60
        assert Decimal(row["cost_usd"]) == seen


def test_a_budget_holds_across_replicas(replicas: Cluster) -> None:
    budget = Decimal("0.0001")  # about 45 of these requests
    tenant_id, key, _ = tenant_with_key(replicas, budget_usd_monthly=str(budget))
    client = balanced(replicas, key)

    def one(i: int) -> Any:
        try:
            return chat(client, f"budget request {i:03d}", max_tokens=16)  # one size: one estimate
        except openai.RateLimitError as exc:
            return exc

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(90)))
    # Then one at a time, so no reservation is in flight, until the budget alone refuses.
    for i in range(90, 200):
        results.append(one(i))
        if isinstance(results[-1], Exception):
            break
    served = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert served and refused
    assert all(e.status_code == 429 and e.code == "insufficient_quota" for e in refused)
    spent = sum(cost("gpt-4o-mini", r.usage.prompt_tokens, r.usage.completion_tokens) for r in served)
    assert spent <= budget

    rows = wait_for_ledger(replicas, tenant_id, len(served))
    assert len(rows) == len(served)
    assert sum(Decimal(r["cost_pico_usd"]) for r in rows) / 10**12 == spent
    # Nothing in flight now: every replica refuses because spent + one estimate no longer fits, so the
    # budget was used up, not merely crowded by the concurrent reservations.
    for base in replicas.bases:
        direct = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            chat(direct, "budget request 999", max_tokens=16)
        assert info.value.code == "insufficient_quota"


def test_a_revoked_key_is_refused_by_every_replica_within_a_second(replicas: Cluster) -> None:
    _, key, key_id = tenant_with_key(replicas)
    clients = [openai.OpenAI(base_url=f"{b}/v1", api_key=key, max_retries=0) for b in replicas.bases]
    for client in clients:  # every replica has the key cached (for 30 s) now
        chat(client, "hello")
    with replicas.admin(1) as admin:
        assert admin.delete(f"/keys/{key_id}").status_code == 204
    revoked_at = time.monotonic()

    def refused(client: openai.OpenAI) -> bool:
        try:
            chat(client, "still there?")
        except openai.AuthenticationError:
            return True
        return False

    for client in clients:
        eventually(lambda c=client: refused(c), 1.0 - (time.monotonic() - revoked_at), "the revocation")


def route_reply(client: openai.OpenAI, model: str) -> tuple[str, str]:
    """(x-weir-route, reply text) of one request to `model`."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "where do I go?"}]
    )
    return raw.headers.get("x-weir-route", ""), raw.parse().choices[0].message.content or ""


def direct_clients(c: Cluster) -> list[openai.OpenAI]:
    return [openai.OpenAI(base_url=f"{b}/v1", api_key=DEMO_KEY, max_retries=0) for b in c.bases]


def serves_with(client: openai.OpenAI, route: str, candidate: str) -> bool:
    try:
        header, _ = route_reply(client, route)
    except openai.NotFoundError:
        return False
    return f"candidate={candidate};" in header


def test_a_route_edit_reaches_every_replica(replicas: Cluster) -> None:
    name = f"scale-route-{uuid.uuid4().hex[:6]}"
    route = {"name": name, "candidates": [{"model": "gpt-4o-mini"}], "probe_interval": None}
    with replicas.admin(0) as admin:
        created = admin.post("/routes", json=route)
        assert created.status_code in (200, 201), created.text
    clients = direct_clients(replicas)
    for client in clients:
        eventually(lambda c=client: serves_with(c, name, "gpt-4o-mini"), 5, "the new route")
    with replicas.admin(2) as admin:  # edited through another replica
        edited = admin.put(
            f"/routes/{created.json()['id']}", json={**route, "candidates": [{"model": "deepseek-chat"}]}
        )
        assert edited.status_code == 200, edited.text
    for client in clients:
        eventually(lambda c=client: serves_with(c, name, "deepseek-chat"), 5, "the route edit")


def breaker_state(c: Cluster, replica: int) -> str:
    with c.admin(replica) as admin:
        breakers = admin.get("/routes/status").json()["breakers"]
    return next((v for k, v in breakers.items() if "deepseek-chat" in k), "closed")


def breaker_open(c: Cluster, replica: int) -> bool:
    return breaker_state(c, replica) == "open"


def test_a_circuit_opened_by_one_replica_is_seen_by_the_others(
    replicas: Cluster, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """The backend fails for everyone. Replica 0 opens its breaker; the others take the opening up
    without paying `failures` requests of their own: one that saw the backend answer within the
    cooldown (earlier tests of the module may have) contests it, and its next request there is its
    own trial, which fails over; one that did not adopts it and skips the backend at once. Either way
    each sends it at most one request, and every client is answered."""
    # A route seeded from the config (routes added through the admin API are probed the same way:
    # tests/routing/test_router_probes.py).
    name = "guarded"
    clients = direct_clients(replicas)
    assert not any(breaker_open(replicas, i) for i in range(3))

    fake_deepseek.fail_next(500, times=100)
    for _ in range(2):  # replica 0 sees the failures first, and fails over for the client
        header, _ = route_reply(clients[0], name)
        assert "deepseek-chat:50" in header and "gpt-4o-mini:ok" in header
    assert breaker_open(replicas, 0)
    chats_before = sum(r.path.endswith("/chat/completions") for r in fake_deepseek.requests)
    for i in (1, 2):
        eventually(
            lambda i=i: breaker_state(replicas, i) in ("open", "half_open"),
            5,
            f"replica {i} reading the opening",
        )
        header, _ = route_reply(clients[i], name)
        assert "candidate=gpt-4o-mini" in header
        assert "deepseek-chat:open" in header or "deepseek-chat:50" in header  # skipped, or its trial
        assert breaker_open(replicas, i)
    # At most one trial each: without the shared opening each would have sent `failures` (2).
    assert sum(r.path.endswith("/chat/completions") for r in fake_deepseek.requests) - chats_before <= 2


def stream_events(c: Cluster) -> set[str]:
    """The ids of the usage events in the shared Redis stream."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        entries = client.xrange(f"{c.redis_prefix}usage")
    finally:
        client.close()
    events = [decode(line) for _, fields in entries for line in fields[b"e"].split(b"\n") if line]
    return {e.event_id for e in events}


@pytest.mark.slow  # 5 s of load, and up to 30 s more when the dead replica held unacknowledged events
def test_a_replica_killed_mid_load_loses_nothing_and_the_others_keep_serving(
    replicas: Cluster, fake_openai: FakeOpenAI
) -> None:
    tenant_id, key, _ = tenant_with_key(replicas)
    fake_openai.set_latency(first_token=0.2)  # so requests are in flight on the replica when it dies
    client = balanced(replicas, key, max_retries=3)
    stop = threading.Event()
    served: list[tuple[str, float]] = []  # (request id, when the client got its answer)
    failures: list[Exception] = []

    def load() -> None:
        while not stop.is_set():
            request_id = f"kill-{uuid.uuid4().hex}"
            try:
                chat(client, "keep going", request_id)
                served.append((request_id, time.monotonic()))
            except Exception as exc:
                failures.append(exc)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(2)
    killed_at = time.monotonic()
    served_before = len(served)
    replicas.kill(2)
    # What was accounted when it died: events in the shared stream (read first), or already in the
    # ledger (the writers delete entries from the stream once committed).
    accounted = set(stream_events(replicas)) | {r["event_id"] for r in ledger_rows(replicas, tenant_id)}
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not failures, failures[:3]
    assert served_before > 0
    after = [rid for rid, at in served if at > killed_at]
    assert len(after) >= 10  # the survivors kept serving

    # Everything accounted lands in the ledger, what the dead replica had read but not committed too
    # (another replica claims it after 30 s), and so does every answer the clients got, except one the
    # dead replica gave in its last instant (its event still in the process's memory).
    settled = {rid for rid, at in served if at < killed_at - 0.5 or at > killed_at}

    def caught_up() -> bool:
        rows = ledger_rows(replicas, tenant_id)
        return accounted <= {r["event_id"] for r in rows} and settled <= {r["request_id"] for r in rows}

    eventually(caught_up, 60, "the ledger to catch up")
    # The survivors still answer.
    survivor = balanced(replicas, key, replicas=[0, 1])
    assert chat(survivor, "after the crash").usage is not None
