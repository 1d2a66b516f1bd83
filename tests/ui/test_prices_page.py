"""The price form as a finance admin uses it: a web search price is typed as vendors quote it, per
1,000 searches, and the catalog bills it so; the price list says which unit each price is in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.accounting.pricing import TokenClass
from tests.ui.helpers import Weir, signed_in


def test_a_search_price_typed_per_1000_searches_is_the_catalogs_price(
    weir: Weir, browser: Any, shots: Path
) -> None:
    """Anthropic's price sheet says $10 per 1,000 searches: the admin types 10 and one search costs
    $0.01. The form asked for USD per 1M tokens (searches), so the 10 billed $0.00001 a search."""
    page = signed_in(weir, browser, "#/backends")
    form = page.get_by_role("form", name="Add a price")
    form.get_by_label("Model", exact=True).fill("claude-sonnet-4-5")
    form.get_by_label("Token class", exact=True).select_option("web_search")
    price = form.get_by_label("USD per 1,000 searches", exact=True)
    price.fill("10")
    page.screenshot(path=shots / "prices-web-search-form.png", full_page=True)
    form.get_by_role("button", name="Add price").click()

    current = page.locator("main > .table-wrap").filter(has_text="claude-sonnet-4-5").first
    row = current.locator("tr", has_text="web_search")
    row.wait_for()
    assert "$10.00 / 1k searches" in row.inner_text()
    # The gateway's own catalog, which bills the next attempt: micro-USD per 1M searches.
    prices = weir.router.context.prices("openai", "claude-sonnet-4-5", None)
    assert prices == {TokenClass.WEB_SEARCH: 10 * 10**9}
    listed = [p for p in weir.admin.get("/prices").json()["data"] if p["model"] == "claude-sonnet-4-5"]
    assert [(p["token_class"], p["usd_per_1k_requests"]) for p in listed] == [("web_search", "10")]

    # A token class is priced per 1M tokens again, and its row says so.
    form.get_by_label("Model", exact=True).fill("claude-sonnet-4-5")
    form.get_by_label("Token class", exact=True).select_option("input")
    form.get_by_label("USD per 1M tokens", exact=True).fill("3")
    form.get_by_role("button", name="Add price").click()
    page.locator("main > .table-wrap tr", has_text="$3.00 / 1M tokens").first.wait_for()
    page.screenshot(path=shots / "prices-by-unit.png", full_page=True)
    assert weir.router.context.prices("openai", "claude-sonnet-4-5", None) == {
        TokenClass.WEB_SEARCH: 10 * 10**9,
        TokenClass.INPUT: 3 * 10**6,
    }


def test_a_refused_search_price_marks_the_field_it_was_typed_in(weir: Weir, browser: Any) -> None:
    page = signed_in(weir, browser, "#/backends")
    form = page.get_by_role("form", name="Add a price")
    form.get_by_label("Model", exact=True).fill("claude-sonnet-4-5")
    form.get_by_label("Token class", exact=True).select_option("web_search")
    price = form.get_by_label("USD per 1,000 searches", exact=True)
    price.fill("0.0000000001")  # ten decimals: not exact in micro-USD per 1M searches
    form.get_by_role("button", name="Add price").click()
    error = form.locator(".form-error")
    error.wait_for()
    assert "9 decimals" in error.inner_text()
    assert price.get_attribute("aria-invalid") == "true"
    assert weir.router.context.prices("openai", "claude-sonnet-4-5", None) == {}


def test_a_price_that_is_no_number_is_refused_in_words(weir: Weir, browser: Any) -> None:
    """A price typed as the price sheet prints it ("$10") was refused with msgspec's "Invalid decimal
    string - at `$.prices[0].usd_per_1k_requests`" beside the field."""
    page = signed_in(weir, browser, "#/backends")
    form = page.get_by_role("form", name="Add a price")
    form.get_by_label("Model", exact=True).fill("claude-sonnet-4-5")
    form.get_by_label("Token class", exact=True).select_option("web_search")
    price = form.get_by_label("USD per 1,000 searches", exact=True)
    price.fill("$10")
    form.get_by_role("button", name="Add price").click()
    error = form.locator(".form-error")
    error.wait_for()
    assert error.inner_text() == (
        "Enter a price in USD per 1,000 requests as a plain number with up to 9 decimals, "
        "such as 2.50 (no $ or commas)"
    )
    assert price.get_attribute("aria-invalid") == "true"
    assert weir.router.context.prices("openai", "claude-sonnet-4-5", None) == {}
