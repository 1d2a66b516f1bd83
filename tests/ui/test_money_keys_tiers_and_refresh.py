"""What an admin and a finance user read wrongly or could not do: Overview and Tenants rounded spend
that Finance says exactly ($0.000001 against $0.00000075 for the same month), an expired key read
"active", a flex price read as a second base price (the tier was not shown, nor could a tier's price
be added), a link to a config tenant said it no longer existed, Show report or Filter pressed again
with the same fields did nothing, so new traffic never appeared, and a request log cut at 100 did not
say so."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import openai
from playwright.sync_api import expect
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from gateway.db.models import ApiKey
from tests.fakes import FakeOpenAI
from tests.ui.helpers import Weir, signed_in, usd


def ask_team(weir: Weir, model: str) -> None:
    client = openai.OpenAI(base_url=f"{weir.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5)


def wait_for_requests(weir: Weir, requests: int) -> None:
    """Until the ledger holds `requests` client requests (the usage queue writes them in batches)."""
    deadline = time.monotonic() + 15
    while weir.admin.get("/reports/usage").json()["totals"]["requests"] < requests:
        assert time.monotonic() < deadline, "the ledger did not get the requests"
        time.sleep(0.1)


def _expire(weir: Weir, key_id: str, at: dt.datetime) -> None:
    """A key's expiry come and gone: the API issues no key already expired."""
    engine = create_engine(weir.db_url.replace("+aiosqlite", ""))
    try:
        with Session(engine) as session, session.begin():
            row = session.get(ApiKey, key_id)
            assert row is not None
            row.expires_at = at
    finally:
        engine.dispose()


def test_spend_is_exact_keys_say_expired_and_prices_say_their_tier(
    routed: Weir, browser: Any, fake_openai: FakeOpenAI
) -> None:
    acme = routed.admin.post("/tenants", json={"name": "acme", "budget_usd_monthly": "5"}).json()
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    yesterday = (now - dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    old = {"name": "old", "expires_at": (now + dt.timedelta(days=1)).isoformat()}
    _expire(
        routed,
        routed.admin.post(f"/tenants/{acme['id']}/keys", json=old).json()["id"],
        now - dt.timedelta(days=1),
    )
    routed.admin.put(
        "/prices",
        json={
            "prices": [
                {
                    "model": "gpt-4o",
                    "token_class": "input",
                    "usd_per_1m_tokens": "1.25",
                    "service_tier": "flex",
                }
            ]
        },
    )
    fake_openai.set_next_usage(input_tokens=1, output_tokens=1)  # gpt-4o-mini: $0.00000075
    ask_team(routed, "gpt-4o-mini")
    wait_for_requests(routed, 1)
    month = routed.admin.get("/reports/usage", params={"group_by": "tenant"}).json()
    assert month["totals"]["cost_usd"] == "0.00000075"

    page = signed_in(routed, browser, "#/overview")
    spend = page.locator(".stat", has_text="Spend this month").locator(".stat-value")
    assert spend.inner_text() == usd(month["totals"]["cost_usd"])  # was $0.000001

    page.goto(f"{routed.url}/admin/#/tenants/{acme['id']}")
    page.get_by_role("heading", name="Keys of acme").wait_for()
    tenants = page.locator("main > .table-wrap").first
    assert (
        tenants.locator("tr", has_text="team").locator("td").nth(1).inner_text() == "$0.00000075 (no budget)"
    )
    assert (
        tenants.locator("tr", has_text="acme").locator("td").nth(1).inner_text().strip() == "$0.00 of $5.00"
    )
    keys = page.locator("#keys table")
    heads = keys.locator("thead th").all_inner_texts()
    status = keys.locator("tbody tr", has_text="old").locator("td").nth(heads.index("Status"))
    assert status.inner_text() == f"expired {yesterday[:16].replace('T', ' ')} UTC"
    tomorrow = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).date().isoformat()
    assert page.get_by_label("Expires", exact=True).get_attribute("min") == tomorrow

    # A config tenant's link says where it lives, not that it is gone.
    page.goto(f"{routed.url}/admin/#/tenants/team")
    page.get_by_text("team is defined in the config file's tenants:").wait_for()
    assert page.get_by_text("That tenant no longer exists.").count() == 0

    page.get_by_role("link", name="Backends & models").click()
    current = page.locator("main > .table-wrap").filter(has_text="Token class").first
    current.wait_for()
    heads = current.locator("thead th").all_inner_texts()
    flex = current.locator("tbody tr", has_text="$1.25 / 1M tokens").locator("td").all_inner_texts()
    base = current.locator("tbody tr", has_text="$2.50 / 1M tokens").locator("td").all_inner_texts()
    assert (flex[heads.index("Tier")], base[heads.index("Tier")]) == ("flex", "base")
    form = page.get_by_role("form", name="Add a price")
    form.get_by_label("Model", exact=True).fill("gpt-4o")
    form.get_by_label("USD per 1M tokens", exact=True).fill("5")
    tier = form.get_by_label("Service tier", exact=True)
    tier.fill("Flex")  # refused in the field, in words, not as the API's regex
    assert tier.evaluate("e => e.validity.patternMismatch") is True
    tier.fill("priority")
    form.get_by_role("button", name="Add price").click()
    page.locator("main > .table-wrap tr", has_text="$5.00 / 1M tokens").first.wait_for()
    added = [p for p in routed.admin.get("/prices").json()["data"] if p["usd_per_1m_tokens"] == "5"]
    assert [(p["model"], p["service_tier"]) for p in added] == [("gpt-4o", "priority")]

    # Finance by key names each key as the keys list does (its id is shown nowhere else), in the
    # API's JSON and CSV too; a config file's key keeps its id.
    ci = routed.admin.post(f"/tenants/{acme['id']}/keys", json={"name": "ci"}).json()
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key=ci["key"], max_retries=0, timeout=20)
    client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    wait_for_requests(routed, 2)
    by_key = routed.admin.get("/reports/usage", params={"group_by": "key"})
    labels = {r["key"]: (r["key_name"], r["key_prefix"]) for r in by_key.json()["rows"]}
    assert labels[ci["id"]] == ("ci", ci["prefix"])
    assert [v for k, v in labels.items() if k != ci["id"]] == [(None, None)]  # the team's config key
    csv = routed.admin.get("/reports/usage", params={"group_by": "key", "format": "csv"}).text
    assert csv.startswith("key,key_name,key_prefix,requests,")
    assert f"{ci['id']},ci,{ci['prefix']}," in csv
    page.goto(f"{routed.url}/admin/#/finance?group_by=key")
    report = page.locator("main table").first
    report.locator("tfoot").wait_for()
    cells = report.locator("tbody tr td:first-child").all_inner_texts()
    assert f"ci {ci['prefix']}" in cells
    page.close()


def test_show_report_and_filter_pressed_again_read_the_new_traffic(
    routed: Weir, browser: Any, fake_openai: FakeOpenAI
) -> None:
    ask_team(routed, "gpt-4o-mini")
    wait_for_requests(routed, 1)
    page = signed_in(routed, browser, "#/requests")
    rows = page.locator("main > .table-wrap > table > tbody > tr.has-detail")
    page.get_by_role("button", name="Filter").click()  # the hash now has its (empty) query
    rows.first.wait_for()
    assert rows.count() == 1
    ask_team(routed, "gpt-4o")
    wait_for_requests(routed, 2)
    page.get_by_role("button", name="Filter").click()  # the same hash again: read again all the same
    expect(rows).to_have_count(2, timeout=5000)

    page.get_by_role("link", name="Finance").click()
    page.get_by_role("button", name="Show report").click()
    footer = page.locator("tfoot .cost")
    page.wait_for_url("**#/finance?start=*")
    footer.wait_for()
    before = footer.get_attribute("data-usd")
    ask_team(routed, "gpt-4o")
    wait_for_requests(routed, 3)
    page.get_by_role("button", name="Show report").click()
    now = routed.admin.get("/reports/usage", params={"group_by": "tenant,model"}).json()["totals"]["cost_usd"]
    assert now != before
    expect(footer).to_have_attribute("data-usd", now, timeout=5000)

    # A full log (the API reads the newest 100, with no further pages) says that older ones are left out.
    for _ in range(100):
        ask_team(routed, "gpt-4o-mini")
    wait_for_requests(routed, 103)
    page.get_by_role("link", name="Requests").click()
    expect(rows).to_have_count(100, timeout=5000)
    caption = page.locator("main > .table-wrap > table > caption")
    assert caption.inner_text().startswith("The 100 most recent requests that match")
    page.close()
