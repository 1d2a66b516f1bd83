"""Edges of comparisons and retraining: judges and candidates that fail or answer oddly, requests that
must not be compared, bursts against `max_in_flight`, training rows that are ambiguous, rows of one
kind, heads whose metadata strict JSON cannot hold, bundles that are not heads, and a route edited
while `weir router train --install` trained its head."""

from __future__ import annotations

import asyncio
import json
import math
import random
import struct
import time
from dataclasses import asdict
from pathlib import Path

import click
import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from gateway.auth import Principal
from gateway.db.models import (
    AuditLog,
    Base,
    Comparison,
    DifficultyHeadRow,
    Feedback,
    RouteRow,
    StoredPrompt,
    Tenant,
)
from gateway.db.session import create_engine as create_async_engine
from gateway.db.session import sessionmaker
from gateway.pipeline import Call, RequestInfo
from routing.cli import _promote
from routing.compare import Comparer, Job, parse_verdict, scaled
from routing.difficulty import DEFAULT_HEAD_DIR, DifficultyClassifier, DifficultyHead, encode
from routing.feedback import TenantRoute, load_feedback
from routing.heads import BUNDLE_KEY, bundle, put_head, stored_bundle, unbundle
from routing.plan import Choice, Plan
from routing.routes import Candidate, Compare, Route
from routing.train import HoldoutResult, Outcomes, TrainConfig, fit_head, holdout_check
from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fixtures.db import sync_exec
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.waiting import wait_for
from tests.routing.comparing import comparing_app, prompt_keeper
from tests.routing.forced_heads import forced
from tests.routing.routed import counted_micro_usd
from tests.routing.training_db import (
    DIFFICULTY,
    NOW,
    STRONG,
    WEAK,
    audit_rows,
    ledger_row,
    reached_route,
    route_head,
    set_routes,
)

# --- the judge's verdict ----------------------------------------------------------------------


def test_the_verdict_is_the_json_object_not_the_prose_after_it() -> None:
    # Judges often explain after the JSON; numbers there are not grades. Read as grades, "B: 7 of
    # the steps" made an unacceptable answer acceptable: a wrong training label.
    assert parse_verdict('{"A": 9, "B": 2}\nB: 7 of the 10 steps are missing.') == (9.0, 2.0)
    assert parse_verdict('{"A": 3, "B": 8}\n\nWhy: A: 6 facts are wrong, B = 1 slip.') == (3.0, 8.0)
    assert parse_verdict('```json\n{"grades": {"A": 6.5, "B": 10}}\n```') == (6.5, 10.0)
    # A JSON verdict off the scale, or not numbers, is no verdict, whatever the prose says.
    assert parse_verdict('{"A": 12, "B": 3} so A: 7, B: 3') is None
    assert parse_verdict('{"A": "good", "B": true}') is None
    assert parse_verdict('{"A": NaN, "B": 3}') is None
    # Refusals, one grade, nothing: no verdict; nesting too deep to read is no verdict either.
    assert parse_verdict("I won't grade these: both A and B are acceptable.") is None
    assert parse_verdict('{"A": 7} and B is fine') is None
    assert parse_verdict("") is None
    assert parse_verdict("{" * 5000 + '"A": 7, "B": 3') == (7.0, 3.0)  # no JSON: the plain grades


# --- failures and skips, end to end -----------------------------------------------------------

CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
  - {name: ds, type: openai, base_url: "${DS_BASE_URL}", api_key: "${DS_API_KEY}"}
  - {name: anthropic, type: anthropic, base_url: "${ANTHROPIC_BASE_URL}", api_key: "${ANTHROPIC_API_KEY}"}
models:
  - {name: weak, backend: openai, model: gpt-4o-mini, price: {input: 0.15, output: 0.6}}
  - {name: strong, backend: ds, model: deepseek-chat, price: {input: 2.5, output: 10}}
  - {name: grader, backend: anthropic, model: claude-sonnet-4-5, price: {input: 3, output: 15}}
database_url: "${DB_URL}"
routes:
  - name: once
    policy: difficulty
    candidates: [{model: weak}, {model: strong}]
    probe_interval: null
    compare: {judge: grader, share: 1.0, both_orders: false}
  - name: twice
    policy: difficulty
    candidates: [{model: weak}, {model: strong}]
    probe_interval: null
    compare: {judge: grader, share: 1.0}
"""


def judge(text: str) -> str:
    if "refuse" in text:
        return "I cannot grade these answers."
    if "explain" in text:  # the weak model's answer is A (WeakFirst), and only it is acceptable
        return '{"A": 9, "B": 2}\nB: 7 of the 10 steps are missing.'
    return '{"A": 8, "B": 8}'


class WeakFirst(random.Random):
    def random(self) -> float:
        return 0.25  # the judge reads the weak model's answer as A


def test_failed_and_unreadable_comparisons_store_nothing_and_count_their_spend(
    sqlite_url: str,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_anthropic.answer_as("claude-sonnet-4-5", judge)
    app = comparing_app(
        CONFIG,
        sqlite_url,
        fake_openai,
        fake_anthropic,
        tmp_path,
        monkeypatch,
        DS_BASE_URL=fake_deepseek.base_url,
        DS_API_KEY=fake_deepseek.api_key,
    )
    gateway = app.state.gateway
    gateway.router.context.scorer = lambda prompt: 0.1  # every request goes to the weak model first
    gateway.comparer.rng = WeakFirst()
    with serve(app, free_port()) as url:
        admin, tenant, client = prompt_keeper(url)

        def ask(route: str, prompt: str, **extra: object) -> str:
            raw = client.chat.completions.with_raw_response.create(
                model=route,
                messages=extra.pop("messages", [{"role": "user", "content": prompt}]),  # type: ignore[arg-type]
                **extra,  # type: ignore[arg-type]
            )
            assert raw.http_response.status_code == 200
            return raw.headers["x-weir-route"]

        def outcome(route: str, name: str) -> float:
            metrics = httpx.get(f"{url}/metrics").text
            key = f'weir_route_comparisons_total{{outcome="{name}",route="{route}"}} '
            found = [line for line in metrics.splitlines() if line.startswith(key)]
            return float(found[0].split()[-1]) if found else 0.0

        def judged() -> int:
            return len([r for r in fake_anthropic.requests if r.path.endswith("/messages")])

        def compared() -> dict[str, tuple]:
            rows = sync_exec(
                sqlite_url,
                "SELECT request_id, weak_score, strong_score FROM comparisons "
                f"WHERE tenant_id = '{tenant['id']}'",
            )
            return {row[0]: row[1:] for row in rows}

        # The other candidate refuses (429): no judge call, nothing stored.
        fake_deepseek.fail_next(429)
        assert "compare=sampled" in ask("once", "question one")
        wait_for(lambda: outcome("once", "failed") == 1)
        assert judged() == 0
        # The judge fails (500) on the first of two gradings: the second is not asked for.
        fake_anthropic.fail_next(500)
        ask("twice", "question two")
        wait_for(lambda: outcome("twice", "failed") == 1)
        assert judged() == 1
        # The judge refuses to grade: unparsed, nothing stored.
        ask("once", "please refuse this one")
        wait_for(lambda: outcome("once", "unparsed") == 1)
        assert judged() == 2 and compared() == {}
        # The judge explains after its verdict: the verdict's grades are stored.
        header = ask("once", "explain question four")
        wait_for(lambda: outcome("once", "judged") == 1)
        [(weak_score, strong_score)] = compared().values()
        assert (weak_score, strong_score) == (pytest.approx(scaled(9)), pytest.approx(scaled(2)))
        assert "candidate=weak" in header

        # Not compared: n > 1, an image, a stream that broke and was resumed on the other candidate.
        assert "compare" not in ask("once", "two answers", n=2)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        assert "compare" not in ask(
            "once", "", messages=[{"role": "user", "content": [{"type": "text", "text": "what"}, image]}]
        )
        plain_before = [r for r in fake_deepseek.requests if not (r.json or {}).get("stream")]
        fake_openai.fail_next(Fault.cut_stream(after=4))
        words = " ".join(f"word{i}" for i in range(30))
        with client.chat.completions.with_streaming_response.create(
            model="once", messages=[{"role": "user", "content": words}], stream=True
        ) as response:
            text = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)
            assert "compare=sampled" in response.headers["x-weir-route"]
        assert text.split() == words.split()  # the client got its whole answer, from two models
        wait_for(lambda: outcome("once", "skipped") == 1)
        time.sleep(0.3)
        assert [r for r in fake_deepseek.requests if not (r.json or {}).get("stream")] == plain_before
        assert judged() == 3 and len(compared()) == 1

        # Every background call is a ledger row, failed ones included; each route's hourly cap counts
        # what they cost there (the failed calls nothing), not their estimates.
        def ledger() -> list[tuple]:
            return sync_exec(
                sqlite_url,
                "SELECT routing, status, cost_pico_usd, route FROM usage_events "
                f"WHERE tenant_id = '{tenant['id']}' AND routing LIKE '%purpose=%'",
            )

        wait_for(lambda: len(ledger()) == 7)  # 4 compare calls, 3 judge calls
        statuses = sorted((row[0].split("purpose=")[1].split(";")[0], row[1]) for row in ledger())
        assert statuses == [
            ("compare", 200),
            ("compare", 200),
            ("compare", 200),
            ("compare", 429),
            ("judge", 200),
            ("judge", 200),
            ("judge", 500),
        ]
        for route in ("once", "twice"):
            micro_usd = round(sum(row[2] for row in ledger() if row[3] == route) / 1e6)
            assert micro_usd > 0
            assert counted_micro_usd(gateway.comparer.spend, tenant["id"], route, micro_usd, 2 * 4)

        # A head bundle cut short, or nested past what a parser takes, is refused (400), not a 500.
        data = bundle(DifficultyHead.load(DEFAULT_HEAD_DIR))
        deep = b"[" * 100_000
        for body in (data[: len(data) // 2], struct.pack("<Q", len(deep)) + deep):
            refused = admin.put(
                "/difficulty-heads/cut", content=body, headers={"content-type": "application/octet-stream"}
            )
            assert refused.status_code == 400, refused.text
            assert "not a difficulty head bundle" in refused.json()["error"]["message"]
        assert admin.get("/difficulty-heads").json() == {"data": []}


def test_a_bundle_whose_metadata_is_nested_too_deep_is_refused_with_a_reason() -> None:
    for header in (
        b"[" * 100_000,
        json.dumps({"__metadata__": {BUNDLE_KEY: "[" * 100_000}}).encode(),
    ):
        with pytest.raises(ValueError, match="not a difficulty head bundle"):
            unbundle(struct.pack("<Q", len(header)) + header)


# --- max_in_flight under a burst --------------------------------------------------------------


def _route(name: str, max_in_flight: int) -> Route:
    return Route(
        name=name,
        policy="difficulty",
        candidates=[Candidate(model="weak"), Candidate(model="strong")],
        compare=Compare(judge="grader", share=1.0, max_in_flight=max_in_flight),
    )


async def test_max_in_flight_holds_per_route_under_a_burst() -> None:
    comparer = Comparer(None, None, None, lambda principal: True)  # type: ignore[arg-type]
    release = asyncio.Event()
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    async def held(job: Job) -> None:  # a comparison that takes until released
        name = job.route.name
        running[name] = running.get(name, 0) + 1
        peak[name] = max(peak.get(name, 0), running[name])
        await release.wait()
        running[name] -= 1

    comparer._compare = held  # type: ignore[method-assign]
    principal = Principal(tenant_id="t", tenant_name="t", key_id=None)

    def submit(route: Route, i: int) -> None:
        plan = Plan(route=route, choices=[], chosen=Choice(None, route.candidates[0], 0.2, "", "static"))  # type: ignore[arg-type]
        call = Call(RequestInfo(request_id=f"{route.name}-{i}"), principal, "chat")
        comparer._submit(call, plan, None, None, "an answer")  # type: ignore[arg-type]

    busy, quiet = _route("busy", 3), _route("quiet", 1)
    for i in range(20):  # a burst on one route
        submit(busy, i)
    submit(quiet, 0)  # another route's comparisons are not starved by it
    submit(quiet, 1)
    await asyncio.sleep(0)
    assert running == {"busy": 3, "quiet": 1}
    busy_count = comparer.outcomes.labels("busy", "busy")._value.get()
    assert busy_count == 17 and comparer.outcomes.labels("quiet", "busy")._value.get() == 1
    release.set()
    await asyncio.gather(*comparer.tasks)
    await asyncio.sleep(0)
    assert peak == {"busy": 3, "quiet": 1} and comparer.in_flight == {} and not comparer.tasks
    release.clear()
    for i in range(3):  # the slots are free again
        submit(busy, 100 + i)
    await asyncio.sleep(0)
    assert running["busy"] == 3 and comparer.outcomes.labels("busy", "busy")._value.get() == 17
    release.set()
    await asyncio.gather(*comparer.tasks)


# --- the training rows ------------------------------------------------------------------------


def _db(tmp_path: Path, *tenants: Tenant) -> str:
    path = tmp_path / "weir.db"
    engine = create_engine(f"sqlite:///{path}")
    Base.metadata.create_all(engine)
    with Session(engine) as session:
        session.add_all(tenants)
        session.commit()
    engine.dispose()
    return f"sqlite:///{path}"


def _stored(tenant: str, request_id: str, prompt: str) -> StoredPrompt:
    body = json.dumps({"model": "auto", "messages": [{"role": "user", "content": prompt}]})
    return StoredPrompt(
        request_id=request_id,
        tenant_id=tenant,
        ts=NOW,
        endpoint="chat",
        status=200,
        key_id=None,
        request_body=body,
        response_body="{}",
    )


def _compared(tenant: str, request_id: str, weak: float, strong: float) -> Comparison:
    return Comparison(
        tenant_id=tenant,
        request_id=request_id,
        route="auto",
        weak_model=WEAK,
        strong_model=STRONG,
        served="weak",
        weak_score=weak,
        strong_score=strong,
        judge="grader",
    )


def _add(url: str, *rows: object) -> None:
    engine = create_engine(url)
    with Session(engine) as session:
        session.add_all(rows)
        session.commit()
    engine.dispose()


def _load(url: str, tenant: str) -> tuple[Outcomes, object]:
    async def go() -> tuple[Outcomes, object]:
        engine = create_async_engine(url.replace("sqlite://", "sqlite+aiosqlite://"))
        try:
            return await load_feedback(sessionmaker(engine), tenant, WEAK, STRONG)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_a_tenant_named_like_another_tenants_id_never_gets_its_rows(tmp_path: Path) -> None:
    # "t-acme" is acme's id and the name of another tenant (created first).
    url = _db(tmp_path, Tenant(id="t-other", name="t-acme"), Tenant(id="t-acme", name="acme"))
    _add(
        url,
        _stored("t-acme", "a1", "acme's question"),
        _compared("t-acme", "a1", 0.0, 1.0),
        _stored("t-other", "o1", "the other tenant's question"),
        _compared("t-other", "o1", 1.0, 1.0),
    )
    for name in ("t-acme", "acme"):
        data, report = _load(url, name)
        assert data.prompts == ["acme's question"] and report.tenant_id == "t-acme"  # type: ignore[attr-defined]
    data, _ = _load(url, "t-other")  # the other tenant, by its id
    assert data.prompts == ["the other tenant's question"]


def test_a_request_id_sent_with_different_requests_trains_nothing(tmp_path: Path) -> None:
    url = _db(tmp_path, Tenant(id="t-acme", name="acme", store_prompts=True))
    _add(
        url,
        # A client sent two different requests under one x-request-id: which prompt did the judge see?
        _stored("t-acme", "dup", "first question"),
        _stored("t-acme", "dup", "second question"),
        _compared("t-acme", "dup", 0.0, 1.0),
        # A client that retried one request under its id: the same prompt, one row.
        _stored("t-acme", "retry", "same question"),
        _stored("t-acme", "retry", "same question"),
        _compared("t-acme", "retry", 0.0, 1.0),
        _stored("t-acme", "one", "lone question"),
        _compared("t-acme", "one", 1.0, 1.0),
        # Feedback on an id both models answered: whose answer did the score judge?
        _stored("t-acme", "fb-both", "scored question"),
        ledger_row("fb-both", 1, "t-acme", WEAK, 200),
        ledger_row("fb-both", 2, "t-acme", STRONG, 200),
        Feedback(tenant_id="t-acme", request_id="fb-both", score=1.0),
        # Answered twice by the same model: that model's label.
        _stored("t-acme", "fb-weak", "retried question"),
        ledger_row("fb-weak", 1, "t-acme", WEAK, 200),
        ledger_row("fb-weak", 2, "t-acme", WEAK, 200),
        Feedback(tenant_id="t-acme", request_id="fb-weak", score=0.0),
    )
    data, report = _load(url, "acme")
    rows = dict(zip(data.prompts, zip(data.weak.tolist(), data.known().tolist(), strict=True), strict=True))
    assert rows == {
        "same question": (False, [True, True]),
        "lone question": (True, [True, True]),
        "retried question": (False, [True, False]),
    }
    assert report.skipped == {  # type: ignore[attr-defined]
        "sent under a request id that requests with other prompts used too": 1,
        "answered by different models under one request id": 1,
    }


def test_rows_all_of_one_kind_train_a_head_that_is_never_promoted(
    classifier: DifficultyClassifier, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every compared request needed the strong model: nothing to tell apart.
    prompts = [f"Question {i} about {['rivers', 'tea', 'birds', 'trains'][i % 4]}?" for i in range(48)]
    data = Outcomes(prompts, weak=np.zeros(48, bool), strong=np.ones(48, bool))
    enc = encode(classifier.embedder, prompts)
    cfg = TrainConfig(epochs=3, calibration_folds=2)
    head = fit_head(data, enc, cfg)
    # Its arrays are finite (the Platt fit of one kind ran off to NaN) and fit together: it can be
    # served, and it says no more than the base rate, with one pseudo-row of each kind: 49 of 50.
    again = unbundle(bundle(head))
    others = encode(classifier.embedder, ["Prove the Riemann hypothesis.", "hi", "Name a colour."])
    assert again.p_strong(others) == pytest.approx([49 / 50] * 3)
    assert head.meta["no_held_out_skill"]
    # Its metadata says the cross-fitted ranking could not be measured: NaN, which strict JSON lacks.
    assert all(math.isnan(v) for v in head.meta["blend_aucs"].values())
    held, results = holdout_check(data, enc, again, cfg, share=0.25)
    assert held > 0 and results == []  # no held-out outcome has both kinds to rank
    route = TenantRoute(id=1, weak=WEAK, strong=STRONG, head=None, exclusive=True)
    # `--install` on such rows: nothing to decide on, so nothing is stored (the DB is never opened).
    _promote(head, "never", route, "acme", {"baseline": "b", "results": []}, "better", "sqlite:///nowhere.db")
    report = json.loads(capsys.readouterr().out)
    assert not report["installed"] and "rank nothing" in report["reason"]


async def test_a_head_whose_metadata_holds_nan_is_stored_as_strict_json(db_url: str) -> None:
    head = DifficultyHead.load(DEFAULT_HEAD_DIR)
    head.meta["blend_aucs"] = {"components": float("nan"), "components+length": float("nan")}
    head.meta["holdout"] = {"results": [], "share": 0.2, "inf": float("inf")}
    data = bundle(head)
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        sessions = sessionmaker(engine)
        async with sessions() as session, session.begin():
            await put_head(session, "one-kind", data, unbundle(data))
        async with sessions() as session:
            row = await session.get(DifficultyHeadRow, "one-kind")
            assert row is not None and await stored_bundle(session, "one-kind") == (row.digest, data)
            assert row.meta["blend_aucs"] == {"components": None, "components+length": None}
            assert row.meta["holdout"] == {"results": [], "share": 0.2, "inf": None}
    finally:
        await engine.dispose()


# --- --install and a route edited while the head trained ---------------------------------------


def _passed() -> dict[str, object]:
    result = HoldoutResult("weak model wrong", 10, 10, 0.95, 0.5, (0.2, 0.6))
    return {"baseline": "the shipped encoder head", "results": [asdict(result)]}


@pytest.mark.parametrize("edit", ["shared with another tenant", "candidates swapped"])
def test_install_leaves_a_route_edited_while_its_head_trained(tmp_path: Path, edit: str) -> None:
    url = _db(tmp_path, Tenant(id="t-acme", name="acme"), Tenant(id="t-other", name="other"))
    mine = {**DIFFICULTY, "when": {"tenants": ["acme"]}}
    [route_id] = set_routes(url, mine)
    route = reached_route(url, "acme")  # read before training, as `weir router train` does
    assert route.exclusive and route.head is None
    edited = (
        {**mine, "when": {"tenants": ["acme", "other"]}}
        if edit == "shared with another tenant"
        else {**mine, "candidates": [{"model": STRONG}, {"model": WEAK}]}
    )
    engine = create_engine(url)
    with Session(engine) as session:
        row = session.get(RouteRow, route_id)
        assert row is not None
        row.spec = {"name": "auto", **edited}
        session.commit()
    engine.dispose()
    with pytest.raises(click.ClickException, match="changed while the head was being trained"):
        _promote(forced(-100.0), "acme-new", route, "acme", _passed(), "significant", url)
    assert route_head(url, route_id) is None and audit_rows(url) == []
    engine = create_engine(url)
    with Session(engine) as session:
        assert session.scalars(select(DifficultyHeadRow)).all() == []
        assert session.scalars(select(AuditLog)).all() == []
    engine.dispose()
    # Run again on the route as it is now: re-pointed where it still serves acme alone; a route
    # shared since gets the head stored only.
    _promote(forced(-100.0), "acme-new", reached_route(url, "acme"), "acme", _passed(), "significant", url)
    shared = edit == "shared with another tenant"
    assert route_head(url, route_id) == (None if shared else "acme-new")
