"""The request log and the route editor with routes that use every failover feature: a request that
took more attempts than the log's page assumes still shows each of them, a status filter finds a
failure behind a page of successes, and the editor's advanced JSON refuses what is not an object at
the field instead of dropping or garbling the route's settings; the calls Weir made itself (a
comparison's) are tagged as such."""

from __future__ import annotations

import datetime as dt
import math
import time
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine, insert

from gateway.accounting.writer import event_row
from gateway.db.models import UsageEventRow
from tests.control.events import usage_event
from tests.fakes import FakeOpenAI, Fault
from tests.ui.helpers import Weir, signed_in

HI = [{"role": "user", "content": "hi"}]


def _client(weir: Weir) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{weir.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)


def _logged(admin: httpx.Client, attempts: int, **params: Any) -> list[dict[str, Any]]:
    """The log once it holds that many attempts (events are written in batches, within seconds)."""
    deadline = time.monotonic() + 15
    while True:
        log = admin.get("/requests").json()["data"]
        if sum(len(r["attempts"]) for r in log) >= attempts:
            break
        assert time.monotonic() < deadline, log
        time.sleep(0.1)
    return admin.get("/requests", params=params).json()["data"]


def test_a_request_that_failed_over_five_times_shows_every_attempt(
    routed: Weir, fake_openai: FakeOpenAI
) -> None:
    route = {
        "name": "stubborn",
        "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
        "retry": {"attempts": 3, "backoff": 0.01, "max_backoff": 0.02},
        "breaker": None,
        "probe_interval": None,
    }
    assert routed.admin.post("/routes", json=route).status_code == 201
    fake_openai.fail_next(500, times=5)  # three tries of the first candidate, two of the second
    _client(routed).chat.completions.create(model="stubborn", messages=HI, max_tokens=5)
    [request] = _logged(routed.admin, 6, limit=1)
    assert [a["attempt"] for a in request["attempts"]] == [1, 2, 3, 4, 5, 6]
    assert [a["status"] for a in request["attempts"]] == [500] * 5 + [200]
    assert request["status"] == 200 and request["model"] == "gpt-4o"


def test_a_status_filter_finds_a_failure_behind_newer_successes(
    routed: Weir, fake_openai: FakeOpenAI
) -> None:
    client = _client(routed)
    fake_openai.fail_next(500)
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=5)
    for _ in range(5):
        client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=5)
    [failed] = _logged(routed.admin, 6, status="error", limit=1)
    assert failed["status"] == 500 and len(failed["attempts"]) == 1  # as the vendor answered


def test_advanced_json_that_is_not_an_object_is_refused_at_the_field(routed: Weir, browser: Any) -> None:
    route = {
        "name": "assistant",
        "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
        "retry": {"attempts": 3},
        "failover_on": [429, "5xx", "context_length_exceeded"],
        "resume": False,
    }
    created = routed.admin.post("/routes", json=route).json()
    before = routed.admin.get(f"/routes/{created['id']}").json()
    page = signed_in(routed, browser, f"#/routes/{created['id']}")
    form = page.locator("#edit form")
    advanced = form.get_by_label("Advanced (JSON)", exact=True)
    advanced.wait_for()
    error = form.locator(".form-error")
    # `[]` and `null` dropped every advanced setting (retry, failover_on, resume back to defaults);
    # `"x"` became a field named "0" that the API refused in its own words.
    for value in ("[]", "3", '"x"', "null", "[1, 2]"):
        advanced.fill(value)
        form.get_by_role("button", name="Save route").click()
        error.wait_for()
        assert "Advanced (JSON) must be a JSON object" in error.inner_text(), value
        assert advanced.get_attribute("aria-invalid") == "true"
        assert advanced.evaluate("el => el === document.activeElement")
        assert routed.admin.get(f"/routes/{created['id']}").json() == before, value
        page.evaluate("document.querySelector('#edit .form-error').hidden = true")
    page.close()


def test_the_log_tells_a_hedge_that_won_from_a_failover_and_shows_time_to_first_token(
    routed: Weir, browser: Any, fake_openai: FakeOpenAI
) -> None:
    route = {
        "name": "raced",
        "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
        "hedge": {"delay": 0.05, "min_delay": 0.01},
        "breaker": None,
        "probe_interval": None,
    }
    assert routed.admin.post("/routes", json=route).status_code == 201
    fake_openai.fail_next(Fault.delay(3))  # the first candidate is slow; the hedge answers first
    stream = _client(routed).chat.completions.create(model="raced", messages=HI, max_tokens=5, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    [request] = _logged(routed.admin, 2)
    assert [(a["model"], a["status"]) for a in request["attempts"]] == [("gpt-4o-mini", 499), ("gpt-4o", 200)]
    won = request["attempts"][1]

    page = signed_in(routed, browser, "#/requests")
    detail = page.locator("main > .table-wrap > table > tbody > tr.detail").first
    detail.locator("summary").click()
    explained = detail.locator("details > p").first.inner_text()
    # Not "after 1 earlier attempt failed": the first attempt was stopped because the hedge won.
    assert (
        "attempt 2 on openai (gpt-4o) answered first, as a hedge; 1 earlier attempt still under way was cancelled"
        in explained
    )
    headers = detail.locator("thead th").all_inner_texts()
    cells = detail.locator("tbody tr").nth(1).locator("td").all_inner_texts()
    assert cells[headers.index("First token")] == f"{math.floor(won['ttft_ms'] + 0.5)} ms"  # as Math.round
    page.close()


def test_the_log_shows_an_attempts_cache_tokens_and_whether_it_was_estimated(
    routed: Weir, browser: Any, fake_openai: FakeOpenAI
) -> None:
    """A stream cut on the first candidate (billed an estimate) resumed on the second, which reads its
    prompt cache: each attempt's tokens say so, as its cost is priced (they said input/output only)."""
    route = {
        "name": "resumed",
        "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
        "breaker": None,
        "probe_interval": None,
    }
    assert routed.admin.post("/routes", json=route).status_code == 201
    fake_openai.fail_next(Fault.cut_stream(after=2))  # the role, one word
    # The cut answer takes the first (its report never arrives), the continuation the second.
    for _ in range(2):
        fake_openai.set_next_usage(input_tokens=6, cached_input_tokens=1024, output_tokens=3)
    long = [{"role": "user", "content": "one two three four five six"}]
    stream = _client(routed).chat.completions.create(model="resumed", messages=long, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    [request] = _logged(routed.admin, 2)
    cut, continued = request["attempts"]
    assert (cut["estimated"], continued["estimated"], continued["cached_input_tokens"]) == (True, False, 1024)

    page = signed_in(routed, browser, "#/requests")
    detail = page.locator("main > .table-wrap > table > tbody > tr.detail").first
    detail.locator("summary").click()
    headers = detail.locator("thead th").all_inner_texts()
    rows = detail.locator("tbody tr")
    tokens = [rows.nth(i).locator("td").all_inner_texts()[headers.index("Tokens in/out")] for i in (0, 1)]
    assert tokens[0] == f"{cut['input_tokens']}/{cut['output_tokens']}, estimated"
    assert tokens[1] == f"{continued['input_tokens']}/{continued['output_tokens']} (cached 1,024)"
    page.close()


def test_the_log_shows_the_tier_each_attempt_was_served_at(routed: Weir, browser: Any) -> None:
    """The API gives each attempt's `service_tier`, whose prices its cost is; the attempt rows showed
    none of it."""
    _client(routed).chat.completions.create(
        model="gpt-4o-mini", messages=HI, max_tokens=5, service_tier="flex"
    )
    [request] = _logged(routed.admin, 1)
    assert request["attempts"][0]["service_tier"] == "flex"

    page = signed_in(routed, browser, "#/requests")
    detail = page.locator("main > .table-wrap > table > tbody > tr.detail").first
    detail.locator("summary").click()
    headers = detail.locator("thead th").all_inner_texts()
    cells = detail.locator("tbody tr").first.locator("td").all_inner_texts()
    assert cells[headers.index("Tier")] == "flex"
    page.close()


def test_the_log_tags_the_calls_weir_made_itself(routed: Weir, browser: Any) -> None:
    """A difficulty route's comparison asks the other candidate and a judge: calls of Weir's own, each
    a request of its own in the log, listed among the client's as if one had sent them. The API says
    why Weir made each (`purpose`) and the log tags it, with what it was for in the tag's title."""
    now = dt.datetime.now(dt.UTC)
    decision = "route=auto; policy=difficulty; candidate=gpt-4o; purpose={}; for=asked"
    events = [
        usage_event("asked", ts=now, tenant_id="team", route="auto", model="gpt-4o-mini", status=200),
        *(
            usage_event(
                request_id,
                ts=now + dt.timedelta(seconds=n),
                tenant_id="team",
                route="auto",
                model="gpt-4o",
                status=200,
                routing=decision.format(purpose),
                purpose=purpose,
            )
            for n, (request_id, purpose) in enumerate((("cmp", "compare"), ("jdg", "judge")), start=1)
        ),
    ]
    engine = create_engine(routed.db_url.replace("+aiosqlite", ""))
    try:
        with engine.begin() as conn:
            conn.execute(insert(UsageEventRow), [event_row(e) for e in events])
    finally:
        engine.dispose()
    log = routed.admin.get("/requests").json()["data"]
    assert [(r["request_id"], r["purpose"]) for r in log] == [
        ("jdg", "judge"),
        ("cmp", "compare"),
        ("asked", None),
    ]

    page = signed_in(routed, browser, "#/requests")
    table = page.locator("main > .table-wrap > table")
    route = table.locator("thead th").all_inner_texts().index("Route")
    rows = table.locator(":scope > tbody > tr:not(.detail)")  # not the attempts' tables inside
    assert [rows.nth(i).locator("td").nth(route).inner_text() for i in range(3)] == [
        "auto judge",
        "auto compare",
        "auto",
    ]
    tag = rows.nth(1).locator(".tag.own")
    assert "Weir's own call" in tag.get_attribute("title") and "not counted as a client request" in (
        tag.get_attribute("title")
    )
    assert rows.nth(2).locator(".tag").count() == 0
    page.close()
