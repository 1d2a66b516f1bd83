"""Routes in the admin DB: seeded from the config once, edited through /admin/api/v1/routes, applied
on every replica within seconds without a restart; outcome feedback stored per tenant; the ledger
keeps each attempt's routing decision; trained difficulty heads uploaded, routed by and swapped on every
replica. Two replicas of the real gateway share PostgreSQL and Redis."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.app import create_app
from gateway.config import parse_config
from routing.heads import bundle, digest
from routing.prefixes import PREFIX, prefix_keys
from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fixtures.db import REDIS_URL, fresh_pg_database, sync_exec
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.waiting import wait_for
from tests.routing.forced_heads import forced
from tests.routing.routed import route_header

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

ADMIN = "admin-token-for-route-tests"
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
  - {name: anthropic, type: anthropic, base_url: "${ANTHROPIC_BASE_URL}", api_key: "${ANTHROPIC_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
  - {name: claude-sonnet, backend: anthropic, model: claude-sonnet-4-5, price: {input: 3.0, output: 15.0}}
database_url: "${DB_URL}"
routes:
  - {name: auto, candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}], probe_interval: null}
  - name: shared
    probe_interval: 0.2
    retry: {attempts: 1}
    breaker: {failures: 2, cooldown: 30}
    candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}]
  - name: hedged
    probe_interval: null
    retry: {attempts: 1}
    hedge: {delay: 0.1, max_spend_usd_per_hour: 0.035}
    candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}]
  - name: sticky
    policy: prefix_affinity
    prefix_chars: 40
    probe_interval: null
    candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}]
"""
HI = [{"role": "user", "content": "hello routes"}]


class Replicas:
    def __init__(self, urls: list[str], db_url: str, redis_prefix: str = "") -> None:
        self.urls, self.db_url, self.redis_prefix = urls, db_url, redis_prefix
        self.admin = [
            httpx.Client(base_url=f"{u}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
            for u in urls
        ]

    def key(self, name: str) -> tuple[str, str]:
        tenant = self.admin[0].post("/tenants", json={"name": name})
        assert tenant.status_code == 201, tenant.text
        key = self.admin[0].post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "app"})
        assert key.status_code == 201, key.text
        return tenant.json()["id"], key.json()["key"]

    def client(self, replica: int, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[replica]}/v1", api_key=key, max_retries=0, timeout=20)

    def route_of(
        self, replica: int, key: str, model: str = "auto", text: str = HI[0]["content"]
    ) -> dict[str, str]:
        messages = [{"role": "user", "content": text}]
        raw = self.client(replica, key).chat.completions.with_raw_response.create(
            model=model, messages=messages
        )  # type: ignore[arg-type]
        assert raw.parse().choices[0].message.content == text
        return route_header(raw)


@pytest.fixture
def database() -> Iterator[str]:
    """A fresh PostgreSQL database (as tests/control's pg_url), dropped afterwards."""
    with fresh_pg_database("weir_routes") as url:
        yield url


@pytest.fixture
def replicas(
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    database: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Replicas]:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    prefix = f"weirtest:{uuid.uuid4().hex[:10]}:"
    monkeypatch.setenv("WEIR_REDIS_PREFIX", prefix)
    monkeypatch.setenv("WEIR_REDIS_URL", REDIS_URL)
    env = {
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "ANTHROPIC_BASE_URL": fake_anthropic.base_url,
        "ANTHROPIC_API_KEY": fake_anthropic.api_key,
        "DB_URL": database,
    }
    with ExitStack() as stack:
        urls = []
        for i in range(2):
            monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / f"spool{i}"))
            app = create_app(parse_config(CONFIG, env))
            urls.append(stack.enter_context(serve(app, free_port())))
        yield Replicas(urls, database, prefix)
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)


def test_seeded_once_edited_everywhere_without_restart(replicas: Replicas) -> None:
    _, key = replicas.key("acme")
    listed = replicas.admin[0].get("/routes").json()["data"]
    assert [(r["name"], [c["model"] for c in r["candidates"]]) for r in listed] == [
        ("auto", ["gpt-4o-mini", "claude-sonnet"]),
        ("shared", ["gpt-4o-mini", "claude-sonnet"]),
        ("hedged", ["gpt-4o-mini", "claude-sonnet"]),
        ("sticky", ["gpt-4o-mini", "claude-sonnet"]),
    ]  # two replicas started on one DB: seeded once
    assert replicas.route_of(1, key)["candidate"] == "gpt-4o-mini"

    route_id = listed[0]["id"]
    edited = {"name": "auto", "candidates": [{"model": "claude-sonnet"}, {"model": "gpt-4o-mini"}]}
    response = replicas.admin[0].put(f"/routes/{route_id}", json=edited)
    assert response.status_code == 200, response.text
    assert replicas.route_of(0, key)["candidate"] == "claude-sonnet"  # at once where it was edited
    deadline = time.monotonic() + 5
    while replicas.route_of(1, key)["candidate"] != "claude-sonnet":  # within the poll interval elsewhere
        assert time.monotonic() < deadline, "the edit did not reach the other replica"
        time.sleep(0.2)

    audit = replicas.admin[0].get("/audit").json()["data"]
    assert any(entry["entity"] == "route" and entry["action"] == "update" for entry in audit)


def test_invalid_routes_are_refused_and_change_nothing(replicas: Replicas) -> None:
    before = replicas.admin[0].get("/routes").json()["data"]
    response = replicas.admin[0].post("/routes", json={"name": "x", "candidates": [{"model": "nope"}]})
    assert response.status_code == 400 and "nope" in response.json()["error"]["message"]
    response = replicas.admin[0].post("/routes", json={"name": "x", "policy": "fastest", "candidates": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "policy"
    response = replicas.admin[0].post(
        "/routes",
        json={
            "name": "x",
            "policy": "prefix_affinity",
            "prefix_share": 1.5,
            "candidates": [{"model": "gpt-4o-mini"}],
        },
    )
    assert (
        response.status_code == 400
        and "prefix_share: must be within [0, 1]" in response.json()["error"]["message"]
    )
    assert replicas.admin[0].get("/routes").json()["data"] == before


CHEAP = {
    "name": "cheap",
    "policy": "cheapest",
    "candidates": [{"model": "claude-sonnet"}, {"model": "gpt-4o-mini"}],
}


def test_created_then_deleted_route(replicas: Replicas) -> None:
    _, key = replicas.key("acme")
    created = replicas.admin[0].post("/routes", json=CHEAP)
    assert created.status_code == 201, created.text
    route = replicas.route_of(0, key, "cheap")
    assert (route["policy"], route["candidate"]) == ("cheapest", "gpt-4o-mini")
    # An app's model picker offers the route beside the plain models.
    listed = {m.id: m.owned_by for m in replicas.client(0, key).models.list()}
    assert listed["cheap"] == "weir" and listed["gpt-4o-mini"] == "openai"
    assert replicas.client(0, key).models.retrieve("cheap").owned_by == "weir"
    assert replicas.admin[0].delete(f"/routes/{created.json()['id']}").status_code == 204
    with pytest.raises(openai.NotFoundError):
        replicas.client(0, key).chat.completions.create(model="cheap", messages=HI)
    assert "cheap" not in {m.id for m in replicas.client(0, key).models.list()}
    status = replicas.admin[0].get("/routes/status").json()
    assert "cheap" not in status["routes"] and "auto" in status["routes"]


def test_cheapest_prices_at_the_catalog_an_admin_edits(replicas: Replicas) -> None:
    """Every attempt is billed at the price catalog's prices, which an admin can change at any time:
    `cheapest` ranks at those, not at the config's (which only seed the catalog)."""
    _, key = replicas.key("acme")
    created = replicas.admin[0].post("/routes", json=CHEAP)
    assert created.status_code == 201, created.text
    assert replicas.route_of(0, key, "cheap")["candidate"] == "gpt-4o-mini"  # $0.15 against $3 per 1M
    # The seeded rows are the config's, per backend; the admin raises gpt-4o-mini's above Sonnet's.
    dearer = {
        "prices": [
            {
                "backend": "openai",
                "model": "gpt-4o-mini",
                "token_class": token_class,
                "usd_per_1m_tokens": usd,
            }
            for token_class, usd in (("input", "50"), ("output", "100"))
        ]
    }
    assert replicas.admin[0].put("/prices", json=dearer).status_code == 200
    route = replicas.route_of(0, key, "cheap")
    assert route["candidate"] == "claude-sonnet" and route["reason"] == "cheapest_fit"


def test_a_breaker_opened_on_one_replica_opens_on_the_other(
    replicas: Replicas, fake_openai: FakeOpenAI
) -> None:
    _, key = replicas.key("acme")
    fake_openai.fail_next(500, times=2)
    for _ in range(2):  # two 500s on replica 0, each failed over to claude-sonnet
        assert replicas.route_of(0, key, "shared")["candidate"] == "claude-sonnet"
    status = replicas.admin[0].get("/routes/status").json()
    assert status["breakers"]["openai/gpt-4o-mini"] == "open"
    deadline = time.monotonic() + 5
    while replicas.admin[1].get("/routes/status").json()["breakers"]["openai/gpt-4o-mini"] != "open":
        assert time.monotonic() < deadline, "replica 1 did not adopt the opening"
        time.sleep(0.1)
    # Replica 1 never saw a failure itself, yet skips the backend (through Redis).
    assert replicas.route_of(1, key, "shared")["tried"] == "gpt-4o-mini:open,claude-sonnet:ok"


TIGHT = {
    "name": "tight",
    "ttft_timeout": 0.3,
    "retry": {"attempts": 1},
    "breaker": {"failures": 2, "cooldown": 30},
    "probe_interval": None,
    "candidates": [{"model": "gpt-4o-mini"}, {"model": "claude-sonnet"}],
}


def test_a_deleted_routes_latency_breakers_go_with_it(replicas: Replicas, fake_openai: FakeOpenAI) -> None:
    """`tight` gives gpt-4o-mini 0.3 s to its first token where `auto` waits as long as it takes: its
    timeouts open a latency breaker of its own on the replica that saw them (routes/status
    `latency_breakers`; the shared breaker stays closed, and nothing goes to the other replica).
    Deleted, the route leaves none behind."""
    _, key = replicas.key("acme")
    created = replicas.admin[0].post("/routes", json=TIGHT)
    assert created.status_code == 201, created.text
    fake_openai.set_latency(first_token=0.6)
    for _ in range(2):
        messages: Any = HI
        raw = replicas.client(0, key).chat.completions.with_raw_response.create(
            model="tight", messages=messages, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == "hello routes"
        assert route_header(raw)["tried"] == "gpt-4o-mini:504,claude-sonnet:ok"
    status = replicas.admin[0].get("/routes/status").json()
    assert status["latency_breakers"] == {"tight": {"openai/gpt-4o-mini": "open"}}
    assert status["breakers"]["openai/gpt-4o-mini"] == "closed"
    assert replicas.admin[1].get("/routes/status").json()["latency_breakers"] == {}
    assert replicas.admin[0].delete(f"/routes/{created.json()['id']}").status_code == 204
    assert replicas.admin[0].get("/routes/status").json()["latency_breakers"] == {}


def test_routes_of_one_name_and_conditions_show_their_most_open_latency_breaker(
    replicas: Replicas, fake_openai: FakeOpenAI
) -> None:
    """`tight` opened its latency breaker on gpt-4o-mini; then a route of the same name and
    conditions that waits 0.5 s was put first, and one of its requests timed out too (its own
    breaker: one timeout, still closed). Both have one label in routes/status and /metrics, and both
    now show it open, as the most open of the two: routes/status showed whichever came last, closed."""
    _, key = replicas.key("acme")
    mini = "openai/gpt-4o-mini"
    assert replicas.admin[0].post("/routes", json=TIGHT).status_code == 201
    fake_openai.set_latency(first_token=1.0)

    def timed_out() -> None:
        raw = replicas.client(0, key).chat.completions.with_raw_response.create(
            model="tight", messages=HI, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == "hello routes"
        assert route_header(raw)["tried"] == "gpt-4o-mini:504,claude-sonnet:ok"

    for _ in range(2):
        timed_out()
    patient = {**TIGHT, "ttft_timeout": 0.5, "position": -1}
    assert replicas.admin[0].post("/routes", json=patient).status_code == 201
    timed_out()  # sent to gpt-4o-mini: the 0.5 s route's breaker, not the open one, took the request
    assert replicas.admin[0].get("/routes/status").json()["latency_breakers"]["tight"][mini] == "open"
    gauge = f'weir_route_latency_breaker_state{{breaker="{mini}",route="tight"}} 2.0'
    assert gauge in httpx.get(f"{replicas.urls[0]}/metrics").text.splitlines()


def test_hedged_spend_is_capped_across_replicas(
    replicas: Replicas, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """A hedged claude-sonnet attempt asked for 1,000 tokens is estimated at about $0.015 against the
    route's $0.035 an hour, then counted at what it cost: short answers leave the allowance almost
    whole, so four in a row hedge (the estimates alone would stop the third); one that costs $0.0225
    leaves too little for the next estimate, on the other replica too."""
    _, key = replicas.key("acme")
    fake_openai.set_latency(first_token=0.5)  # slower than the hedge delay: every request would hedge

    def ask(replica: int, api_key: str = key) -> dict[str, str]:
        raw = replicas.client(replica, api_key).chat.completions.with_raw_response.create(
            model="hedged", messages=HI, stream=True, max_tokens=1000
        )
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == "hello routes"
        return route_header(raw)

    routes = [ask(i % 2) for i in range(4)]
    assert [r["candidate"] for r in routes] == ["claude-sonnet"] * 4
    fake_anthropic.set_next_usage(output_tokens=1500)  # $0.0225 at $15 per million
    assert ask(0)["hedged"] == "claude-sonnet"
    route = ask(1)
    assert route["candidate"] == "gpt-4o-mini" and route["hedge"] == "capped"
    _, other = replicas.key("globex")  # another tenant has its own allowance
    assert ask(1, other)["hedged"] == "claude-sonnet"


def test_a_conversation_stays_on_its_replica_across_gateway_replicas(replicas: Replicas) -> None:
    """prefix_affinity remembers where each prompt's prefixes went in Redis: a conversation's next turn, sent to
    the other gateway replica, goes where the previous one did, though its 40-character prefix (the
    reply is in it) hashes elsewhere for some conversations."""
    _, key = replicas.key("acme")
    store = redis.Redis.from_url(REDIS_URL)
    went = {}
    moved = 0
    for i in range(8):
        messages = [{"role": "user", "content": f"Chat {i}: hi"}]
        first = replicas.client(0, key).chat.completions.with_raw_response.create(
            model="sticky", messages=messages
        )  # type: ignore[arg-type]
        went[i] = route_header(first)["candidate"]
        prompt = messages[0]["content"]
        written = replicas.redis_prefix + PREFIX + prefix_keys("sticky", prompt, [len(prompt)])[0].hex()
        deadline = time.monotonic() + 5  # the shared write is off the request's path
        while not store.exists(written):
            assert time.monotonic() < deadline, "the conversation was not written to Redis"
            time.sleep(0.02)
        messages += [
            {"role": "assistant", "content": first.parse().choices[0].message.content or ""},
            {"role": "user", "content": "and then?"},
        ]
        second = replicas.client(1, key).chat.completions.with_raw_response.create(
            model="sticky", messages=messages
        )  # type: ignore[arg-type]
        route = route_header(second)
        assert route["candidate"] == went[i] and route["affinity_by"] == "conversation"
        # Where the hash alone sends it: the same 40-character prefix, in a prompt no one sent before.
        prefix = "\n".join(m["content"] for m in messages)[:40]
        hashed = replicas.route_of(1, key, "sticky", prefix + " (a prompt of its own)")
        moved += hashed["candidate"] != went[i]
    store.close()
    assert len(set(went.values())) == 2 and moved >= 1
    # What the replicas' caches served of the route's prompts (short prompts here: none).
    cache = replicas.admin[1].get("/routes/status").json()["prefix_affinity_cache"]["sticky"]
    assert cache["prompt_tokens"] > 0 and cache["cached_tokens"] == 0 and cache["hit_rate"] == 0.0


def test_the_ledger_keeps_the_routing_decision(replicas: Replicas, fake_openai: FakeOpenAI) -> None:
    tenant_id, key = replicas.key("acme")
    fake_openai.fail_next(500, times=2)
    route = replicas.route_of(0, key)
    assert route["candidate"] == "claude-sonnet" and route["attempts"] == "3"
    deadline = time.monotonic() + 15
    while True:
        rows = sync_exec(
            replicas.db_url,
            f"SELECT attempt, backend, status, route, routing FROM usage_events WHERE tenant_id = '{tenant_id}' "
            "ORDER BY attempt",
        )
        if len(rows) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (1, "openai", 500, "auto"),
        (2, "openai", 500, "auto"),
        (3, "anthropic", 200, "auto"),
    ]
    assert "candidate=claude-sonnet" in rows[2][4] and "policy=fixed" in rows[0][4]


def test_feedback_is_stored_per_tenant(replicas: Replicas) -> None:
    _, key_a = replicas.key("acme")
    _, key_b = replicas.key("globex")
    raw = replicas.client(0, key_a).chat.completions.with_raw_response.create(model="auto", messages=HI)
    request_id = raw.headers["x-request-id"]
    posted = httpx.post(
        f"{replicas.urls[0]}/v1/feedback",
        json={"request_id": request_id, "score": 0.25},
        headers={"authorization": f"Bearer {key_a}"},
    )
    assert posted.status_code == 200 and posted.json()["score"] == 0.25
    read = httpx.get(
        f"{replicas.urls[1]}/v1/feedback/{request_id}", headers={"authorization": f"Bearer {key_a}"}
    )
    assert read.status_code == 200 and read.json()["score"] == 0.25
    other = httpx.get(
        f"{replicas.urls[0]}/v1/feedback/{request_id}", headers={"authorization": f"Bearer {key_b}"}
    )
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"

    # The label's time moves only when the score changes: retraining ranks a re-scored request as one
    # the head in use has not seen, and a re-sent equal score as one it has.
    def send(score: float) -> dict[str, str]:
        response = httpx.post(
            f"{replicas.urls[1]}/v1/feedback",
            json={"request_id": request_id, "score": score},
            headers={"authorization": f"Bearer {key_a}"},
        )
        assert response.status_code == 200
        return response.json()

    first = posted.json()
    assert first["updated_at"] == first["created_at"]
    assert send(0.25)["updated_at"] == first["updated_at"]
    changed = send(0.75)
    assert changed["created_at"] == first["created_at"]
    assert dt.datetime.fromisoformat(changed["updated_at"]) > dt.datetime.fromisoformat(first["updated_at"])
    bad = httpx.post(
        f"{replicas.urls[0]}/v1/feedback",
        json={"request_id": request_id, "score": 7},
        headers={"authorization": f"Bearer {key_a}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "score"


# Trained difficulty heads: the shipped head with its bias moved, so every prompt's route is known.
STRONG_ALWAYS, WEAK_ALWAYS = bundle(forced(8.0)), bundle(forced(-8.0))
ROUTE = {
    "name": "smart",
    "policy": "difficulty",
    "head": "acme",
    "candidates": [{"model": "gpt-4o-mini"}, {"model": "claude-sonnet"}],
    "probe_interval": None,
}


def _put(replicas: Replicas, data: bytes, name: str = "acme", replica: int = 0) -> object:
    return replicas.admin[replica].put(
        f"/difficulty-heads/{name}", content=data, headers={"content-type": "application/octet-stream"}
    )


def test_a_trained_head_routes_on_every_replica_and_is_swapped_without_a_restart(replicas: Replicas) -> None:
    tenant_id, key = replicas.key("acme")
    admin = replicas.admin[0]

    # Bad input is refused and changes nothing.
    refused = _put(replicas, b"GIF89a not a head at all")
    assert refused.status_code == 400, refused.text  # type: ignore[attr-defined]
    assert refused.json()["error"]["param"] == "body"  # type: ignore[attr-defined]
    bad_name = _put(replicas, STRONG_ALWAYS, name="-acme")
    assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "name"  # type: ignore[attr-defined]
    assert admin.get("/difficulty-heads").json()["data"] == []
    missing = admin.post("/routes", json=ROUTE)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "head", missing.text
    fixed = admin.post("/routes", json={**ROUTE, "policy": "fixed"})
    assert fixed.status_code == 400 and "only the difficulty policy" in fixed.json()["error"]["message"]

    created = _put(replicas, STRONG_ALWAYS)
    assert created.status_code == 201, created.text  # type: ignore[attr-defined]
    first = digest(STRONG_ALWAYS)
    assert created.json()["digest"] == first  # type: ignore[attr-defined]
    route = admin.post("/routes", json=ROUTE)
    assert route.status_code == 201, route.text

    def routed(replica: int, prompt: str = "hello routes") -> dict[str, str]:
        raw = replicas.client(replica, key).chat.completions.with_raw_response.create(
            model="smart", messages=[{"role": "user", "content": prompt}]
        )
        return route_header(raw)

    def serves(replica: int, label: str) -> bool:
        try:
            return routed(replica).get("head") == label
        except openai.NotFoundError:  # the route has not reached this replica yet
            return False

    # Both replicas: the route arrives within a poll, the head loads, and routes every prompt strong.
    for replica in (0, 1):
        wait_for(lambda r=replica: serves(r, f"acme@{first[:12]}"), timeout=30)
        header = routed(replica, "What is 2 + 2?")
        assert header["candidate"] == "claude-sonnet" and header["reason"] == "hard", header
    shown = admin.get("/difficulty-heads/acme").json()
    assert shown["routes"] == [route.json()["id"]] and shown["loaded_here"] is True
    assert shown["meta"]["source"] == "test head, bias 8.0"
    assert admin.get("/difficulty-heads/acme/bundle").content == STRONG_ALWAYS
    status = admin.get("/routes/status").json()
    assert status["difficulty_heads"] == {"acme": f"acme@{first[:12]}"}

    # A head in use cannot be deleted.
    in_use = admin.delete("/difficulty-heads/acme")
    assert in_use.status_code == 409 and "in use by routes" in in_use.json()["error"]["message"]

    # Replaced under the same name through the other replica: both swap to it, no restart.
    replaced = _put(replicas, WEAK_ALWAYS, replica=1)
    assert replaced.status_code == 200, replaced.text  # type: ignore[attr-defined]
    second = digest(WEAK_ALWAYS)
    for replica in (0, 1):
        wait_for(lambda r=replica: serves(r, f"acme@{second[:12]}"), timeout=30)
        assert routed(replica, "Prove the Riemann hypothesis.")["candidate"] == "gpt-4o-mini"

    # The ledger keeps which head (and which version of it) routed each request.
    def ledger() -> list[str]:
        rows = sync_exec(
            replicas.db_url, f"SELECT routing FROM usage_events WHERE tenant_id = '{tenant_id}' ORDER BY ts"
        )
        return [r[0] for r in rows]

    wait_for(lambda: any(f"head=acme@{second[:12]}" in r for r in ledger()), timeout=30)
    assert any(f"head=acme@{first[:12]}" in r for r in ledger())

    # Audit: who uploaded, replaced; the bytes themselves are not copied into the log.
    audit = [e for e in admin.get("/audit").json()["data"] if e["entity"] == "difficulty_head"]
    assert sorted(e["action"] for e in audit) == ["create", "update"]
    assert all("bundle" not in (e["after"] or {}) for e in audit)

    # Once no route names it, it can go.
    assert admin.delete(f"/routes/{route.json()['id']}").status_code == 204
    assert admin.delete("/difficulty-heads/acme").status_code == 204
    assert admin.get("/difficulty-heads/acme").status_code == 404
