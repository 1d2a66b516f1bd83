"""The difficulty policy in the request path, pushed as a hostile client would: what text the classifier
scores for every inbound shape (OpenAI chat with content parts, tools and images; Anthropic messages
with system blocks and tool results; the Responses API; legacy completions), whether a head trained
from `POST /v1/feedback` learns from the very text the route scored, whether scoring holds up other
requests, and feedback under concurrent writes, bad scores and other tenants.

One gateway with the control plane on a fresh PostgreSQL database, the fake vendors behind it, the
official `openai` and `anthropic` SDKs as clients, and a stand-in scorer that records what it read."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from gateway.db.session import create_engine, sessionmaker
from routing.feedback import FeedbackReport, load_feedback
from routing.train import Outcomes
from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fakes.plugin import FakeVendors
from tests.fixtures.db import fresh_pg_database, sync_exec
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.vendor_gateway import fakes_env, full_config_text
from tests.routing.routed import route_header

ADMIN = "admin-token-for-the-difficulty-request-path"
WEAK, STRONG = "gpt-4o-mini", "gpt-5"
ROUTES = f"""\
routes:
  - {{name: smart, policy: difficulty, threshold: 0.5, candidates: [{{model: {WEAK}}}, {{model: {STRONG}}}], probe_interval: null}}
  - {{name: plain, candidates: [{{model: {WEAK}}}], probe_interval: null}}
"""
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


class Scorer:
    """A stand-in for the classifier: records each prompt it reads; "HARD" ones go strong. A prompt
    saying BLOCK waits (in the scoring thread) until `release` is set."""

    def __init__(self) -> None:
        self.scored: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, prompt: str) -> float:
        self.scored.append(prompt)
        if "BLOCK" in prompt:
            self.entered.set()
            self.release.wait(15)
        return 0.9 if "HARD" in prompt else 0.1


class Weir:
    def __init__(self, url: str, db_url: str, scorer: Scorer) -> None:
        self.url = url
        self.db_url = db_url
        self.scorer = scorer
        self.admin = httpx.Client(
            base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"}, timeout=20
        )

    def tenant(self, name: str, store_prompts: bool = False) -> tuple[str, str, str]:
        """A new tenant: its name, id and an API key."""
        name = f"{name}-{uuid.uuid4().hex[:6]}"
        tenant = self.admin.post("/tenants", json={"name": name, "store_prompts": store_prompts})
        assert tenant.status_code == 201, tenant.text
        key = self.admin.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "app"})
        assert key.status_code == 201, key.text
        return name, tenant.json()["id"], str(key.json()["key"])

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=20)

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=20)

    def feedback(self, key: str, body: Any) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/feedback", json=body, headers={"authorization": f"Bearer {key}"}, timeout=20
        )


@contextmanager
def _running(db_url: str, env: dict[str, str], spool: Path) -> Iterator[Weir]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
        patch.setenv("WEIR_USAGE_SPOOL", str(spool))
        for var in ("WEIR_REDIS_URL", "WEIR_DATABASE_URL", "WEIR_MASTER_KEY"):
            patch.delenv(var, raising=False)
        app = create_app(parse_config(full_config_text() + f'database_url: "{db_url}"\n' + ROUTES, env))
        scorer = Scorer()
        app.state.gateway.router.context.scorer = scorer  # type: ignore[attr-defined]
        with serve(app, free_port()) as base:
            yield Weir(base, db_url, scorer)


@pytest.fixture(scope="module")
def _weir(
    fake_vendors: FakeVendors,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Weir]:
    """The gateway on a fresh PostgreSQL database."""
    env = fakes_env(*fake_vendors)
    with (
        fresh_pg_database("weir_difficulty_path") as url,
        _running(url, env, tmp_path_factory.mktemp("spool")) as weir,
    ):
        yield weir


@pytest.fixture
def weir(_weir: Weir, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic) -> Weir:
    _weir.scorer.scored.clear()
    return _weir


def _scored(weir: Weir, send: Any) -> tuple[str, dict[str, str]]:
    """The one prompt the route's classifier read for the request `send` makes, and its route header."""
    weir.scorer.scored.clear()
    raw = send()
    assert len(weir.scorer.scored) == 1, weir.scorer.scored
    return weir.scorer.scored[0], route_header(raw)


def _chat_shapes(client: openai.OpenAI) -> list[tuple[str, Any, str]]:
    """(what, send, the text the route should score): OpenAI chat and legacy completions."""
    create = client.chat.completions.with_raw_response.create
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    completions = client.completions.with_raw_response.create
    return [
        (
            "text parts around an image",
            lambda: create(
                model="smart",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is"},
                            image,
                            {"type": "text", "text": "2+2?"},
                        ],
                    }
                ],
            ),
            "What is\n2+2?",  # as routing.difficulty.prompt_text (the CLI, training) reads the turn
        ),
        (
            "an image alone in the last user turn",
            lambda: create(
                model="smart",
                messages=[
                    {"role": "user", "content": "HARD earlier question"},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": [image]},
                ],
            ),
            "",
        ),
        (
            "system and developer messages around the user turn",
            lambda: create(
                model="smart",
                messages=[
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "HARD question"},
                    {"role": "developer", "content": "Answer in French."},
                ],
            ),
            "HARD question",
        ),
        (
            "a tool loop: assistant tool_calls with null content, then the tool's result",
            lambda: create(
                model="smart",
                tools=TOOLS,
                messages=[
                    {"role": "user", "content": "weather in Oslo?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "HARD rain, 4 degrees"},
                ],
            ),
            "weather in Oslo?",
        ),
        ("an empty user turn", lambda: create(model="smart", messages=[{"role": "user", "content": ""}]), ""),
        ("a completions prompt", lambda: completions(model="smart", prompt="HARD once"), "HARD once"),
        (
            "a list of completions prompts",
            lambda: completions(model="smart", prompt=["one", "two"]),
            "one\ntwo",
        ),
        ("completions token ids", lambda: completions(model="smart", prompt=[[1, 2, 3]]), ""),
    ]


@pytest.mark.postgres
def test_every_openai_shape_scores_its_last_user_turn(weir: Weir) -> None:
    _, _, key = weir.tenant("shapes")
    for what, send, expected in _chat_shapes(weir.openai(key)):
        text, header = _scored(weir, send)
        assert text == expected, what
        assert header["policy"] == "difficulty" and float(header["score"]) in (0.1, 0.9), what
        assert header["candidate"] == (STRONG if "HARD" in expected else WEAK), what


def _responses_and_anthropic(weir: Weir, key: str, tag: str = "") -> list[tuple[str, Any, str]]:
    """(request id, send, the text the route should score) through the Responses API and Anthropic's
    Messages API; every request id is new."""
    client = weir.openai(key)
    claude = weir.anthropic(key)

    def rid(name: str) -> str:
        return f"{name}-{tag}{uuid.uuid4().hex[:8]}"

    ids = [rid(n) for n in ("resp-str", "resp-items", "claude-tool", "claude-parts", "chat-parts")]
    tool_use: Any = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}
    tool_result: Any = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain, 4 degrees"}
    claude_tools: Any = [{"name": "weather", "input_schema": {"type": "object"}}]
    return [
        (
            ids[0],
            lambda: client.responses.with_raw_response.create(
                model="smart",
                instructions="Be brief.",
                input="HARD question through the Responses API",
                extra_headers={"x-request-id": ids[0]},
            ),
            "HARD question through the Responses API",
        ),
        (
            ids[1],
            lambda: client.responses.with_raw_response.create(
                model="smart",
                input=[
                    {"role": "developer", "content": "Answer in one line."},
                    {"role": "user", "content": "an earlier question"},
                    {"role": "assistant", "content": "an earlier answer"},
                    {
                        "type": "message",
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "first part"},
                            {"type": "input_text", "text": "second part"},
                        ],
                    },
                ],
                extra_headers={"x-request-id": ids[1]},
            ),
            "first part\nsecond part",
        ),
        (
            ids[2],
            lambda: claude.messages.with_raw_response.create(
                model="smart",
                max_tokens=32,
                system=[{"type": "text", "text": "You are terse."}],
                tools=claude_tools,
                messages=[
                    {"role": "user", "content": "HARD weather question for Oslo"},
                    {"role": "assistant", "content": [tool_use]},
                    {"role": "user", "content": [tool_result]},
                ],
                extra_headers={"x-request-id": ids[2]},
            ),
            "HARD weather question for Oslo",  # the tool result is no user turn (a tool message upstream)
        ),
        (
            ids[3],
            lambda: claude.messages.with_raw_response.create(
                model="smart",
                max_tokens=32,
                system="You are terse.",
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "alpha"}, {"type": "text", "text": "beta"}],
                    }
                ],
                extra_headers={"x-request-id": ids[3]},
            ),
            "alpha\nbeta",
        ),
        (
            ids[4],
            lambda: client.chat.completions.with_raw_response.create(
                model="smart",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "HARD gamma"},
                            {"type": "text", "text": "delta"},
                        ],
                    }
                ],
                extra_headers={"x-request-id": ids[4]},
            ),
            "HARD gamma\ndelta",
        ),
    ]


def _load(weir: Weir, tenant: str) -> tuple[Outcomes, FeedbackReport]:
    async def run() -> tuple[Outcomes, FeedbackReport]:
        engine = create_engine(weir.db_url)
        try:
            return await load_feedback(sessionmaker(engine), tenant, WEAK, STRONG)
        finally:
            await engine.dispose()

    return asyncio.run(run())


@pytest.mark.postgres
def test_a_head_trained_from_feedback_learns_the_text_each_inbound_api_was_routed_by(weir: Weir) -> None:
    """`weir router train --tenant` reads what the tenant asked from its stored request bodies. For
    every inbound API that text must be the one the route scored: a Responses API request or an
    Anthropic tool loop whose feedback is skipped, or read as another text, teaches the head nothing
    or the wrong thing. And only this tenant's feedback counts (on PostgreSQL, like production)."""
    name, tenant_id, key = weir.tenant("learns", store_prompts=True)
    _, _, other_key = weir.tenant("other", store_prompts=True)
    expected: dict[str, str] = {}
    for request_id, send, text in _responses_and_anthropic(weir, key):
        scored, header = _scored(weir, send)
        assert scored == text, request_id
        assert header["candidate"] == (STRONG if "HARD" in text else WEAK), request_id
        expected[request_id] = scored
        assert weir.feedback(key, {"request_id": request_id, "score": 1.0}).status_code == 200
        # Another tenant scoring the same request ids, and asking something of its own: none of it is
        # this tenant's training data.
        assert weir.feedback(other_key, {"request_id": request_id, "score": 0.0}).status_code == 200
    other_id = f"other-{uuid.uuid4().hex[:8]}"
    weir.openai(other_key).chat.completions.create(
        model="smart",
        messages=[{"role": "user", "content": "HARD other"}],
        extra_headers={"x-request-id": other_id},
    )
    assert weir.feedback(other_key, {"request_id": other_id, "score": 1.0}).status_code == 200

    # The ledger says where each went and why (what training reads to know which model answered).
    deadline = time.monotonic() + 30
    while True:
        data, report = _load(weir, name)
        if sum(report.used.values()) == len(expected) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert report.tenant_id == tenant_id and report.feedback == len(expected), report.summary()
    assert report.skipped == {}, report.summary()
    assert sorted(data.prompts) == sorted(expected.values())
    rows = sync_exec(
        weir.db_url,
        f"SELECT request_id, routing FROM usage_events WHERE tenant_id = '{tenant_id}' AND status = 200",
    )
    routed = dict(rows)
    for request_id, text in expected.items():
        assert "policy=difficulty" in routed[request_id] and "score=" in routed[request_id]
        assert f"candidate={STRONG if 'HARD' in text else WEAK}" in routed[request_id]


@pytest.mark.postgres
def test_scoring_runs_off_the_event_loop(weir: Weir) -> None:
    """While one request's prompt is being scored (held in the scorer here), others are served."""
    _, _, key = weir.tenant("loop")
    client = weir.openai(key)
    done: list[Any] = []

    def slow() -> None:
        done.append(
            client.chat.completions.create(
                model="smart", messages=[{"role": "user", "content": "BLOCK HARD"}]
            )
        )

    worker = threading.Thread(target=slow)
    worker.start()
    try:
        assert weir.scorer.entered.wait(10)
        started = time.monotonic()
        reply = client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content and time.monotonic() - started < 5
        assert not done  # the scored request is still held
    finally:
        weir.scorer.release.set()
        worker.join(20)
    assert done and done[0].model


def _race(weir: Weir) -> None:
    """A client retrying `POST /v1/feedback` while its first try is in flight (or several workers
    scoring one request) race to create the same row; each must get a 200, and one row holds the
    request's score."""
    _, tenant_id, key = weir.tenant("race")
    scores = [round(0.1 * i, 1) for i in range(8)]
    for round_ in range(4):
        request_id = f"race-{round_}-{uuid.uuid4().hex[:8]}"
        barrier = threading.Barrier(len(scores))

        def post(
            score: float, request_id: str = request_id, barrier: threading.Barrier = barrier
        ) -> httpx.Response:
            barrier.wait(10)
            return weir.feedback(key, {"request_id": request_id, "score": score})

        with ThreadPoolExecutor(len(scores)) as pool:
            responses = list(pool.map(post, scores))
        assert [r.status_code for r in responses] == [200] * len(scores), [r.text for r in responses]
        rows = sync_exec(
            weir.db_url,
            f"SELECT score FROM feedback WHERE tenant_id = '{tenant_id}' AND request_id = '{request_id}'",
        )
        assert len(rows) == 1 and rows[0][0] in scores
        read = httpx.get(f"{weir.url}/v1/feedback/{request_id}", headers={"authorization": f"Bearer {key}"})
        assert read.status_code == 200 and read.json()["score"] == rows[0][0]


@pytest.mark.postgres
def test_concurrent_feedback_on_one_request_is_stored_once_without_a_500(weir: Weir) -> None:
    _race(weir)


def test_concurrent_feedback_on_sqlite_too(
    fake_vendors: FakeVendors,
    tmp_path: Path,
) -> None:
    env = fakes_env(*fake_vendors)
    with _running(f"sqlite+aiosqlite:///{tmp_path}/weir.db", env, tmp_path / "spool") as weir:
        _race(weir)


@pytest.mark.postgres
def test_bad_feedback_is_a_400_in_the_openai_shape_and_stores_nothing(weir: Weir) -> None:
    _, tenant_id, key = weir.tenant("bad")
    request_id = f"bad-{uuid.uuid4().hex[:8]}"
    bodies: list[tuple[Any, str | None]] = [
        ({"request_id": request_id, "score": True}, "score"),
        ({"request_id": request_id, "score": "0.5"}, "score"),
        ({"request_id": request_id, "score": None}, "score"),
        ({"request_id": request_id, "score": -0.01}, "score"),
        ({"request_id": request_id, "score": 1.5}, "score"),
        ({"request_id": request_id}, "score"),
        ({"score": 0.5}, "request_id"),
        ({"request_id": 7, "score": 0.5}, "request_id"),
        ({"request_id": "", "score": 0.5}, "request_id"),
        ({"request_id": request_id, "score": 0.5, "extra": 1}, None),
        ([{"request_id": request_id, "score": 0.5}], None),
    ]
    for body, param in bodies:
        response = weir.feedback(key, body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], body
        assert error["type"] == "invalid_request_error", body
        if param is not None:
            assert error["param"] == param, (body, error)
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    for raw in (b'{"request_id": "%s", "score": NaN}', b'{"request_id": "%s", "score": 1e999}', b"not json"):
        response = httpx.post(
            f"{weir.url}/v1/feedback", content=raw.replace(b"%s", request_id.encode()), headers=auth
        )
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error", (
            raw
        )
    for headers in ({}, {"authorization": "Bearer sk-not-a-key"}, {"authorization": f"Basic {key}"}):
        response = httpx.post(
            f"{weir.url}/v1/feedback", json={"request_id": request_id, "score": 0.5}, headers=headers
        )
        assert response.status_code == 401, (headers, response.text)
        assert set(response.json()["error"]) >= {"message", "type", "code"}
    assert sync_exec(weir.db_url, f"SELECT count(*) FROM feedback WHERE tenant_id = '{tenant_id}'") == [(0,)]
