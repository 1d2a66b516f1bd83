"""The Routes and Requests pages as an admin uses them, at their edges: an edit saved unchanged keeps
every field the API took (per-candidate settings included), routes are reordered from the form, a
refusal names and marks the field and changes nothing, a form left open cannot undo another admin's
newer edit, and the request log explains each attempt (its x-weir-route decision, which one answered)
with filters that return whole requests and markup in names shown as text. Also: a double click
creates one route, a head upload keeps an open form's typed values, a number that is not finite is
refused, the preview takes metadata and a key id, Edit by keyboard moves focus into the form, a
route another admin deleted meanwhile is named as such (and leaves the list, saved or deleted), Edit
after a refused save reads the route's current version (asking first when the form was typed into),
and a page still loading when another is opened never replaces it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from gateway.auth import key_id
from gateway.db.models import RouteRow
from routing.heads import bundle
from routing.routes import Candidate, Route
from routing.store import route_spec
from tests.fakes import FakeOpenAI, Fault
from tests.routing.forced_heads import forced
from tests.ui.helpers import ANSWERS_READ, Weir, new_page, sign_in, signed_in

# The config tenant `team`'s key (tests.ui.helpers) by its id: `when.keys` takes only keys that exist.
TEAM_KEY_ID = key_id("sk-team-key")
CHEAP: dict[str, Any] = {
    "name": "auto",
    "policy": "cheapest",
    "when": {
        "tenants": ["team"],
        "metadata": {"tier": "gold"},
        "tags": ["batch"],
        "min_prompt_tokens": 2,
        "max_prompt_tokens": 9000,
        "tools": False,
        "images": False,
    },
    "candidates": [
        {"model": "gpt-4o-mini", "context_window": 128000, "cache_hit_rate": 0.5, "vision": False},
        {"model": "gpt-4o", "tools": False, "weight": 2.5, "max_output_tokens": 16384},
    ],
    "fallbacks": ["gpt-4o"],
    "retry": {"attempts": 3, "backoff": 0.1, "max_backoff": 2.0, "jitter": 0.25, "max_retry_after": 4.0},
    "failover_on": [429, 503, "5xx"],
    "ttft_timeout": 3.5,
    "hedge": {"delay": 0.4, "min_delay": 0.01, "max_spend_usd_per_hour": 0.5},
    "resume": False,
    "breaker": None,
    "probe_interval": None,
    "expected_output_tokens": 100,
}
HARD: dict[str, Any] = {
    "name": "auto",
    "policy": "difficulty",
    "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
    "threshold": 0.7,
    "strong_share": 0.3,
    "compare": {"judge": "gpt-4o", "share": 0.1, "max_spend_usd_per_hour": 2.0, "max_in_flight": 2},
    "hedge": {"delay": "p95"},
    "breaker": {"failures": 3, "cooldown": 12.0},
    "probe_interval": 7.0,
}
MINI: dict[str, Any] = {"name": "assistant", "candidates": [{"model": "gpt-4o-mini"}]}
AFFINITY: dict[str, Any] = {
    "name": "docs",
    "policy": "prefix_affinity",
    "candidates": [{"model": "gpt-4o-mini", "max_in_flight": 4, "max_waiting": 2}, {"model": "gpt-4o"}],
    "prefix_chars": 512,
    "prefix_share": 0.4,
}


def _stored(admin: httpx.Client, route_id: int) -> dict[str, Any]:
    body = admin.get(f"/routes/{route_id}").json()
    body.pop("updated_at")
    return body


def _edit(page: Any, weir: Weir, route_id: int) -> Any:
    """The edit form of that route, once the page shows it (not the one it showed before)."""
    page.goto(f"{weir.url}/admin/#/routes/{route_id}")
    page.locator("#edit h2", has_text=f"(#{route_id})").wait_for()
    return page.locator("#edit form")


def _create(admin: httpx.Client, route: dict[str, Any]) -> dict[str, Any]:
    created = admin.post("/routes", json=route)
    assert created.status_code == 201, created.text
    return created.json()


def test_saving_a_route_unchanged_keeps_every_field_and_the_form_reorders(routed: Weir, browser: Any) -> None:
    ids = [_create(routed.admin, r)["id"] for r in (CHEAP, HARD, AFFINITY)]
    before = {i: _stored(routed.admin, i) for i in ids}
    page = signed_in(routed, browser, "#/routes")
    page.get_by_role("heading", name="New route").wait_for()
    text = page.locator("main").inner_text()
    # No traffic yet: the observed-status sections say so instead of failing the page.
    assert "Something went wrong" not in text
    assert "No prefix_affinity route has had traffic" in text and "No model has answered" in text

    for route_id in ids:
        form = _edit(page, routed, route_id)
        form.get_by_role("button", name="Save route").click()
        page.get_by_role("heading", name="New route").wait_for()
        assert _stored(routed.admin, route_id) == before[route_id], route_id

    # Candidate settings are on the candidates' lines, where the admin can see and change them.
    lines = _edit(page, routed, ids[0]).get_by_label("Candidates", exact=True).input_value().splitlines()
    assert lines == [
        "gpt-4o-mini context_window=128000 vision=false cache_hit_rate=0.5",
        "gpt-4o 2.5 max_output_tokens=16384 tools=false",
    ]

    # The difficulty route goes before the cheapest one of the same name: it is tried first.
    form = _edit(page, routed, ids[1])
    form.get_by_label("Position (#)", exact=True).fill("0")
    form.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    order = [r["id"] for r in routed.admin.get("/routes").json()["data"]]
    assert order == [ids[1], ids[0], ids[2]]
    page.close()


def test_the_preview_shows_a_candidate_without_vision_skipped_for_images(routed: Weir, browser: Any) -> None:
    """The preview asks what the API can: a request with images skips `vision: false` candidates."""
    _create(
        routed.admin,
        {
            "name": "looks",
            "policy": "cheapest",
            "candidates": [{"model": "gpt-4o-mini", "vision": False}, {"model": "gpt-4o"}],
        },
    )
    page = signed_in(routed, browser, "#/routes")
    preview = page.get_by_role("form", name="Preview a prompt")
    preview.get_by_label("Model name", exact=True).fill("looks")
    preview.get_by_label("Sample prompt", exact=True).fill("What is in this picture?")
    preview.get_by_role("button", name="Preview").click()
    plan = page.locator("#preview-result ol")
    plan.wait_for()
    assert plan.locator("li").first.inner_text().startswith("gpt-4o-mini on openai")

    preview.get_by_label("request has images").check()
    preview.get_by_role("button", name="Preview").click()
    page.locator("#preview-result ol li", has_text="gpt-4o-mini").wait_for(state="detached")
    assert [li.inner_text().split(" on ")[0] for li in plan.locator("li").all()] == ["gpt-4o"]
    page.close()


def test_the_routes_page_shows_a_routes_own_latency_breaker_beside_the_shared_ones(
    routed: Weir, browser: Any, fake_openai: FakeOpenAI
) -> None:
    """`tight` gives gpt-4o-mini 0.3 s to its first token where `patient` waits as long as it takes:
    its timeout there opens a latency breaker of its own (the shared one stays closed). The page
    showed only the shared breakers, so an admin saw gpt-4o-mini closed while tight skipped it."""
    patient = {"name": "patient", "probe_interval": None, "candidates": [{"model": "gpt-4o-mini"}]}
    tight = {
        "name": "tight",
        "ttft_timeout": 0.3,
        "retry": {"attempts": 1},
        "breaker": {"failures": 1, "cooldown": 30},
        "probe_interval": None,
        "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
    }
    for route in (patient, tight):
        _create(routed.admin, route)
    page = signed_in(routed, browser, "#/routes")
    page.get_by_role("heading", name="Circuit breakers").wait_for()
    assert page.get_by_role("columnheader", name="Latency breaker", exact=True).count() == 0  # none yet
    page.close()

    fake_openai.fail_next(Fault.delay(3))  # gpt-4o-mini too slow for tight, once
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    stream = client.chat.completions.create(
        model="tight", messages=[{"role": "user", "content": "hello"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    page = signed_in(routed, browser, "#/routes")
    page.get_by_role("heading", name="Circuit breakers").wait_for()
    rows = page.locator(
        "table", has=page.get_by_role("columnheader", name="Latency breaker", exact=True)
    ).locator("tbody tr")
    rows.first.wait_for()
    assert [row.locator("td").all_inner_texts() for row in rows.all()] == [
        ["tight", "openai/gpt-4o-mini", "open"]
    ]
    shared = page.locator("table", has=page.get_by_role("columnheader", name="State", exact=True)).locator(
        "tbody tr"
    )
    assert shared.filter(has_text="openai/gpt-4o-mini").locator("td").all_inner_texts() == [
        "openai/gpt-4o-mini",
        "closed",
    ]
    page.close()


def test_a_refused_edit_says_why_marks_the_field_and_changes_nothing(routed: Weir, browser: Any) -> None:
    route_id = _create(routed.admin, CHEAP)["id"]
    before = _stored(routed.admin, route_id)
    page = signed_in(routed, browser, f"#/routes/{route_id}")
    form = page.locator("#edit form")
    advanced = form.get_by_label("Advanced (JSON)", exact=True)
    advanced.wait_for()
    error = form.locator(".form-error")

    settings = advanced.input_value().replace('"jitter": 0.25', '"jitter": 2')
    assert '"jitter": 2' in settings
    advanced.fill(settings)
    form.get_by_role("button", name="Save route").click()
    error.wait_for()
    assert "retry.jitter" in error.inner_text()
    assert advanced.get_attribute("aria-invalid") == "true"  # the box that holds retry
    assert _stored(routed.admin, route_id) == before

    advanced.fill(settings.replace('"jitter": 2', '"jitter": 0.25'))
    fallbacks = form.get_by_label("Fallbacks", exact=True)
    fallbacks.fill("gpt-4o, no-such-model")
    form.get_by_role("button", name="Save route").click()
    form.locator("[name=fallbacks][aria-invalid=true]").wait_for()  # the field the unknown model is in
    assert "no-such-model" in error.inner_text()
    assert form.get_by_label("Candidates", exact=True).get_attribute("aria-invalid") is None
    assert _stored(routed.admin, route_id) == before
    page.close()


def test_a_form_left_open_cannot_undo_a_newer_edit(routed: Weir, browser: Any) -> None:
    route_id = _create(routed.admin, {"name": "assistant", "candidates": [{"model": "gpt-4o-mini"}]})["id"]
    page = signed_in(routed, browser, f"#/routes/{route_id}")
    form = page.locator("#edit form")
    form.get_by_label("Fallbacks", exact=True).wait_for()

    # Another admin moves the route to gpt-4o meanwhile.
    read = routed.admin.get(f"/routes/{route_id}").json()
    newer = routed.admin.put(f"/routes/{route_id}", json={**read, "candidates": [{"model": "gpt-4o"}]})
    assert newer.status_code == 200, newer.text

    form.get_by_label("Fallbacks", exact=True).fill("gpt-4o")
    form.get_by_role("button", name="Save route").click()
    error = form.locator(".form-error")
    error.wait_for()
    assert "changed" in error.inner_text() and "reload" in error.inner_text()
    assert routed.admin.get(f"/routes/{route_id}").json()["candidates"][0]["model"] == "gpt-4o"

    # Deleting from the list read before the change is refused too, and says why.
    page.get_by_role("button", name=f"Delete route assistant #{route_id}").click()
    page.locator("#routes-message .notice").wait_for()
    assert "changed" in page.locator("#routes-message").inner_text()
    assert routed.admin.get(f"/routes/{route_id}").status_code == 200

    # Over the API: If-Match with what was read guards a write; without it the last write wins.
    stale = routed.admin.put(
        f"/routes/{route_id}", json=read, headers={"if-match": f'"{read["updated_at"]}"'}
    )
    assert stale.status_code == 412 and stale.json()["error"]["code"] == "route_changed", stale.text
    current = newer.json()["updated_at"]
    fresh = routed.admin.put(f"/routes/{route_id}", json=newer.json(), headers={"if-match": f'"{current}"'})
    assert fresh.status_code == 200, fresh.text

    # Read again, the page has the current route and both work.
    page.goto(f"{routed.url}/admin/#/routes")
    page.get_by_role("heading", name="New route").wait_for()
    page.get_by_role("button", name=f"Delete route assistant #{route_id}").click()
    page.get_by_text("No routes yet").wait_for()
    assert routed.admin.get(f"/routes/{route_id}").status_code == 404
    page.close()


def test_the_request_log_explains_each_attempt_and_filters_whole_requests(
    routed: Weir, browser: Any, fake_openai: FakeOpenAI
) -> None:
    evil = "<img src=x onerror=window.__xss=1>"
    route_name = "<i>helper</i>"
    _create(
        routed.admin,
        {
            "name": route_name,
            "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
            "retry": {"attempts": 1},
        },
    )
    tenant = routed.admin.post("/tenants", json={"name": evil}).json()
    key = routed.admin.post(f"/tenants/{tenant['id']}/keys", json={}).json()["key"]
    fake_openai.fail_next(500)  # the first candidate fails; the second answers
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key=key, max_retries=0, timeout=20)
    client.chat.completions.create(
        model=route_name, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    deadline = time.monotonic() + 15
    while not (log := routed.admin.get("/requests").json()["data"]) or len(log[0]["attempts"]) < 2:
        assert time.monotonic() < deadline, log
        time.sleep(0.1)
    attempts = log[0]["attempts"]
    assert [a["status"] for a in attempts] == [500, 200] and attempts[0]["routing"] != attempts[1]["routing"]

    page = signed_in(routed, browser, "#/requests")
    rows = page.locator("main > .table-wrap > table > tbody > tr.has-detail")
    rows.first.wait_for()
    assert rows.count() == 1
    cells = rows.first.locator("td").all_inner_texts()
    assert cells[1] == evil and cells[2] == route_name  # names shown as text, never as markup
    assert page.evaluate("window.__xss") is None and page.locator("main img, main i").count() == 0

    detail = page.locator("main > .table-wrap > table > tbody > tr.detail").first
    detail.locator("summary").click()
    explained = detail.locator("details > p").first.inner_text()
    assert "attempt 2 on openai (gpt-4o) answered after 1 earlier attempt failed" in explained
    headers = detail.locator("thead th").all_inner_texts()
    decision = headers.index("Decision (x-weir-route)")
    status = headers.index("Status")
    tried = detail.locator("tbody tr")
    for i, attempt in enumerate(attempts):
        row = tried.nth(i).locator("td").all_inner_texts()
        assert row[decision] == attempt["routing"], (i, row)
    assert tried.nth(0).locator("td").all_inner_texts()[status] == "500"
    assert tried.nth(1).locator("td").all_inner_texts()[status] == "200 (answered)"

    # Filtering by the model of the failed attempt still shows the whole request: it succeeded.
    for model in ("gpt-4o-mini", route_name):
        shown = page.locator("main > .table-wrap").element_handle()
        page.get_by_label("Model", exact=True).fill(model)
        page.get_by_role("button", name="Filter").click()
        page.wait_for_function("el => !el.isConnected", arg=shown)  # rendered again, filtered
        rows = page.locator("main > .table-wrap > table > tbody > tr.has-detail")
        rows.first.wait_for()
        assert rows.count() == 1, model
        cells = rows.first.locator("td").all_inner_texts()
        assert cells[4] == "200" and cells[6] == "2", (model, cells)
    page.close()


def _store_as_another_config_did(db_url: str, route: Route) -> int:
    """A route row written straight to the admin DB, as a replica whose config still had its models
    stored it: this gateway's next poll finds it."""
    engine = create_engine(db_url.replace("+aiosqlite", ""))
    try:
        with Session(engine) as session, session.begin():
            row = RouteRow(name=route.name, position=5, spec=route_spec(route))
            session.add(row)
            session.flush()
            return row.id
    finally:
        engine.dispose()


def test_the_routes_page_warns_of_routes_this_replica_leaves_out_until_they_are_fixed(
    routed: Weir, browser: Any, shots: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored route naming a model this gateway's config lacks is left out: the routes page listed it
    like any other, so the admin who must fix it had no sign of it (only routes/status, a log line and a
    gauge did). The page now warns above the table with the reason, marks the row, and the warning goes
    once the route is fixed; a table refused as a whole is shown the same way until it loads."""
    _create(routed.admin, {"name": "assistant", "candidates": [{"model": "gpt-4o-mini"}]})
    legacy = _store_as_another_config_did(
        routed.db_url, Route(name="legacy", candidates=[Candidate(model="gpt-3.5")])
    )
    deadline = time.monotonic() + 10  # this replica's next poll of the table (every second)
    while not routed.admin.get("/routes").json()["left_out"]:
        assert time.monotonic() < deadline, "the gateway never loaded the new row"
        time.sleep(0.1)

    page = signed_in(routed, browser, "#/routes")
    banner = page.locator("#routes-not-in-force")
    banner.wait_for()
    assert banner.get_attribute("role") == "alert"
    text = banner.inner_text()
    assert "1 stored route is left out by this replica" in text
    assert f"legacy #{legacy}: routes[0] (legacy): no model named 'gpt-3.5'" in text, text
    assert "refused" not in text
    row = page.locator("tbody tr", has=page.get_by_role("link", name=f"Edit route legacy #{legacy}"))
    assert row.get_attribute("class") == "left-out" and "left out" in row.inner_text()
    served = page.locator("tbody tr", has=page.get_by_role("link", name="Edit route assistant #1"))
    assert served.get_attribute("class") is None and "left out" not in served.inner_text()
    page.screenshot(path=shots / "13-routes-left-out.png", full_page=True)

    banner.get_by_role("link", name=f"legacy #{legacy}").click()
    page.locator("#edit h2", has_text=f"(#{legacy})").wait_for()
    assert "no model named 'gpt-3.5'" in page.locator("#edit .notice.warning").inner_text()
    form = page.locator("#edit form")
    form.get_by_label("Candidates", exact=True).fill("gpt-4o")
    form.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    page.get_by_role("link", name=f"Edit route legacy #{legacy}").wait_for()
    assert banner.count() == 0 and page.locator("tr.left-out").count() == 0

    # Refused as a whole: what no single row breaks (a stand-in rule across rows; the router's own
    # checks are all per row today), the routes loaded before stay in force.
    store = routed.router.store
    assert store is not None
    apply = store.apply

    def refusing(routes: Any) -> None:
        if any(r.name == "refused" for r in routes):
            raise ValueError("a stand-in rule refused the table")
        apply(routes)

    monkeypatch.setattr(store, "apply", refusing)
    assert (
        routed.admin.post(
            "/routes", json={"name": "refused", "candidates": [{"model": "gpt-4o"}]}
        ).status_code
        == 409
    )
    page.reload()
    banner.wait_for()
    text = banner.inner_text()
    assert "This replica refused the routes table" in text and "a stand-in rule refused the table" in text
    assert "left out by this replica" not in text
    page.get_by_role("button", name="Delete route refused #").click()  # the dialog is accepted
    banner.wait_for(state="detached")
    assert page.get_by_role("link", name="Edit route refused #").count() == 0
    page.close()


def test_saving_a_route_another_admin_deleted_says_so_and_takes_it_off_the_list(
    routed: Weir, browser: Any
) -> None:
    """The PUT answers 404 with param `route_id`, no field of the form: the page says so above the
    list, which it reloads without the route (it kept listing it, with its form open), and no field
    (the Advanced JSON box least of all) is marked as if a setting in it were wrong."""
    route_id = _create(routed.admin, MINI)["id"]
    page = signed_in(routed, browser, "#/routes")
    form = _edit(page, routed, route_id)
    assert routed.admin.delete(f"/routes/{route_id}").status_code == 204  # another admin, meanwhile

    form.get_by_role("button", name="Save route").click()
    alert = page.locator("#routes-message").get_by_role("alert")
    alert.wait_for()
    assert f"no route with id {route_id}" in alert.inner_text()
    assert page.get_by_role("link", name=f"Edit route assistant #{route_id}").count() == 0
    assert page.locator("#edit").count() == 0 and page.locator("main [aria-invalid]").count() == 0
    page.get_by_role("heading", name="New route").wait_for()
    page.close()


def test_edit_after_a_refused_save_fills_the_form_with_the_current_version(
    routed: Weir, browser: Any
) -> None:
    """A save refused because another admin changed the route (412) says to reload it: the route's
    Edit link, whose address is the one already shown, reads it again (it did nothing), and the
    change then saves on top of the other admin's."""
    route_id = _create(routed.admin, MINI)["id"]
    page = signed_in(routed, browser, "#/routes")
    form = _edit(page, routed, route_id)
    read = routed.admin.get(f"/routes/{route_id}").json()
    newer = routed.admin.put(f"/routes/{route_id}", json={**read, "candidates": [{"model": "gpt-4o"}]})
    assert newer.status_code == 200, newer.text  # another admin, meanwhile

    form.get_by_label("Fallbacks", exact=True).fill("gpt-4o-mini")
    form.get_by_role("button", name="Save route").click()
    form.locator(".form-error").wait_for()
    assert "changed" in form.locator(".form-error").inner_text()

    refused = form.element_handle()
    page.get_by_role("link", name=f"Edit route assistant #{route_id}").click()
    page.wait_for_function("el => !el.isConnected", arg=refused)  # the form, built again
    assert form.get_by_label("Candidates", exact=True).input_value() == "gpt-4o"
    assert form.locator(".form-error").is_hidden()
    form.get_by_label("Fallbacks", exact=True).fill("gpt-4o-mini")
    form.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    stored = _stored(routed.admin, route_id)
    assert ([c["model"] for c in stored["candidates"]], stored["fallbacks"]) == (["gpt-4o"], ["gpt-4o-mini"])
    page.close()


# Each answer the page read, by address, pushed once its body is parsed. What a render does with its
# last answer runs in the same microtask checkpoint, so once a wait sees every answer read, every
# render under way has written the page or given up.
def test_the_edit_link_of_the_open_form_asks_before_it_discards_what_was_typed(
    routed: Weir, browser: Any
) -> None:
    """The Edit link of the route whose form is open renders the page again (after a refused save,
    that reads the route's current version): it threw away what the admin had typed into the form,
    unasked. A form typed into is now asked about first: declined, it keeps what was typed; accepted,
    the route is read again. A form not typed into is read again without a question."""
    route_id = _create(routed.admin, MINI)["id"]
    page = signed_in(routed, browser, "#/routes", accept_dialogs=False)
    asked: list[str] = []
    answers = [False, True]  # decline, then accept

    def answer(dialog: Any) -> None:
        asked.append(dialog.message)
        if answers.pop(0):
            dialog.accept()
        else:
            dialog.dismiss()

    page.on("dialog", answer)
    form = _edit(page, routed, route_id)
    edit = page.get_by_role("link", name=f"Edit route assistant #{route_id}")

    untyped = form.element_handle()
    edit.click()
    page.wait_for_function("el => !el.isConnected", arg=untyped)  # read again
    assert asked == []

    form.get_by_label("Fallbacks", exact=True).fill("gpt-4o")
    typed = form.element_handle()
    edit.click()
    page.wait_for_load_state("networkidle")
    assert asked == ["Discard what you typed and show this page as it is now?"]
    assert typed.evaluate("el => el.isConnected")
    assert form.get_by_label("Fallbacks", exact=True).input_value() == "gpt-4o"

    edit.click()
    page.wait_for_function("el => !el.isConnected", arg=typed)
    assert len(asked) == 2 and form.get_by_label("Fallbacks", exact=True).input_value() == ""
    page.close()


def test_a_page_still_loading_when_another_is_opened_never_replaces_it(routed: Weir, browser: Any) -> None:
    """Signing in renders the page the address names; opening a route's edit form before that render
    has its answers starts a second render. The first, answered last, replaced the page the admin
    was on, and the form they had begun to fill, with the routes list; now a render that a later one
    has superseded writes nothing."""
    route_id = _create(routed.admin, MINI)["id"]
    page = new_page(browser)
    page.add_init_script(ANSWERS_READ)
    asked: list[str] = []  # every answer the page asked the gateway for (session and admin API)

    def ask(request: Any) -> None:
        if "/admin/session" in request.url:
            asked.append(request.url)

    page.on("request", ask)
    held: list[Any] = []  # the sign-in render's last request, answered once the edit form is filled

    def hold_the_first(request_route: Any) -> None:
        if held:
            request_route.continue_()
        else:
            held.append(request_route)

    page.route(lambda url: "/api/v1/audit?" in url, hold_the_first)
    with page.expect_request(lambda r: "/api/v1/audit?" in r.url):
        sign_in(page, routed, "#/routes")
    form = _edit(page, routed, route_id)
    form.get_by_label("Fallbacks", exact=True).fill("gpt-4o")

    held[0].continue_()
    page.wait_for_function("n => window.__answersRead.length >= n", arg=len(asked))
    assert page.locator("#edit h2", has_text=f"(#{route_id})").count() == 1
    assert page.get_by_role("heading", name="New route").count() == 0
    assert form.get_by_label("Fallbacks", exact=True).input_value() == "gpt-4o"
    form.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    assert _stored(routed.admin, route_id)["fallbacks"] == ["gpt-4o"]
    page.close()


def test_deleting_a_route_another_admin_deleted_takes_it_off_the_list(routed: Weir, browser: Any) -> None:
    """Delete answers 404: the page says so and reloads the list, which no longer has the route."""
    route_id = _create(routed.admin, MINI)["id"]
    page = signed_in(routed, browser, "#/routes")
    delete = page.get_by_role("button", name=f"Delete route assistant #{route_id}")
    delete.wait_for()
    assert routed.admin.delete(f"/routes/{route_id}").status_code == 204  # another admin, meanwhile

    delete.click()  # signed_in accepts the confirmation dialog
    delete.wait_for(state="detached")
    alert = page.locator("#routes-message").get_by_role("alert")
    alert.wait_for()
    assert f"no route with id {route_id}" in alert.inner_text()
    assert page.get_by_role("link", name=f"Edit route assistant #{route_id}").count() == 0
    page.close()


def test_the_preview_matches_a_route_by_the_requests_metadata_and_key(routed: Weir, browser: Any) -> None:
    """A route with `when.metadata`, `when.tags` and `when.keys` matches in the preview once its
    Metadata (key=value lines, tags comma separated) and Key id fields say what the request carries."""
    _create(
        routed.admin,
        {
            "name": "gpt-4o",  # unmatched, a request goes to the model itself
            "when": {"metadata": {"tier": "gold"}, "tags": ["batch"], "keys": [TEAM_KEY_ID]},
            "candidates": [{"model": "gpt-4o-mini"}],
        },
    )
    page = signed_in(routed, browser, "#/routes")
    preview = page.get_by_role("form", name="Preview a prompt")
    preview.get_by_label("Model name", exact=True).fill("gpt-4o")
    preview.get_by_label("Sample prompt", exact=True).fill("hello")
    result = page.locator("#preview-result")

    preview.get_by_role("button", name="Preview").click()
    result.get_by_text("No route matches").wait_for()

    preview.get_by_label("Metadata", exact=True).fill("tier=gold\ntags=batch,eu")
    preview.get_by_label("Key id", exact=True).fill(TEAM_KEY_ID)
    preview.get_by_role("button", name="Preview").click()
    result.get_by_text("Route gpt-4o (policy fixed) matches.").wait_for()

    preview.get_by_label("Metadata", exact=True).fill("tier")  # no "=": refused at the form
    preview.get_by_role("button", name="Preview").click()
    preview.locator("[name=metadata][aria-invalid=true]").wait_for()
    assert 'Metadata line "tier"' in preview.locator(".form-error").inner_text()
    page.close()


def test_the_preview_takes_metadata_as_a_json_object(routed: Weir, browser: Any) -> None:
    """The Metadata field also takes the request's metadata as a client sends it, a JSON object of
    strings (it took key=value lines only); a value that is not a string is refused at the form."""
    _create(
        routed.admin,
        {
            "name": "gpt-4o",
            "when": {"metadata": {"tier": "gold"}, "tags": ["eu"]},
            "candidates": [{"model": "gpt-4o-mini"}],
        },
    )
    page = signed_in(routed, browser, "#/routes")
    preview = page.get_by_role("form", name="Preview a prompt")
    preview.get_by_label("Model name", exact=True).fill("gpt-4o")
    preview.get_by_label("Sample prompt", exact=True).fill("hello")
    metadata = preview.get_by_label("Metadata", exact=True)

    metadata.fill('{"tier": "gold", "tags": "batch, eu"}')
    preview.get_by_role("button", name="Preview").click()
    page.locator("#preview-result").get_by_text("Route gpt-4o (policy fixed) matches.").wait_for()

    metadata.fill('{"tier": "gold", "tags": ["eu"]}')
    preview.get_by_role("button", name="Preview").click()
    preview.locator("[name=metadata][aria-invalid=true]").wait_for()
    assert 'Metadata "tags": write its value as a string' in preview.locator(".form-error").inner_text()
    page.close()


def test_editing_a_route_with_the_keyboard_moves_focus_into_its_form(routed: Weir, browser: Any) -> None:
    """Enter on a row's Edit link focuses the edit form's heading: the next Tab lands in the form,
    not on the first link of the routes table."""
    ids = [_create(routed.admin, {**MINI, "name": f"r{i}"})["id"] for i in range(3)]
    page = signed_in(routed, browser, "#/routes")
    edit = page.get_by_role("link", name=f"Edit route r2 #{ids[2]}")
    edit.focus()
    page.keyboard.press("Enter")
    page.locator("#edit h2", has_text=f"(#{ids[2]})").wait_for()
    page.keyboard.press("Tab")
    inside = page.evaluate("() => !!document.getElementById('edit')?.contains(document.activeElement)")
    assert inside, "after opening the edit form by keyboard, Tab should land in it"
    page.close()


def test_uploading_a_head_keeps_the_route_being_edited(routed: Weir, browser: Any) -> None:
    """Uploading a head (as the Difficulty head field suggests) renders the heads section and the
    field's list again, not the open edit form: what the admin typed stays, and the new head is
    there to pick and save."""
    route_id = _create(
        routed.admin,
        {
            "name": "auto",
            "policy": "difficulty",
            "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
        },
    )["id"]
    page = signed_in(routed, browser, "#/routes")
    form = _edit(page, routed, route_id)
    form.get_by_label("Difficulty threshold", exact=True).fill("0.9")
    form.get_by_label("Fallbacks", exact=True).fill("gpt-4o")

    upload = page.get_by_role("form", name="Upload a difficulty head")
    upload.get_by_label("Head name", exact=True).fill("acme-v1")
    upload.get_by_label("Head file", exact=True).set_input_files(
        files=[
            {
                "name": "acme-v1.safetensors",
                "mimeType": "application/octet-stream",
                "buffer": bundle(forced(8.0)),
            }
        ]
    )
    upload.get_by_role("button", name="Upload head").click()
    page.get_by_text("Stored difficulty head acme-v1").wait_for()
    assert page.locator("#heads").get_by_role("cell", name="acme-v1", exact=True).count() == 1
    assert form.get_by_label("Difficulty threshold", exact=True).input_value() == "0.9"
    assert form.get_by_label("Fallbacks", exact=True).input_value() == "gpt-4o"

    form.get_by_label("Difficulty head", exact=True).select_option("acme-v1")
    form.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    stored = _stored(routed.admin, route_id)
    assert (stored["threshold"], stored["fallbacks"], stored["head"]) == (0.9, ["gpt-4o"], "acme-v1")
    page.close()


@pytest.mark.parametrize("typed", ["1e999", "Infinity"])
def test_a_first_token_timeout_that_is_no_finite_number_is_refused(
    routed: Weir, browser: Any, typed: str
) -> None:
    """A timeout that is no finite number is refused at the form; it would reach the API as null,
    saving the route with no first-token timeout at all."""
    route_id = _create(routed.admin, {**MINI, "ttft_timeout": 3.0})["id"]
    page = signed_in(routed, browser, "#/routes")
    form = _edit(page, routed, route_id)
    form.get_by_label("First-token timeout (s)", exact=True).fill(typed)
    form.get_by_role("button", name="Save route").click()
    form.locator("[name=ttft_timeout][aria-invalid=true]").wait_for()
    assert routed.admin.get(f"/routes/{route_id}").json()["ttft_timeout"] == 3.0
    page.close()


def test_clearing_position_on_edit_keeps_it_as_its_placeholder_says(routed: Weir, browser: Any) -> None:
    """On an edit an empty Position is left out of the PUT, which keeps the stored position: its
    placeholder says "unchanged" (a new route's says "after the others")."""
    ids = [_create(routed.admin, {**MINI, "position": p})["id"] for p in (1, 2, 3)]
    page = signed_in(routed, browser, "#/routes")
    new = page.get_by_role("form", name="Create a route").get_by_label("Position (#)", exact=True)
    assert new.get_attribute("placeholder") == "after the others"
    form = _edit(page, routed, ids[0])
    position = form.get_by_label("Position (#)", exact=True)
    position.fill("")
    assert position.get_attribute("placeholder") == "unchanged"
    form.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    assert [r["id"] for r in routed.admin.get("/routes").json()["data"]] == ids
    page.close()


def test_a_double_click_on_create_route_creates_one_route(routed: Weir, browser: Any) -> None:
    """The submit button is disabled while the POST is under way (a create carries no If-Match to
    refuse a second one): an impatient double click stores the route once."""
    page = signed_in(routed, browser, "#/routes")
    form = page.get_by_role("form", name="Create a route")
    form.get_by_label("Public model name", exact=True).fill("assistant")
    form.get_by_label("Candidates", exact=True).fill("gpt-4o-mini")
    form.get_by_role("button", name="Create route").dblclick()
    page.get_by_role("cell", name="assistant", exact=True).first.wait_for()
    deadline = time.monotonic() + 2  # let a second POST, if one was sent, land before counting
    while time.monotonic() < deadline and len(routed.admin.get("/routes").json()["data"]) < 2:
        time.sleep(0.1)
    assert [r["name"] for r in routed.admin.get("/routes").json()["data"]] == ["assistant"]
    page.close()


def test_a_candidate_shows_the_output_limit_it_inherits_from_its_model(limited: Weir, browser: Any) -> None:
    """A candidate's line shows its own max_output_tokens; one without takes its model's
    (`models[].max_output_tokens`, config only), which the form did not show, so an admin could not
    see what applies. The form now says it under the lines, as the model's, and keeps it current as
    the lines are edited; saving writes nothing of it into the route."""
    limits = limited.admin.get("/routes").json()["model_max_output_tokens"]
    assert limits == {"gpt-4o-mini": 16384, "gpt-4o": 8192}
    route = _create(
        limited.admin,
        {
            "name": "capped",
            "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o", "max_output_tokens": 4096}],
        },
    )
    before = _stored(limited.admin, route["id"])
    page = signed_in(limited, browser, "#/routes")
    form = _edit(page, limited, route["id"])
    candidates = form.get_by_label("Candidates", exact=True)
    assert candidates.input_value().splitlines() == ["gpt-4o-mini", "gpt-4o max_output_tokens=4096"]
    hint = form.locator(".field", has=page.get_by_label("Candidates", exact=True)).locator(".hint[aria-live]")
    assert hint.inner_text() == "Inherited: gpt-4o-mini max_output_tokens 16384 (model)."

    # Without its own limit, gpt-4o has its model's too; a fallback always has its model's.
    candidates.fill("gpt-4o-mini max_output_tokens=1000\ngpt-4o")
    assert hint.inner_text() == "Inherited: gpt-4o max_output_tokens 8192 (model)."
    form.get_by_label("Fallbacks", exact=True).fill("gpt-4o-mini")
    assert hint.inner_text() == (
        "Inherited: gpt-4o max_output_tokens 8192 (model), gpt-4o-mini max_output_tokens 16384 (model)."
    )

    # Saved unchanged, the route keeps only the limit it sets itself.
    page.goto(f"{limited.url}/admin/#/routes")  # the typed lines discarded (the dialog accepted)
    page.get_by_role("heading", name="New route").wait_for()
    form = _edit(page, limited, route["id"])
    assert candidates.input_value().splitlines() == ["gpt-4o-mini", "gpt-4o max_output_tokens=4096"]
    form.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    assert _stored(limited.admin, route["id"]) == before
    page.close()
