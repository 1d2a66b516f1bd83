"""Route selection and propagation pushed where the other routing tests do not go: what each inbound
API shape (chat completions, the Anthropic Messages API, the Responses API) feeds the prompt-length
condition, which route names /v1/models offers a tenant, routes edited on a replica whose clock is
behind, and the admin DB's routes across a restart with a config that no longer has all their models.
Real gateways in front of the fake vendors; the official openai and anthropic SDKs as clients."""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fixtures.db import REDIS_URL, fresh_pg_database
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway
from tests.routing.routed import route_header

ROUTES = """\
routes:
  - {name: sized, when: {max_prompt_tokens: 2000}, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: sized, candidates: [{model: claude-sonnet}], probe_interval: null}
  - {name: for-demo, when: {tenants: [demo]}, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: for-others, when: {tenants: [someone-else]}, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: for-a-key, when: {keys: [key_000000000000]}, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: with-tools, when: {tools: true}, candidates: [{model: gpt-4o-mini}], probe_interval: null}
"""
BIG = "lorem ipsum dolor " * 700  # 12,600 characters: about 3,150 tokens at 4 characters a token
ARGUMENTS = json.dumps({"text": BIG})
SMALL_ROUTE, BIG_ROUTE = "gpt-4o-mini", "claude-sonnet"


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return ROUTES


# --- prompt length: every part of the prompt a vendor bills as input counts ---------------------------


def _chat_candidate(gateway: RunningGateway, **kwargs: Any) -> str:
    raw = gateway.openai().chat.completions.with_raw_response.create(model="sized", **kwargs)
    raw.parse()
    return route_header(raw)["candidate"]


def _messages_candidate(gateway: RunningGateway, **kwargs: Any) -> str:
    raw = gateway.anthropic().messages.with_raw_response.create(model="sized", max_tokens=32, **kwargs)
    raw.parse()
    return route_header(raw)["candidate"]


def test_prompt_length_counts_tool_calls_and_tool_definitions_on_chat(gateway: RunningGateway) -> None:
    """A conversation whose bulk is an earlier tool call's arguments, or a request whose bulk is its tool
    definitions, is long: the vendor bills both as input, and a `max_prompt_tokens` route for a small
    context window must not take it (it was counted as a few tokens)."""
    hi = [{"role": "user", "content": "hi"}]
    assert _chat_candidate(gateway, messages=hi) == SMALL_ROUTE
    history = [
        {"role": "user", "content": "write the file"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "write", "arguments": ARGUMENTS}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "user", "content": "thanks"},
    ]
    assert _chat_candidate(gateway, messages=history) == BIG_ROUTE
    tool = {"type": "function", "function": {"name": "lookup", "description": BIG, "parameters": {}}}
    assert _chat_candidate(gateway, messages=hi, tools=[tool]) == BIG_ROUTE


def test_prompt_length_counts_tool_use_blocks_and_tools_on_the_messages_api(gateway: RunningGateway) -> None:
    assert _messages_candidate(gateway, messages=[{"role": "user", "content": "hi"}]) == SMALL_ROUTE
    history: Any = [
        {"role": "user", "content": "write the file"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "write", "input": {"text": BIG}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"},
                {"type": "text", "text": "thanks"},
            ],
        },
    ]
    tool: Any = {"name": "write", "input_schema": {"type": "object"}}
    assert _messages_candidate(gateway, messages=history, tools=[tool]) == BIG_ROUTE
    big_tool: Any = {"name": "lookup", "description": BIG, "input_schema": {"type": "object"}}
    hi: Any = [{"role": "user", "content": "hi"}]
    assert _messages_candidate(gateway, messages=hi, tools=[big_tool]) == BIG_ROUTE
    # The system prompt is part of the prompt too, as blocks or as a string.
    assert _messages_candidate(gateway, messages=hi, system=[{"type": "text", "text": BIG}]) == BIG_ROUTE


def test_prompt_length_counts_images_as_the_gateways_estimate_does(gateway: RunningGateway) -> None:
    """Images are billed as input (`estimate.prompt_tokens` counts each INLINE_PART_TOKENS, sent by
    URL or inline): two are past the small route's 2,000 tokens. The prompt length ignored them, and
    a short question with images took a route for a small context window."""
    url = "https://example.com/photos/a-cat-on-a-mat.jpg"
    inline = "data:image/png;base64," + base64.b64encode(bytes(6000)).decode()  # 8 kB: counted 1,600
    for image in (url, inline):
        one: Any = [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": image}},
        ]
        assert _chat_candidate(gateway, messages=[{"role": "user", "content": one}]) == SMALL_ROUTE
        two = [*one, {"type": "image_url", "image_url": {"url": image}}]
        assert _chat_candidate(gateway, messages=[{"role": "user", "content": two}]) == BIG_ROUTE
    block: Any = {"type": "image", "source": {"type": "url", "url": url}}
    text: Any = {"type": "text", "text": "what is this?"}
    assert _messages_candidate(gateway, messages=[{"role": "user", "content": [block, text]}]) == SMALL_ROUTE
    two_blocks: Any = [{"role": "user", "content": [block, block, text]}]
    assert _messages_candidate(gateway, messages=two_blocks) == BIG_ROUTE


def test_prompt_length_counts_function_call_items_on_the_responses_api(gateway: RunningGateway) -> None:
    items: Any = [
        {"role": "user", "content": "write the file"},
        {"type": "function_call", "call_id": "call_1", "name": "write", "arguments": ARGUMENTS},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        {"role": "user", "content": "thanks"},
    ]
    raw = gateway.openai().responses.with_raw_response.create(model="sized", input=items)
    raw.parse()
    assert route_header(raw)["candidate"] == BIG_ROUTE


# --- /v1/models: a route name is offered to the tenants that can use it -----------------------------


def test_models_lists_only_the_routes_a_tenant_and_key_can_use(gateway: RunningGateway) -> None:
    """A route limited to other tenants (or other keys) answers this tenant 404 model_not_found, exactly
    like a model that does not exist: /v1/models must not offer it to an app's model picker, nor say
    it exists when asked by name (which also told every tenant the names of the others' routes)."""
    listed = {m.id for m in gateway.openai().models.list()}
    assert {"sized", "for-demo", "with-tools"} <= listed  # routes some request of this tenant meets
    assert "for-others" not in listed and "for-a-key" not in listed
    for name in ("for-others", "for-a-key"):
        with pytest.raises(openai.NotFoundError):
            gateway.openai().models.retrieve(name)
        with pytest.raises(openai.NotFoundError):  # what using it answers, as before
            gateway.openai().chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    assert gateway.openai().models.retrieve("for-demo").owned_by == "weir"
    anthropic_listed = {m.id for m in gateway.anthropic().models.list()}
    assert "for-demo" in anthropic_listed and "for-others" not in anthropic_listed


# --- the admin DB: edits on every replica, and across restarts ---------------------------------------

ADMIN = "admin-token-for-route-selection-edges"
DB_CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
  - {name: anthropic, type: anthropic, base_url: "${ANTHROPIC_BASE_URL}", api_key: "${ANTHROPIC_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
  - {name: claude-sonnet, backend: anthropic, model: claude-sonnet-4-5, price: {input: 3.0, output: 15.0}}
EXTRA_MODEL
tenants:
  - {name: demo, api_keys: ["${WEIR_DEMO_KEY}"]}
database_url: "${DB_URL}"
routes:
  - {name: auto, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: other, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: legacy, candidates: [{model: gpt-4o-mini}], probe_interval: null}
"""
WITH_GPT5 = "  - {name: gpt-5, backend: openai}"


@pytest.fixture
def database() -> Iterator[str]:
    with fresh_pg_database("weir_route_edges") as url:
        yield url


class Gateways:
    """Gateway replicas on one admin DB (and one Redis namespace), started and stopped at will."""

    def __init__(
        self, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: ExitStack
    ) -> None:
        self.env, self.tmp_path, self.monkeypatch, self.stack = env, tmp_path, monkeypatch, stack
        self.started = 0

    def start(self, extra_model: str = WITH_GPT5) -> tuple[ExitStack, str]:
        self.started += 1
        self.monkeypatch.setenv("WEIR_USAGE_SPOOL", str(self.tmp_path / f"spool{self.started}"))
        config = parse_config(DB_CONFIG.replace("EXTRA_MODEL", extra_model), self.env)
        own = ExitStack()
        url = own.enter_context(serve(create_app(config), free_port()))
        self.stack.callback(own.close)
        return own, url


@pytest.fixture
def gateways(
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    database: str,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Gateways]:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    monkeypatch.delenv("WEIR_DATABASE_URL", raising=False)
    env = {
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "ANTHROPIC_BASE_URL": fake_anthropic.base_url,
        "ANTHROPIC_API_KEY": fake_anthropic.api_key,
        "DB_URL": database,
        "WEIR_DEMO_KEY": DEMO_KEY,
    }
    with ExitStack() as stack:
        yield Gateways(env, tmp_path, monkeypatch, stack)


def _admin(url: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"}, timeout=20
    )


def _candidate(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=DEMO_KEY, max_retries=0, timeout=20)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hello"}]
    )
    raw.parse()
    return route_header(raw)["candidate"]


def _routes(url: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in _admin(url).get("/routes").json()["data"]}


def _edit(url: str, route: dict[str, Any], **changes: Any) -> None:
    body = {k: v for k, v in route.items() if k not in ("id", "updated_at")} | changes
    response = _admin(url).put(f"/routes/{route['id']}", json=body)
    assert response.status_code == 200, response.text


def _eventually(check: Any, seconds: float = 6.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return bool(check())


@pytest.mark.postgres
@pytest.mark.redis
def test_an_edit_on_a_replica_whose_clock_is_behind_reaches_the_others(
    gateways: Gateways, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas (and the `weir router train --install` job) stamp their edits with their own clocks.
    Replicas poll a signature of the table that moved with the latest stamp only: an edit stamped
    before the latest one (a clock a little behind, a wall clock stepped back) left the table's
    signature as it was, and the other replicas served the route as it was before the edit, for good."""
    _, first = gateways.start()
    _, second = gateways.start()
    routes = _routes(first)
    _edit(first, routes["auto"], candidates=[{"model": "claude-sonnet"}])
    assert _eventually(lambda: _candidate(second, "auto") == "claude-sonnet")

    behind = dt.timedelta(seconds=30)
    monkeypatch.setattr("gateway.admin.routes.utcnow", lambda: dt.datetime.now(dt.UTC) - behind)
    _edit(second, routes["other"], candidates=[{"model": "claude-sonnet"}])  # on the replica behind
    assert _candidate(second, "other") == "claude-sonnet"  # where it was edited: at once
    assert _eventually(lambda: _candidate(first, "other") == "claude-sonnet"), (
        "the edit never reached the other replica"
    )


@pytest.mark.postgres
@pytest.mark.redis
def test_admin_edits_survive_a_restart_whose_config_dropped_a_model(gateways: Gateways) -> None:
    """After the first start the admin DB's routes are the source of truth. A restart with a config
    that no longer has a model one stored route names used to reject the whole table and serve the
    config's `routes:` seed instead: the routes an admin had deleted came back and every edit was
    reverted. Now the routes that still validate are served, and the one that does not is left out,
    named in routes/status. Every later load is the same, so edits still reach that replica (they did
    not: every later load refused the whole table for the row left out, and kept the first one's)."""
    gateway, url = gateways.start()
    routes = _routes(url)
    _edit(url, routes["auto"], candidates=[{"model": "claude-sonnet"}])
    assert _admin(url).delete(f"/routes/{routes['legacy']['id']}").status_code == 204
    created = _admin(url).post("/routes", json={"name": "newer", "candidates": [{"model": "gpt-5"}]})
    assert created.status_code == 201, created.text
    assert _candidate(url, "auto") == "claude-sonnet"
    gateway.close()

    _, url = gateways.start(extra_model="")  # gpt-5 is gone from the config
    assert _candidate(url, "auto") == "claude-sonnet"  # the admin's edit, not the seed
    with pytest.raises(openai.NotFoundError):
        _candidate(url, "legacy")  # deleted stays deleted
    with pytest.raises(openai.NotFoundError):
        _candidate(url, "newer")  # its model is gone: left out, the rest served
    assert _candidate(url, "other") == "gpt-4o-mini"
    # The admin API still lists every stored row, so the one left out can be fixed or deleted.
    routes = _routes(url)
    assert set(routes) == {"auto", "other", "newer"}
    status = _admin(url).get("/routes/status").json()
    assert [(r["id"], r["name"]) for r in status["left_out"]] == [(routes["newer"]["id"], "newer")]
    assert "gpt-5" in status["left_out"][0]["error"] and status["routes_rejected"] is None
    _edit(url, routes["auto"], candidates=[{"model": "gpt-4o-mini"}])
    assert _candidate(url, "auto") == "gpt-4o-mini"
    _edit(url, routes["newer"], candidates=[{"model": "claude-sonnet"}])  # fixed: served again
    assert _candidate(url, "newer") == "claude-sonnet"
    assert _admin(url).get("/routes/status").json()["left_out"] == []
