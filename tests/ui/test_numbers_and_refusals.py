"""Numbers an admin reads at a glance, and a refusal the page says: the request log's token counts
had no thousands separators ("400000000/1000000"), its costs and Finance's money columns were the
ledger's bare decimals ("1010", "0.0000025", "0": no unit, each with its own decimals), and a revoke
the API refused did nothing visible."""

from __future__ import annotations

import json
import time
from typing import Any

import openai

from tests.fakes import FakeOpenAI
from tests.ui.helpers import Weir, signed_in


def _logged(weir: Weir, requests: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 15
    while True:
        log = weir.admin.get("/requests").json()["data"]
        if len(log) >= requests or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def test_costs_read_as_exact_dollars_and_token_counts_with_separators(
    routed: Weir, browser: Any, fake_openai: FakeOpenAI
) -> None:
    # gpt-4o at $2.50 in, $10.00 out per 1M: 400M in and 1M out cost $1,010 exactly; gpt-4o-mini's
    # one token in, one out cost $0.00000075, whose digits a rounding display would lose.
    fake_openai.set_next_usage(input_tokens=400_000_000, output_tokens=1_000_000)
    fake_openai.set_next_usage(input_tokens=1, output_tokens=1)
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    for model in ("gpt-4o", "gpt-4o-mini"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
    log = _logged(routed, 2)
    assert {r["model"]: r["cost_usd"] for r in log} == {"gpt-4o": "1010", "gpt-4o-mini": "0.00000075"}

    page = signed_in(routed, browser, "#/requests")
    rows = page.locator("main > .table-wrap > table > tbody > tr.has-detail")
    heads = page.locator("main > .table-wrap > table > thead th").all_inner_texts()
    costs = {
        r.locator("> td").nth(heads.index("Model")).inner_text(): r.locator("> td")
        .nth(heads.index("Cost"))
        .inner_text()
        for r in rows.all()
    }
    assert costs == {"gpt-4o": "$1,010.00", "gpt-4o-mini": "$0.00000075"}
    detail = page.locator("tr.detail", has_text="openai (gpt-4o) answered")
    detail.locator("summary").click()
    attempt_heads = detail.locator("thead th").all_inner_texts()
    cells = detail.locator("tbody tr").first.locator("td").all_inner_texts()
    assert cells[attempt_heads.index("Tokens in/out")] == "400,000,000/1,000,000"
    assert cells[attempt_heads.index("Cost")] == "$1,010.00"

    page.get_by_role("link", name="Finance").click()
    page.wait_for_url("**#/finance")
    report = page.locator("main table").first
    report.locator("tfoot .cost").wait_for()
    assert report.locator("tfoot .cost").get_attribute("data-usd") == "1010.00000075"  # the API's, exact
    assert report.locator("tfoot .cost").inner_text() == "$1,010.00000075"
    heads = report.locator("thead th").all_inner_texts()
    by_model = {
        c[heads.index("model")]: c
        for c in (r.locator("td").all_inner_texts() for r in report.locator("tbody tr").all())
    }
    assert by_model["gpt-4o"][heads.index("Cost (USD)")] == "$1,010.00"
    assert by_model["gpt-4o"][heads.index("Cache saved")] == "$0.00"
    assert by_model["gpt-4o-mini"][heads.index("USD / 1M tokens")] == "$0.375"
    page.close()


def _refuse_deletes(route: Any) -> None:
    """The API refusing a revoke, as a database gone read-only would."""
    if route.request.method != "DELETE":
        route.continue_()
        return
    body = {"error": {"message": "the admin database is read-only", "code": "unavailable"}}
    route.fulfill(status=503, content_type="application/json", body=json.dumps(body))


def test_a_revoke_the_api_refuses_says_so_and_leaves_the_key_listed_active(
    routed: Weir, browser: Any
) -> None:
    tenant = routed.admin.post("/tenants", json={"name": "acme"}).json()
    routed.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "prod"}).raise_for_status()
    page = signed_in(routed, browser, f"#/tenants/{tenant['id']}")
    page.route("**/keys/*", _refuse_deletes)
    page.get_by_role("button", name="Revoke key prod").click()
    message = page.locator("#keys-message [role=alert]")
    message.wait_for()
    assert message.inner_text() == "Key prod was not revoked: the admin database is read-only"
    status = page.locator("#keys thead th").all_inner_texts().index("Status")
    assert page.locator("#keys tbody tr", has_text="prod").locator("td").nth(status).inner_text() == "active"
    assert routed.admin.get(f"/tenants/{tenant['id']}/keys").json()["data"][0]["revoked_at"] is None
    page.close()


def test_a_report_range_the_api_refuses_is_said_at_the_form_which_fixes_it(
    routed: Weir, browser: Any
) -> None:
    """A Finance link with a range the API refuses (edited by hand, bookmarked) showed "Something went
    wrong ... Reload the page", and a reload asked for the same report again."""
    page = signed_in(routed, browser, "#/finance?start=2026-03-05&end=2026-03-01&group_by=tenant")
    form = page.get_by_role("form", name="Report range")
    error = form.locator(".form-error")
    error.wait_for()
    assert error.inner_text() == "end must be after start"
    to = form.get_by_label("To (exclusive)", exact=True)
    assert to.get_attribute("aria-invalid") == "true"
    to.fill("2026-03-09")
    form.get_by_role("button", name="Show report").click()
    page.get_by_text("No usage in this range.").wait_for()
    assert page.url.endswith("#/finance?start=2026-03-05&end=2026-03-09&group_by=tenant")
    page.close()


def test_a_sign_out_the_gateway_refuses_says_the_session_is_still_open(routed: Weir, browser: Any) -> None:
    """Sign-out said "Signed out." whatever the gateway answered: refused or unanswered, the session
    stayed open on the server with its cookie in the browser, and the next person at it reloaded the
    page signed in. The page says so and stays; a sign-out that goes through still signs out."""
    page = signed_in(routed, browser, "#/overview")
    page.route("**/admin/session", _refuse_deletes)
    page.get_by_role("button", name="Sign out").click()
    alert = page.locator("main [role=alert]", has_text="Not signed out")
    alert.wait_for()
    assert "the admin database is read-only" in alert.inner_text()
    assert page.get_by_role("heading", name="Sign in to Weir").count() == 0
    page.unroute("**/admin/session")
    page.get_by_role("button", name="Sign out").click()
    page.get_by_role("heading", name="Sign in to Weir").wait_for()
    page.reload()
    page.get_by_role("heading", name="Sign in to Weir").wait_for()
    page.close()
