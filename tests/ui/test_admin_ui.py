"""An admin's session in the browser: sign in, create a tenant and a key, use the key with the openai
SDK, read the overview, finance (totals and CSV against the API) and request log, revoke the key and see
it refused. Screenshots of every page land in test-artifacts/ui/."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.admin import ui
from tests.fakes import FakeOpenAI, Fault
from tests.ui.helpers import ADMIN, ANSWERS_READ, Weir, new_page, sign_in, signed_in, usd


def wait_for_ledger(weir: Weir, requests: int, timeout: float = 15, attempts: int = 0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        report = weir.admin.get("/reports/usage", params={"group_by": "tenant"}).json()
        written = report["totals"]["requests"] >= requests and report["totals"]["attempts"] >= attempts
        if written or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def test_admin_session_in_the_browser(weir: Weir, browser: Any, shots: Path) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)))
    # Refused calls (the first session check, the wrong token) log "Failed to load resource": expected.
    page.on(
        "console",
        lambda msg: (
            msg.type == "error"
            and not msg.text.startswith("Failed to load resource")
            and page_errors.append(msg.text)
        ),
    )

    # Sign-in: a wrong token says so; the right one opens the overview's empty state.
    page.goto(f"{weir.url}/admin")
    page.get_by_label("Admin token", exact=True).fill("wrong-token")
    page.get_by_role("button", name="Sign in with token").click()
    assert "wrong admin token" in page.get_by_role("alert").first.inner_text()
    page.screenshot(path=shots / "01-sign-in.png")
    page.get_by_label("Admin token", exact=True).fill(ADMIN)
    page.keyboard.press("Enter")  # keyboard only
    page.get_by_role("heading", name="Overview").wait_for()
    assert "No traffic yet" in page.locator("main").inner_text()

    # Tenants and keys: create, issue a key (shown once), use it through the SDK.
    page.get_by_role("link", name="Tenants & keys").click()
    page.get_by_label("Name", exact=True).fill("acme")
    page.get_by_label("Monthly budget (USD)", exact=True).fill("abc")
    page.get_by_role("button", name="Create tenant").click()
    error = page.locator("form .form-error")
    error.wait_for()
    # In words, not msgspec's "Invalid decimal string - at `$.budget_usd_monthly`"; the field marked.
    assert error.inner_text().startswith("Enter a monthly budget in USD as a plain number"), (
        error.inner_text()
    )
    assert page.get_by_label("Monthly budget (USD)", exact=True).get_attribute("aria-invalid") == "true"
    page.get_by_label("Monthly budget (USD)", exact=True).fill("5")
    page.get_by_role("button", name="Create tenant").click()
    page.get_by_role("heading", name="Keys of acme").wait_for()
    keys = page.locator("#keys")
    keys.get_by_label("Key name", exact=True).fill("backend")
    keys.get_by_label("Monthly budget (USD)", exact=True).fill("2")
    keys.get_by_label("Requests per minute", exact=True).fill("600")
    keys.get_by_role("button", name="Issue key").click()
    key = page.locator("#new-key-value").inner_text()
    assert key.startswith("wk-")
    # The key list shows the key's own budget and rate limits, compactly.
    listed = page.locator("#keys table")
    listed.wait_for()
    heads = listed.locator("thead th").all_inner_texts()
    cells = listed.locator("tbody tr").first.locator("td").all_inner_texts()
    assert cells[heads.index("Own limits")] == "$2.00/month · 600 rpm"
    assert page.locator("#new-key").get_by_role("button", name="Copy").is_visible()
    page.screenshot(path=shots / "02-tenants-and-keys.png", full_page=True)

    client = openai.OpenAI(base_url=f"{weir.url}/v1", api_key=key, max_retries=0, timeout=20)
    for prompt in ("hello", "what is a weir?", "tell me a story about rivers"):
        reply = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": prompt}], max_tokens=40
        )
        assert reply.choices[0].message.content
    report = wait_for_ledger(weir, 3)
    assert report["totals"]["requests"] == 3

    # Overview with traffic.
    page.get_by_role("link", name="Overview").click()
    page.get_by_text("Spend this month").wait_for()
    page.wait_for_selector("figure.chart canvas")
    assert page.locator(".stat", has_text="Requests (30 days)").locator(".stat-value").inner_text() == "3"
    page.screenshot(path=shots / "03-overview.png", full_page=True)

    # Finance: totals match the API exactly, and the CSV is the API's CSV.
    page.get_by_role("link", name="Finance").click()
    page.get_by_role("button", name="Show report").wait_for()
    api = weir.admin.get("/reports/usage", params={"group_by": "tenant,model"}).json()
    footer = page.locator("tfoot .cost")
    assert footer.get_attribute("data-usd") == api["totals"]["cost_usd"]
    assert footer.inner_text() == usd(api["totals"]["cost_usd"])
    assert float(api["totals"]["cost_usd"]) > 0
    page.wait_for_selector("figure.chart canvas")
    page.screenshot(path=shots / "04-finance.png", full_page=True)
    with page.expect_download() as download:
        page.get_by_role("link", name="Download CSV").click()
    csv_path = shots / "finance.csv"
    download.value.save_as(csv_path)
    expected = weir.admin.get("/reports/usage", params={"group_by": "tenant,model", "format": "csv"})
    assert csv_path.read_bytes() == expected.content
    assert b"acme" in expected.content

    # Requests: the log shows all three with their attempts.
    page.get_by_role("link", name="Requests").click()
    page.get_by_role("button", name="Filter").wait_for()
    rows = page.locator("main > .table-wrap > table > tbody > tr.has-detail")
    rows.first.wait_for()
    assert rows.count() == 3
    details = page.locator("main > .table-wrap > table > tbody > tr.detail")
    details.first.locator("summary").click()
    explained = details.first.locator("details").inner_text()
    assert "openai" in explained and "policy=" in explained  # the x-weir-route decision
    page.get_by_label("Status", exact=True).select_option("error")
    page.get_by_role("button", name="Filter").click()
    page.get_by_text("No requests match").wait_for()
    page.get_by_label("Status", exact=True).select_option("")
    page.get_by_role("button", name="Filter").click()
    page.locator("main > .table-wrap").wait_for()
    page.locator("main > .table-wrap > table > tbody > tr.detail").first.locator("summary").click()
    page.screenshot(path=shots / "05-requests.png", full_page=True)

    page.get_by_role("link", name="Backends & models").click()
    page.get_by_role("heading", name="Prices in effect").wait_for()
    assert "gpt-4o-mini" in page.locator("main").inner_text()
    page.screenshot(path=shots / "06-backends.png", full_page=True)

    page.get_by_role("link", name="Routes").click()
    page.get_by_role("heading", name="Routes").wait_for()
    page.screenshot(path=shots / "07-routes.png", full_page=True)

    # Revoke: the key is refused at once; the audit log names the signed-in user.
    page.get_by_role("link", name="Tenants & keys").click()
    page.get_by_role("link", name="acme").click()
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Revoke key backend").click()
    page.get_by_text("revoked", exact=False).first.wait_for()
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    audit = weir.admin.get("/audit", params={"entity": "key"}).json()["data"]
    assert [(a["action"], a["actor"]) for a in audit][:2] == [
        ("revoke", "ui:admin-token"),
        ("create", "ui:admin-token"),
    ]

    # Phone width: the tenants page still reads.
    page.set_viewport_size({"width": 390, "height": 844})
    page.screenshot(path=shots / "08-tenants-phone.png", full_page=True)

    page.get_by_role("button", name="Sign out").click()
    page.get_by_role("heading", name="Sign in to Weir").wait_for()
    assert page_errors == []
    context.close()


def test_a_new_key_is_shown_when_the_admin_opens_another_page_as_it_is_issued(
    weir: Weir, browser: Any
) -> None:
    """A key is shown only once. The UI issued it, rendered the tenant's page again and then wrote
    the key into that page: when the admin opened another page before that render had its answers,
    the newer render took the page, there was no place for the key, and it was never shown (the
    admin had to revoke it and issue another). It is now shown outside the page, whatever page
    renders, until the admin clears it."""
    tenant = weir.admin.post("/tenants", json={"name": "acme"}).json()
    page = new_page(browser)
    page.add_init_script(ANSWERS_READ)
    asked: list[str] = []  # every answer the page asked the gateway for (session and admin API)
    page.on("request", lambda request: "/admin/session" in request.url and asked.append(request.url))
    sign_in(page, weir, f"#/tenants/{tenant['id']}")
    page.get_by_role("heading", name="Keys of acme").wait_for()
    page.wait_for_load_state("networkidle")
    held: list[Any] = []  # the key list the tenant's page asks for again after the issue

    def hold_the_list(request_route: Any) -> None:
        if request_route.request.method == "GET" and not held:
            held.append(request_route)
        else:
            request_route.continue_()

    keys_url = f"/tenants/{tenant['id']}/keys"
    page.route(lambda url: url.endswith(keys_url), hold_the_list)
    with page.expect_request(lambda r: r.url.endswith(keys_url) and r.method == "GET"):
        page.locator("#keys").get_by_role("button", name="Issue key").click()
    page.get_by_role("link", name="Overview").click()  # while the tenant's page still loads
    page.get_by_role("heading", name="Overview").wait_for()
    held[0].continue_()
    page.wait_for_function("n => window.__answersRead.length >= n", arg=len(asked))

    assert page.get_by_role("heading", name="Overview").is_visible()  # the page the admin opened
    key = page.locator("#new-key-value").inner_text()
    (issued,) = weir.admin.get(keys_url).json()["data"]
    assert key.startswith(issued["prefix"]) and len(key) > len(issued["prefix"])
    assert page.locator("#new-key").get_by_role("button", name="Copy").is_visible()

    page.locator("#new-key").get_by_role("button", name="Done").click()
    assert page.locator("#new-key-value").count() == 0 and page.locator("#new-key").is_hidden()
    page.close()


def test_a_new_key_is_cleared_when_the_session_expires(
    weir: Weir, browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key just issued stays on the screen, outside the page, until its Done button: signing out
    cleared it, but a session that expired left it over the sign-in form, a secret for whoever comes
    to the screen next. The sign-in form now clears it, however it came."""
    tenant = weir.admin.post("/tenants", json={"name": "acme"}).json()
    page = signed_in(weir, browser, f"#/tenants/{tenant['id']}")
    page.locator("#keys").get_by_role("button", name="Issue key").click()
    page.locator("#new-key-value").wait_for()
    page.wait_for_load_state("networkidle")

    monkeypatch.setattr(ui, "ABSOLUTE_S", 0)  # every session has lived its whole life
    page.evaluate("location.hash = '#/overview'")  # the next page the admin opens
    page.get_by_text("Your session expired. Sign in again.").wait_for()
    assert page.get_by_role("button", name="Sign in with token").is_visible()
    assert page.locator("#new-key-value").count() == 0 and page.locator("#new-key").is_hidden()
    page.close()


def test_finance_shows_the_reports_errors_and_cancelled_attempts(
    routed: Weir, browser: Any, fake_openai: FakeOpenAI, shots: Path
) -> None:
    """The Finance table mirrors the usage report: its client requests, their attempts (a retried
    request is one request of two attempts: "Requests" counted attempts), the attempts that failed
    and those cancelled (a client that left mid-stream, a hedge that lost: no error), as the API
    counts them, in each row and the totals. The config file's tenant who sent them is on the
    Tenants page, marked as from the config, with its spend; its name is refused to a new tenant."""
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    say = [{"role": "user", "content": "one two three four five six"}]
    assert client.chat.completions.create(model="gpt-4o-mini", messages=say).choices[0].message.content  # type: ignore[arg-type]
    retried = {
        "name": "retried",
        "candidates": [{"model": "gpt-4o-mini"}],
        "retry": {"attempts": 2, "backoff": 0.01},
    }
    assert routed.admin.post("/routes", json=retried).status_code == 201
    fake_openai.fail_next(500)  # its first attempt; the retry answers
    assert client.chat.completions.create(model="retried", messages=say).choices[0].message.content  # type: ignore[arg-type]
    fake_openai.fail_next(Fault.status(400, message="bad temperature"))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="gpt-4o-mini", messages=say)  # type: ignore[arg-type]
    fake_openai.set_latency(per_token=0.3)
    stream = client.chat.completions.create(model="gpt-4o-mini", messages=say, stream=True)  # type: ignore[arg-type]
    next(iter(stream))
    stream.close()  # the client leaves mid-stream: a 499
    report = wait_for_ledger(routed, 4, attempts=5)
    totals = report["totals"]
    assert (totals["requests"], totals["attempts"], totals["errors"], totals["cancelled"]) == (4, 5, 2, 1), (
        totals
    )

    page = signed_in(routed, browser, "#/finance")
    api = routed.admin.get("/reports/usage", params={"group_by": "tenant,model"}).json()
    heads = page.locator("main table thead th").all_inner_texts()
    foot = page.locator("main table tfoot td").all_inner_texts()
    (row,) = api["rows"]
    cells = page.locator("main table tbody tr").first.locator("td").all_inner_texts()
    counts = (
        ("Requests", "requests"),
        ("Attempts", "attempts"),
        ("Errors", "errors"),
        ("Cancelled", "cancelled"),
    )
    for label, column in counts:
        assert cells[heads.index(label)] == str(row[column])
        assert foot[heads.index(label)] == str(api["totals"][column])
    assert (cells[heads.index("Requests")], cells[heads.index("Attempts")]) == ("4", "5")

    page.get_by_role("link", name="Tenants & keys").click()
    team = page.locator("main table tbody tr", has_text="team")
    team.wait_for()
    assert team.locator(".tag").inner_text() == "from config"
    assert team.get_by_role("link").count() == 0  # its keys and limits live in the config
    spend = team.locator("td").nth(1).inner_text()  # its requests are the ledger's under its name
    assert spend.endswith(" (no budget)") and spend != "$0.00 (no budget)", spend
    page.get_by_label("Name", exact=True).fill("team")
    page.get_by_role("button", name="Create tenant").click()
    error = page.locator("form .form-error")
    error.wait_for()
    assert "defined in the config file" in error.inner_text()
    assert page.get_by_label("Name", exact=True).get_attribute("aria-invalid") == "true"
    page.screenshot(path=shots / "tenants-from-config.png", full_page=True)
    page.close()


def test_finance_groups_cost_by_service_tier(routed: Weir, browser: Any, fake_openai: FakeOpenAI) -> None:
    """Finance offers the usage report's `service_tier` grouping: what the attempts each tier their
    vendor served them at (flex, the default) cost, as the API reports it."""
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    for tier in ("flex", "flex", "default"):
        fake_openai.set_next_usage(input_tokens=1000, output_tokens=100)
        client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], service_tier=tier
        )
    assert wait_for_ledger(routed, 3)["totals"]["requests"] == 3

    page = signed_in(routed, browser, "#/finance")
    page.get_by_label("model", exact=True).uncheck()
    page.get_by_label("service_tier", exact=True).check()
    page.get_by_role("button", name="Show report").click()
    page.wait_for_url("**group_by=tenant,service_tier")
    report = page.locator("main table").first
    report.locator("thead th", has_text="service_tier").wait_for()
    api = routed.admin.get("/reports/usage", params={"group_by": "tenant,service_tier"}).json()
    heads = report.locator("thead th").all_inner_texts()
    rows = [row.locator("td").all_inner_texts() for row in report.locator("tbody tr").all()]
    shown = {cells[heads.index("service_tier")]: cells[heads.index("Cost (USD)")] for cells in rows}
    assert shown == {r["service_tier"]: usd(r["cost_usd"]) for r in api["rows"]}
    assert set(shown) == {"flex", "default"}
    page.close()


def test_finance_groups_cost_by_route(routed: Weir, browser: Any, fake_openai: FakeOpenAI) -> None:
    """Finance offers the usage report's `route` grouping: what the requests by each public name
    cost, over whole days from the route rollups the writer keeps, as the API reports it."""
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    for model in ("gpt-4o-mini", "gpt-4o-mini", "gpt-4o"):
        fake_openai.set_next_usage(input_tokens=1000, output_tokens=100)
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert wait_for_ledger(routed, 3)["totals"]["requests"] == 3

    page = signed_in(routed, browser, "#/finance")
    page.get_by_label("model", exact=True).uncheck()
    page.get_by_label("route", exact=True).check()
    page.get_by_role("button", name="Show report").click()
    page.wait_for_url("**group_by=tenant,route")
    report = page.locator("main table").first
    report.locator("thead th", has_text="route").wait_for()
    api = routed.admin.get("/reports/usage", params={"group_by": "tenant,route"}).json()
    assert api["source"] == "rollups"
    heads = report.locator("thead th").all_inner_texts()
    rows = [row.locator("td").all_inner_texts() for row in report.locator("tbody tr").all()]
    shown = {cells[heads.index("route")]: cells[heads.index("Requests")] for cells in rows}
    assert (
        shown == {r["route"]: str(r["requests"]) for r in api["rows"]} == {"gpt-4o-mini": "2", "gpt-4o": "1"}
    )
    page.close()
