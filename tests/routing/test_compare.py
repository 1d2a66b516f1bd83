"""Comparisons (routing.compare): a share of a difficulty route's requests is answered by both
candidates in the background and graded by a judge; the grades are training rows with both outcomes.

End to end through the gateway with the admin DB (SQLite and PostgreSQL), OpenAI candidates and an
Anthropic judge on the fake vendors, the official OpenAI SDK as the client."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from gateway.accounting.money import format_usd, pico_to_usd
from gateway.auth import ANONYMOUS
from gateway.config import parse_config
from gateway.db.session import create_engine, sessionmaker
from gateway.logging import add_request_fields
from gateway.runtime import Gateway
from gateway.state.memory import MemoryState
from gateway.state.redis import RedisState
from gateway.types import ChatRequest, Message
from gateway.usage_sink import ListSink
from routing.compare import JUDGE_SYSTEM, MAX_SECTION_CHARS, Job, judge_request, parse_verdict, scaled
from routing.execute import HOUR, SpendCap
from routing.feedback import load_feedback
from routing.plan import features
from routing.ranking import auc_normal_interval
from routing.router import RouteError, validate
from routing.routes import Candidate, Compare, Route
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.db import REDIS_URL, sync_exec
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.waiting import wait_for
from tests.routing.comparing import comparing_app, prompt_keeper
from tests.routing.routed import counted_micro_usd

CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
  - {name: anthropic, type: anthropic, base_url: "${ANTHROPIC_BASE_URL}", api_key: "${ANTHROPIC_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.6}}
  - {name: gpt-4o, backend: openai, price: {input: 2.5, output: 10}}
  - {name: grader, backend: anthropic, model: claude-sonnet-4-5, price: {input: 3, output: 15}}
database_url: "${DB_URL}"
routes:
  - name: auto
    policy: difficulty
    candidates: [{model: gpt-4o-mini}, {model: gpt-4o}]
    probe_interval: null
    compare: {judge: grader, share: 1.0, max_in_flight: 8, both_orders: false}
  - name: capped
    policy: difficulty
    candidates: [{model: gpt-4o-mini}, {model: gpt-4o}]
    probe_interval: null
    compare: {judge: grader, share: 1.0, max_spend_usd_per_hour: 0, both_orders: false}
  - name: twice
    policy: difficulty
    candidates: [{model: gpt-4o-mini}, {model: gpt-4o}]
    probe_interval: null
    compare: {judge: grader, share: 1.0}  # both_orders by default
"""


def weak_model(text: str) -> str:
    return f"WRONG about {text}" if "tricky" in text or "impossible" in text else f"right about {text}"


def strong_model(text: str) -> str:
    return f"WRONG about {text}" if "impossible" in text else f"right about {text}"


def judge(text: str) -> str:
    """Grades what the fake candidates said: 2 for a wrong answer, 9 for a right one."""
    a = re.search(r"<answer_A>\n(.*?)\n</answer_A>", text, re.S)
    b = re.search(r"<answer_B>\n(.*?)\n</answer_B>", text, re.S)
    assert a and b and "<request>" in text
    if "biased" in text:  # a judge that prefers whatever it reads first
        return '{"A": 9, "B": 2}'
    grade = {True: 2, False: 9}
    return f'Both read. {{"A": {grade["WRONG" in a.group(1)]}, "B": {grade["WRONG" in b.group(1)]}}}'


class Alternating(random.Random):
    def random(self) -> float:
        self.flip = not getattr(self, "flip", False)
        return 0.25 if self.flip else 0.75


Comparing = Callable[..., Any]


@pytest.fixture
def comparing(
    fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Comparing:
    """`comparing_app` on this test's fakes, temporary folder and environment: called with the config
    and the DB URL (and the usage sink and other config variables, where a test has them)."""
    return functools.partial(
        comparing_app,
        fake_openai=fake_openai,
        fake_anthropic=fake_anthropic,
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
    )


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def test_both_answers_are_graded_and_become_full_training_rows(
    db: str,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    comparing: Comparing,
) -> None:
    fake_openai.answer_as("gpt-4o-mini", weak_model)
    fake_openai.answer_as("gpt-4o", strong_model)
    fake_anthropic.answer_as("claude-sonnet-4-5", judge)
    app = comparing(CONFIG, db)
    gateway = app.state.gateway
    # A stand-in for the shipped classifier: prompts saying "hard" go to the strong model.
    gateway.router.context.scorer = lambda prompt: 0.9 if "hard" in prompt else 0.1
    gateway.comparer.rng = Alternating()  # the judge sees the weak model's answer first, then second...
    with serve(app, free_port()) as url:
        admin, keeps, client = prompt_keeper(url)
        other = admin.post("/tenants", json={"name": "other"}).json()
        prompts = {
            "easy question one": ("weak", 9, 9),
            "tricky question two": ("weak", 2, 9),
            "hard question three": ("strong", 9, 9),
            "hard impossible question four": ("strong", 2, 2),
            "tricky question five": ("weak", 2, 9),
            "hard tricky question six": ("strong", 2, 9),
        }
        request_ids: dict[str, str] = {}
        for i, prompt in enumerate(prompts):
            messages = [{"role": "user", "content": prompt}]
            if i % 2:  # streams are compared once they end
                with client.chat.completions.with_streaming_response.create(
                    model="auto", messages=messages, stream=True
                ) as response:
                    text = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)
                    header, request_ids[prompt] = (
                        response.headers["x-weir-route"],
                        response.headers["x-request-id"],
                    )
            else:
                raw = client.chat.completions.with_raw_response.create(model="auto", messages=messages)
                text = raw.parse().choices[0].message.content or ""
                header, request_ids[prompt] = raw.headers["x-weir-route"], raw.headers["x-request-id"]
            served = "gpt-4o-mini" if prompts[prompt][0] == "weak" else "gpt-4o"
            assert f"candidate={served}" in header and "compare=sampled" in header
            assert text == (weak_model if served == "gpt-4o-mini" else strong_model)(prompt)

        def compared() -> dict[str, tuple]:
            found = sync_exec(
                db,
                "SELECT request_id, route, weak_model, strong_model, served, weak_score, strong_score, judge "
                f"FROM comparisons WHERE tenant_id = '{keeps['id']}'",
            )
            return {row[0]: row[1:] for row in found}

        wait_for(lambda: len(compared()) == len(prompts))
        rows = compared()
        for prompt, (served, weak_grade, strong_grade) in prompts.items():
            assert rows[request_ids[prompt]] == (
                "auto",
                "gpt-4o-mini",
                "gpt-4o",
                served,
                pytest.approx(scaled(weak_grade)),
                pytest.approx(scaled(strong_grade)),
                "grader",
            )
        # The other candidate was asked the same question without streaming; the judge saw both
        # answers, in both orders over these requests.
        judged = [r for r in fake_anthropic.requests if r.path.endswith("/messages")]
        assert len(judged) == len(prompts)
        shown = [r.json["messages"][-1]["content"] for r in judged]
        shown = [s if isinstance(s, str) else s[0]["text"] for s in shown]
        one_wrong = {("<answer_A>\nWRONG" in s, "<answer_B>\nWRONG" in s) for s in shown}
        assert {(True, False), (False, True)} <= one_wrong
        assert all(
            r.json["system"] in (JUDGE_SYSTEM, [{"type": "text", "text": JUDGE_SYSTEM}]) for r in judged
        )
        chats = [r for r in fake_openai.requests if r.path.endswith("/chat/completions")]
        assert len(chats) == 2 * len(prompts)
        assert sum(1 for r in chats if not r.json.get("stream")) == len(prompts) + len(prompts) // 2

        # Each background call is the tenant's own usage event, tied to the client's request.
        def ledger() -> list[tuple]:
            return sync_exec(
                db,
                f"SELECT request_id, route, routing, status FROM usage_events WHERE tenant_id = '{keeps['id']}'",
            )

        wait_for(lambda: len(ledger()) == 3 * len(prompts))
        for request_id in request_ids.values():
            extra = [row for row in ledger() if f"for={request_id}" in (row[2] or "")]
            assert sorted(re.search(r"purpose=(\w+)", row[2]).group(1) for row in extra) == [
                "compare",
                "judge",
            ]
            assert all(row[0] != request_id and row[1] == "auto" and row[3] == 200 for row in extra)

        # The hourly cap counts what the background calls cost, as the ledger prices them.
        costs = sync_exec(
            db,
            f"SELECT cost_pico_usd FROM usage_events WHERE tenant_id = '{keeps['id']}' AND routing LIKE '%purpose=%'",
        )
        micro_usd = round(sum(c for (c,) in costs) / 1e6)
        # Each comparison's estimate is rounded up and its correction rounded: within 2 of exact.
        tolerance = 2 * len(prompts)
        assert micro_usd > 5 * tolerance
        assert counted_micro_usd(gateway.comparer.spend, keeps["id"], "auto", micro_usd, tolerance)

        # The admin API shows the grades, newest first, and how often each model was acceptable.
        listed = admin.get(f"/tenants/{keeps['id']}/comparisons", params={"route": "auto", "limit": 2}).json()
        assert len(listed["data"]) == 2 and listed["data"][0]["request_id"] in request_ids.values()
        assert listed["data"][0]["judge"] == "grader" and listed["data"][0]["served"] in ("weak", "strong")
        assert all(r["updated_at"] == r["created_at"] for r in listed["data"])  # graded once: one moment
        assert listed["summary"] == [
            {
                "route": "auto",
                "weak_model": "gpt-4o-mini",
                "strong_model": "gpt-4o",
                "comparisons": 6,
                "weak_acceptable": pytest.approx(2 / 6),
                "strong_acceptable": pytest.approx(5 / 6),
                "only_strong_acceptable": pytest.approx(3 / 6),
            }
        ]
        # And how well the route's scores ranked them: three of the six needed the strong model, and
        # the stand-in scorer put one of them above two of the others (pairs 3 of 9, ties half).
        stored = sync_exec(db, f"SELECT p_strong, head FROM comparisons WHERE tenant_id = '{keeps['id']}'")
        assert sorted(stored) == [(0.1, None)] * 3 + [(0.9, None)] * 3  # a scorer set in code has no name
        ranking = admin.get(f"/tenants/{keeps['id']}/comparisons").json()["ranking"]
        assert ranking == [
            {
                "route": "auto",
                "head": None,
                "comparisons": 6,
                "needs_strong": 3,
                "auc": pytest.approx(1 / 3),
                "auc_low": pytest.approx(0.0),
                "auc_high": pytest.approx(auc_normal_interval(1 / 3, 3, 3)[1]),
                "verdict": "not yet clear",  # three of each kind is too few to say
            }
        ]
        # /metrics has this replica's recent ranking too: the counts, but no AUC with three of each.
        metrics = httpx.get(f"{url}/metrics").text
        assert 'weir_route_head_ranking_comparisons{head="",kind="needs_strong",route="auto"} 3.0' in metrics
        assert 'weir_route_head_ranking_comparisons{head="",kind="other",route="auto"} 3.0' in metrics
        assert "weir_route_head_ranking_auc{" not in metrics
        assert admin.get(f"/tenants/{other['id']}/comparisons").json() == {
            "data": [],
            "summary": [],
            "ranking": [],
        }
        assert admin.get("/tenants/nobody/comparisons").status_code == 404
        assert admin.get(f"/tenants/{keeps['id']}/comparisons", params={"limit": 0}).status_code == 400

        # Not compared: a tenant that keeps no prompts, a request offering tools, a route over its cap.
        other_client = openai.OpenAI(
            base_url=f"{url}/v1", api_key=admin.post(f"/tenants/{other['id']}/keys", json={}).json()["key"]
        )
        raw = other_client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "easy from a tenant keeping nothing"}]
        )
        assert "compare" not in raw.headers["x-weir-route"]
        tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
        raw = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "easy with tools"}], tools=[tool]
        )
        assert "compare" not in raw.headers["x-weir-route"]
        raw = client.chat.completions.with_raw_response.create(
            model="capped", messages=[{"role": "user", "content": "easy but capped"}]
        )
        assert "compare=sampled" in raw.headers["x-weir-route"]
        metrics = httpx.get(f"{url}/metrics").text
        wait_for(
            lambda: (
                'weir_route_comparisons_total{outcome="capped",route="capped"} 1.0'
                in httpx.get(f"{url}/metrics").text
            )
        )
        assert 'weir_route_comparisons_total{outcome="judged",route="auto"} 6.0' in metrics
        time.sleep(0.5)
        assert len(compared()) == len(prompts)
        assert len([r for r in fake_anthropic.requests if r.path.endswith("/messages")]) == len(prompts)

        # both_orders: graded twice, the answers swapped; kept only where the two verdicts agree.
        def twice(prompt: str) -> str:
            raw = client.chat.completions.with_raw_response.create(
                model="twice", messages=[{"role": "user", "content": prompt}]
            )
            return raw.headers["x-request-id"]

        agreed, biased = twice("tricky question seven"), twice("biased question eight")
        wait_for(
            lambda: (
                len([r for r in fake_anthropic.requests if r.path.endswith("/messages")]) == len(prompts) + 4
            )
        )
        wait_for(
            lambda: (
                'weir_route_comparisons_total{outcome="inconsistent",route="twice"} 1.0'
                in httpx.get(f"{url}/metrics").text
            )
        )
        wait_for(lambda: agreed in compared())
        weak_grade, strong_grade = 2, 9
        assert compared()[agreed] == (
            "twice",
            "gpt-4o-mini",
            "gpt-4o",
            "weak",
            pytest.approx(scaled(weak_grade)),
            pytest.approx(scaled(strong_grade)),
            "grader",
        )
        assert biased not in compared()
        prompts["tricky question seven"] = ("weak", weak_grade, strong_grade)

    # Training reads them with the stored prompts: both outcomes known on every row.
    async def load() -> tuple[object, object]:
        engine = create_engine(db)
        try:
            return await load_feedback(sessionmaker(engine), "keeps", "gpt-4o-mini", "gpt-4o")
        finally:
            await engine.dispose()

    data, report = asyncio.run(load())
    assert report.used == {"both": len(prompts), "weak": 0, "strong": 0}  # type: ignore[attr-defined]
    assert not data.partial  # type: ignore[attr-defined]
    labels = dict(zip(data.prompts, zip(data.weak.tolist(), data.strong.tolist(), strict=True), strict=True))  # type: ignore[attr-defined]
    assert labels == {p: (w > 5, s > 5) for p, (_, w, s) in prompts.items()}
    # Each row also carries the score it was routed by, for the holdout check against that head.
    routed = dict(zip(data.prompts, report.routed.tolist(), strict=True))  # type: ignore[attr-defined]
    assert routed == {p: 0.9 if "hard" in p else 0.1 for p in prompts}
    assert report.routed_by == [None] * len(prompts)  # type: ignore[attr-defined]


def compared_request(url: str) -> tuple[httpx.Client, httpx.Headers]:
    """A tenant that stores its prompts asks `auto` an easy question, which is sampled for comparison:
    an admin client of the gateway at `url`, and the reply's headers."""
    admin, _, client = prompt_keeper(url)
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "easy question"}]
    )
    assert "compare=sampled" in raw.headers["x-weir-route"]
    return admin, raw.headers


def test_a_compared_request_is_one_request_whose_comparison_adds_attempts_and_cost(
    db: str, fake_anthropic: FakeAnthropic, comparing: Comparing
) -> None:
    """A comparison's calls (the other candidate's answer, the judge's verdict) are requests Weir sends
    itself, each with its own attempt 1: the usage report counted them as client requests, so a
    compared request read as three. It is one request, whose attempts and cost include its
    comparison's (Finance sees that spend), whether whole days read the rollups or part of a day the
    ledger."""
    fake_anthropic.answer_as("claude-sonnet-4-5", judge)
    app = comparing(CONFIG, db)
    app.state.gateway.router.context.scorer = lambda prompt: 0.1  # gpt-4o-mini serves; gpt-4o compared
    with serve(app, free_port()) as url:
        admin, _ = compared_request(url)
        wait_for(lambda: sync_exec(db, "SELECT count(*) FROM comparisons") == [(1,)])
        wait_for(lambda: sync_exec(db, "SELECT count(*) FROM usage_events") == [(3,)])
        [(cost,)] = sync_exec(db, "SELECT sum(cost_pico_usd) FROM usage_events")
        assert cost > 0
        now = dt.datetime.now(dt.UTC)
        whole_days = {
            "start": (now - dt.timedelta(days=1)).date(),
            "end": (now + dt.timedelta(days=2)).date(),
        }
        part_of_a_day = {"start": now - dt.timedelta(hours=1), "end": now + dt.timedelta(hours=1)}
        for span, source in ((whole_days, "rollups"), (part_of_a_day, "events")):
            params = {k: v.isoformat() for k, v in span.items()}
            report = admin.get("/reports/usage", params=params).json()
            assert report["source"] == source
            [row] = report["rows"]
            assert (row["tenant_name"], row["requests"], row["attempts"]) == ("keeps", 1, 3), source
            assert row["cost_usd"] == format_usd(pico_to_usd(int(cost))), source
            by_model = admin.get("/reports/usage", params={**params, "group_by": "model"}).json()
            got = {r["model"]: (r["requests"], r["attempts"]) for r in by_model["rows"]}
            # The request counts where it was served; the other answer and the verdict are attempts.
            assert got == {"gpt-4o-mini": (1, 1), "gpt-4o": (0, 1), "claude-sonnet-4-5": (0, 1)}, source
            assert (by_model["totals"]["requests"], by_model["totals"]["attempts"]) == (1, 3), source


def test_the_spend_cap_counts_what_the_ledger_bills_at_the_catalogs_prices(
    sqlite_url: str,
    fake_anthropic: FakeAnthropic,
    comparing: Comparing,
) -> None:
    """The admin prices the other candidate (gpt-4o) and the judge ten times the config's prices: the
    hourly cap counts what the ledger bills the comparison's calls, not the config's prices (a
    tenth of it), which it counted from the pipeline's own config price sheets."""
    fake_anthropic.answer_as("claude-sonnet-4-5", judge)
    app = comparing(CONFIG, sqlite_url)
    gateway = app.state.gateway
    gateway.router.context.scorer = lambda prompt: 0.1  # the weak model serves; gpt-4o is compared
    with serve(app, free_port()) as url:
        admin, keeps, client = prompt_keeper(url)
        prices = [
            {"backend": backend, "model": model, "token_class": token_class, "usd_per_1m_tokens": usd}
            for backend, model, token_class, usd in (
                ("openai", "gpt-4o", "input", "25"),
                ("openai", "gpt-4o", "output", "100"),
                ("anthropic", "claude-sonnet-4-5", "input", "30"),
                ("anthropic", "claude-sonnet-4-5", "output", "150"),
            )
        ]
        assert admin.put("/prices", json={"prices": prices}).status_code == 200
        client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "easy question"}])

        def ledger() -> list[tuple]:
            return sync_exec(
                sqlite_url,
                f"SELECT cost_pico_usd FROM usage_events WHERE tenant_id = '{keeps['id']}' "
                "AND routing LIKE '%purpose=%'",
            )

        wait_for(lambda: sync_exec(sqlite_url, "SELECT count(*) FROM comparisons") == [(1,)])
        wait_for(lambda: len(ledger()) == 2)  # the other candidate's call and the judge's
        micro_usd = round(sum(c for (c,) in ledger()) / 1e6)
        assert micro_usd > 100
        assert counted_micro_usd(gateway.comparer.spend, keeps["id"], "auto", micro_usd, 2)


def test_a_comparison_priced_after_its_estimate_left_the_hour_frees_no_room(
    sqlite_url: str,
    fake_anthropic: FakeAnthropic,
    comparing: Comparing,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hourly cap counts a comparison's estimate when it starts and replaces it with what its
    calls cost once they are priced, as the hedge cap does. What the estimate was over by went to the
    minute current then: a judge that answered after the estimate had left the hour freed that much of
    the next hour, so comparisons could spend the cap and more. It goes to the estimate's minute now,
    gone with it."""
    offset = [0.0]  # the state's clock runs ahead of the wall's by this much
    monkeypatch.setattr(MemoryState, "_now", staticmethod(lambda: time.time() + offset[0]))

    def slow_judge(text: str) -> str:
        offset[0] += HOUR + 60  # answers once the estimate's minute has left the hour
        return judge(text)

    fake_anthropic.answer_as("claude-sonnet-4-5", slow_judge)
    app = comparing(CONFIG, sqlite_url)
    gateway = app.state.gateway
    gateway.router.context.scorer = lambda prompt: 0.1
    with serve(app, free_port()) as url:
        _, keeps, client = prompt_keeper(url)
        # Estimated for 1,000 tokens of answer, the few the fakes say cost far less.
        messages = [{"role": "user", "content": "easy question"}]
        client.chat.completions.create(model="auto", messages=messages, max_tokens=1000)
        wait_for(lambda: sync_exec(sqlite_url, "SELECT count(*) FROM comparisons") == [(1,)])
        wait_for(lambda: not gateway.comparer.tasks)  # settled: its task ends after that
        assert counted_micro_usd(gateway.comparer.spend, keeps["id"], "auto", 0, 0)


def test_a_request_for_log_probabilities_is_compared_on_a_model_that_has_none(
    sqlite_url: str,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    comparing: Comparing,
) -> None:
    """The comparison asks the other model for one answer's text, not the client's `logprobs`, which
    Anthropic refuses (a 400 before anything is sent): a route comparing an OpenAI model with a Claude
    one recorded no comparison for such requests."""
    fake_openai.answer_as("gpt-4o-mini", weak_model)
    # Claude is the route's strong candidate and its judge.
    fake_anthropic.answer_as(
        "claude-sonnet-4-5", lambda t: judge(t) if "<answer_A>" in t else strong_model(t)
    )
    config = (
        CONFIG
        + """\
  - name: mixed
    policy: difficulty
    candidates: [{model: gpt-4o-mini}, {model: grader}]
    probe_interval: null
    compare: {judge: grader, share: 1.0, both_orders: false}
"""
    )
    app = comparing(config, sqlite_url)
    app.state.gateway.router.context.scorer = lambda prompt: 0.1
    with serve(app, free_port()) as url:
        _, _, client = prompt_keeper(url)
        messages = [{"role": "user", "content": "easy question"}]
        client.chat.completions.create(model="mixed", messages=messages, logprobs=True, top_logprobs=2)
        wait_for(lambda: sync_exec(sqlite_url, "SELECT count(*) FROM comparisons") == [(1,)])
    asked = [r.json for r in fake_anthropic.requests if r.method == "POST"]
    assert len(asked) == 2  # the other answer and the judge's verdict
    assert all("logprobs" not in body for body in asked)


def test_a_comparisons_other_answer_and_judge_are_asked_within_their_models_limits(
    sqlite_url: str,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    comparing: Comparing,
) -> None:
    """The judge is no candidate and the other answer's candidate declares nothing: each has the
    limit its model declares (`models[].max_output_tokens`). Before, the other model was asked for the
    client's whole limit and the judge for its 1,024 tokens, which a vendor refuses above its model's."""
    fake_openai.answer_as("gpt-4o-mini", weak_model)
    fake_anthropic.answer_as(
        "claude-sonnet-4-5", lambda t: judge(t) if "<answer_A>" in t else strong_model(t)
    )
    # The grader's model under two more names (the price catalog keeps one price per upstream model).
    limited = """\
  - {name: sonnet-8k, backend: anthropic, model: claude-sonnet-4-5, max_output_tokens: 8000, price: {input: 3, output: 15}}
  - {name: grader-512, backend: anthropic, model: claude-sonnet-4-5, max_output_tokens: 512, price: {input: 3, output: 15}}
"""
    config = CONFIG.replace("database_url:", limited + "database_url:", 1) + (
        """\
  - name: limited
    policy: difficulty
    candidates: [{model: gpt-4o-mini}, {model: sonnet-8k}]
    probe_interval: null
    compare: {judge: grader-512, share: 1.0, both_orders: false}
"""
    )
    app = comparing(config, sqlite_url)
    app.state.gateway.router.context.scorer = lambda prompt: 0.1
    with serve(app, free_port()) as url:
        _, _, client = prompt_keeper(url)
        messages = [{"role": "user", "content": "easy question"}]
        client.chat.completions.create(model="limited", messages=messages, max_tokens=10_000)
        wait_for(lambda: sync_exec(sqlite_url, "SELECT count(*) FROM comparisons") == [(1,)])
    assert fake_openai.last_request.json["max_tokens"] == 10_000  # served as asked
    other, verdict = [r.json for r in fake_anthropic.requests if r.method == "POST"]
    assert (other["max_tokens"], verdict["max_tokens"]) == (8000, 512)


def test_a_comparisons_calls_log_their_own_request_id_not_the_clients(
    fake_anthropic: FakeAnthropic,
    comparing: Comparing,
    tmp_path: Path,
) -> None:
    """A comparison runs after the client's request, in a context of its own: a judge call that broke
    is logged with that call's request id, the one its ledger row has (tied to the client's by `for=`),
    never as if the client's request had broken."""
    sink = ListSink()
    db_url = f"sqlite+aiosqlite:///{tmp_path}/weir.db"
    app = comparing(CONFIG, db_url, usage_sink=sink)
    app.state.gateway.router.context.scorer = lambda prompt: 0.1
    fake_anthropic.fail_next(Fault.reset())  # the judge: the only call to Anthropic
    with serve(app, free_port()) as url, capture_logs(processors=[add_request_fields]) as logs:
        _, headers = compared_request(url)
        wait_for(lambda: any(e["event"] == "comparison_failed" for e in logs))
    client_id = headers["x-request-id"]
    [broken] = [e for e in logs if e["event"] == "upstream_request_broken"]
    [judged] = [e for e in sink.events if e.backend == "anthropic"]
    assert broken["request_id"] == judged.request_id != client_id
    assert f"for={client_id}" in (judged.routing or "") and broken["tenant"] == "keeps"
    [failed] = [e for e in logs if e["event"] == "comparison_failed"]
    assert failed["request_id"] == client_id  # the comparison's own line names the client's request


@pytest.mark.parametrize("deleted", [True, False], ids=["deleted", "stopped_comparing"])
def test_a_comparison_running_when_its_route_is_deleted_or_stops_comparing_brings_back_no_row(
    deleted: bool,
    fake_anthropic: FakeAnthropic,
    comparing: Comparing,
    tmp_path: Path,
) -> None:
    """A comparison outlives the request it follows by a judge's answer (seconds). One still running
    when an admin deleted its route counted its outcome, and its judge call's tokens, under the
    deleted name once the table change had dropped its series: they came back, until the name was
    deleted again. They do not now. Nor does its ranking (`weir_route_head_ranking_*`) come back
    under a route edited to stop comparing, which keeps its name's other series (its outcome counts:
    its grades are stored)."""
    fake_anthropic.answer_as("claude-sonnet-4-5", judge)
    fake_anthropic.set_latency(first_token=1.0)  # the judge takes its time
    db_url = f"sqlite+aiosqlite:///{tmp_path}/weir.db"
    app = comparing(CONFIG, db_url)
    gateway = app.state.gateway
    gateway.router.context.scorer = lambda prompt: 0.1
    with serve(app, free_port()) as url:
        admin, _ = compared_request(url)
        wait_for(lambda: any(r.path.endswith("/messages") for r in fake_anthropic.requests))
        [auto] = [route for route in admin.get("/routes").json()["data"] if route["name"] == "auto"]
        if deleted:
            assert admin.delete(f"/routes/{auto['id']}").status_code == 204
        else:
            assert admin.put(f"/routes/{auto['id']}", json={**auto, "compare": None}).status_code == 200
        wait_for(lambda: not gateway.comparer.tasks)  # judged, after the change
        scraped = httpx.get(f"{url}/metrics").text
    left = [line for line in scraped.splitlines() if '"auto"' in line and (deleted or "ranking" in line)]
    assert (left, gateway.comparer.recent.rows) == ([], {})
    if not deleted:
        assert 'weir_route_comparisons_total{outcome="judged",route="auto"} 1.0' in scraped


def test_a_route_compares_only_under_the_difficulty_policy_with_a_known_judge() -> None:
    models = {"gpt-4o-mini", "gpt-4o", "grader"}
    candidates = [Candidate(model="gpt-4o-mini"), Candidate(model="gpt-4o")]

    def route(policy: str = "difficulty", **compare: object) -> Route:
        return Route(
            name="auto",
            policy=policy,
            candidates=candidates,
            compare=Compare(**{"judge": "grader", **compare}),
        )  # type: ignore[arg-type]

    validate([route()], models)
    for bad, message in [
        (route("cheapest"), "only the difficulty policy compares"),
        (route(judge="nobody"), "compare.judge: no model named 'nobody'"),
        (route(share=1.5), "compare.share: must be within"),
        (route(max_spend_usd_per_hour=-1), r"max_spend_usd_per_hour: must be a number from 0 to 1,000,000"),
        (route(max_in_flight=0), "max_in_flight: must be at least 1"),
    ]:
        with pytest.raises(RouteError, match=message):
            validate([bad], models)


async def test_the_spend_cap_takes_corrections() -> None:
    cap = SpendCap("compare")
    first = await cap.charge("t", "r", 0.6, cap=1.0)
    assert first is not None and await cap.charge("t", "r", 0.6, cap=1.0) is None
    await first.settle(100_000 * 10**6)  # the first call cost 0.1, not 0.6
    second = await cap.charge("t", "r", 0.6, cap=1.0)
    assert second is not None
    await second.settle(10**12)  # 0.4 more than its estimate
    assert await cap.charge("t", "r", 0.1, cap=1.0) is None
    assert await cap.charge("u", "r", 0.1, cap=0) is None
    assert await cap.charge("u", "r", 0.0, cap=1e-6) is not None
    assert await cap.charge("u", "r", 1e-9, cap=1e-6) is not None
    assert await cap.charge("u", "r", 1e-9, cap=1e-6) is None  # under a micro-dollar still counts one


@pytest.mark.redis
async def test_replicas_draw_on_one_spend_cap_through_redis(redis_prefix: str) -> None:
    replicas = [
        SpendCap("hedge", RedisState(aioredis.from_url(REDIS_URL), prefix=redis_prefix)) for _ in "ab"
    ]
    try:
        charges = [await replicas[i % 2].charge("t", "r", 0.25, cap=1.0) for i in range(6)]
        # Four in all, not four on each.
        assert [c is not None for c in charges] == [True, True, True, True, False, False]
        assert charges[1] is not None
        await charges[1].settle(50_000 * 10**6)  # a call cost 0.05 of its 0.25
        assert await replicas[0].charge("t", "r", 0.2, cap=1.0) is not None
        compare = SpendCap("compare", replicas[0].state)
        assert await compare.charge("t", "r", 1.0, cap=1.0) is not None  # its own window
    finally:
        for cap in replicas:
            await cap.state.close()


def test_the_verdict_parser_reads_both_grades_or_none() -> None:
    assert parse_verdict('{"A": 7, "B": 3}') == (7.0, 3.0)
    assert parse_verdict('Answer A is better.\n{"A": 8.5, "B": 2}') == (8.5, 2.0)
    assert parse_verdict("A: 4, B = 10") == (4.0, 10.0)
    assert parse_verdict('first {"A": 1, "B": 1} then, on reflection, {"A": 6, "B": 9}') == (6.0, 9.0)
    assert parse_verdict('{"A": 7}') is None
    assert parse_verdict('{"A": 11, "B": 3}') is None  # off the scale
    assert parse_verdict('{"A": 0, "B": 3}') is None
    assert parse_verdict("I cannot grade these.") is None
    assert scaled(1) == 0.0 and scaled(10) == 1.0 and scaled(6) > 0.5 > scaled(5)


def test_the_judge_sees_the_conversation_and_long_texts_clipped_in_the_middle() -> None:
    request = ChatRequest(
        model="auto",
        messages=[
            Message(role="system", content="You are terse."),
            Message(role="user", content="x" * (MAX_SECTION_CHARS * 2) + " END"),
        ],
    )
    asked = judge_request("grader", request, "first answer", "second answer")
    assert asked.model == "grader" and asked.temperature is None and asked.messages[0].content == JUDGE_SYSTEM
    user = asked.messages[1].text()
    assert user.startswith("<request>\nsystem: You are terse.\n\nuser: xxx")
    assert "characters left out" in user and " END\n</request>" in user
    assert len(user) < MAX_SECTION_CHARS + 200
    assert (
        "<answer_A>\nfirst answer\n</answer_A>" in user and "<answer_B>\nsecond answer\n</answer_B>" in user
    )


def test_ranking_is_per_route_and_head_and_null_until_both_kinds_are_compared() -> None:
    from gateway.admin.comparisons import _ranking

    good, bad = scaled(9), scaled(2)
    rows = [
        # route "auto", the shipped static head: the requests that needed the strong model scored
        # above all but one of those that did not (20 of 25 pairs the right way round).
        *[("auto", "static", 0.8 + i / 100, bad, good) for i in range(5)],
        *[("auto", "static", 0.2 + i / 100, good, good) for i in range(4)],
        ("auto", "static", 0.9, good, good),
        # a trained head on the same route ranks them the wrong way round
        *[("auto", "mine@0123456789ab", 0.1, bad, good) for _ in range(4)],
        *[("auto", "mine@0123456789ab", 0.7, good, bad) for _ in range(4)],
        # nothing here needed the strong model yet
        ("chat", "static", 0.5, good, good),
    ]
    ranked = {(r["route"], r["head"]): r for r in _ranking(rows)}
    static = ranked[("auto", "static")]
    assert (static["comparisons"], static["needs_strong"], static["auc"]) == (10, 5, pytest.approx(0.8))
    assert 0.0 < static["auc_low"] < 0.8 < static["auc_high"] <= 1.0
    assert static["verdict"] == "not yet clear"  # five of each kind is too few to say
    trained = ranked[("auto", "mine@0123456789ab")]
    assert trained["auc"] == 0.0 and trained["auc_high"] < 0.5 and trained["verdict"] == "not yet clear"
    # With enough of each kind the interval decides: a head that ranks 70% of pairs right is better
    # than chance at 40 of each, and one that ranks 30% right is worse.
    for wanted, verdict in ((0.7, "better than chance"), (0.3, "worse than chance")):
        many = [("r", "h", 0.5, bad, good) for _ in range(40)]  # needed the strong model
        above = round(40 * (1 - wanted))  # of those that did not, how many scored above them
        many += [("r", "h", 1.0 if i < above else 0.0, good, good) for i in range(40)]
        found = _ranking(many)[0]
        assert found["auc"] == pytest.approx(wanted) and found["verdict"] == verdict, found
    assert ranked[("chat", "static")] | {"route": "-"} == {
        "route": "-",
        "head": "static",
        "comparisons": 1,
        "needs_strong": 0,
        "auc": None,
        "auc_low": None,
        "auc_high": None,
        "verdict": "not yet clear",
    }


def test_recent_ranking_on_metrics_needs_ten_of_each_kind_and_keeps_the_latest() -> None:
    from prometheus_client import CollectorRegistry

    from routing.compare import RecentRanking

    registry = CollectorRegistry()
    recent = RecentRanking(size=40)
    registry.register(recent)

    def sample(name: str, **labels: str) -> float:
        value = registry.get_sample_value(name, {"route": "auto", "head": "static", **labels})
        return float("nan") if value is None else value

    # A head that scores every request that needed the strong model below every one that did not.
    for _ in range(9):
        recent.add("auto", "static", 0.1, True)
        recent.add("auto", "static", 0.9, False)
    assert sample("weir_route_head_ranking_comparisons", kind="needs_strong") == 9
    assert math.isnan(sample("weir_route_head_ranking_auc", bound="high"))  # nine of each: not yet
    recent.add("auto", "static", 0.1, True)
    recent.add("auto", "static", 0.9, False)
    assert sample("weir_route_head_ranking_auc", bound="point") == 0.0
    assert sample("weir_route_head_ranking_auc", bound="high") < 0.5  # what the alert reads
    # The window keeps the latest 40: twenty more the right way round push half the old ones out.
    for _ in range(10):
        recent.add("auto", "static", 0.95, True)
        recent.add("auto", "static", 0.05, False)
    assert sample("weir_route_head_ranking_comparisons", kind="other") == 20
    assert 0.5 < sample("weir_route_head_ranking_auc", bound="point") < 1.0
    recent.add("chat", None, 0.5, False)  # a scorer set in code has no name
    assert (
        registry.get_sample_value(
            "weir_route_head_ranking_comparisons", {"route": "chat", "head": "", "kind": "other"}
        )
        == 1
    )


async def test_a_comparisons_other_answer_is_read_as_the_clients_would_be(fake_gemini: FakeGemini) -> None:
    """The other candidate's answer is read as the client's own (`chat_response_reader`): a request
    with `parallel_tool_calls: false` that Gemini, which has no such switch, answered with several calls
    at once kept them all there, where the request path keeps the first."""
    config = """\
backends:
  - {name: gemini, type: gemini, base_url: "${GEMINI_BASE_URL}", api_key: "${GEMINI_API_KEY}"}
models:
  - {name: gemini-flash, backend: gemini, model: gemini-2.5-flash, price: {input: 0.3, output: 2.5}}
"""
    values = {"GEMINI_BASE_URL": fake_gemini.base_url, "GEMINI_API_KEY": fake_gemini.api_key}
    gateway = Gateway(parse_config(config, values))
    await gateway.start()
    try:
        fake_gemini.call_in_parallel(3)
        tool: Any = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
        request = msgspec.convert(
            {
                "model": "auto",
                "messages": [{"role": "user", "content": "call lookup"}],
                "tools": [tool],
                "parallel_tool_calls": False,
            },
            ChatRequest,
        )
        route = Route(
            name="auto",
            policy="difficulty",
            candidates=[Candidate(model="gemini-flash"), Candidate(model="gemini-flash")],
            probe_interval=None,
            compare=Compare(judge="gemini-flash"),
        )
        job = Job(
            ANONYMOUS,
            "req",
            route,
            request,
            features(request, None, None),
            "weak",
            "answer",
            "weak",
            None,
            None,
        )
        target = gateway.models.targets["gemini-flash"]
        answer = await gateway.comparer._ask(job, target, "gemini-flash", request, "compare", [])
    finally:
        await gateway.stop()
    calls = answer.choices[0].message.tool_calls
    assert calls is not None and [call.function.name for call in calls] == ["lookup"]
