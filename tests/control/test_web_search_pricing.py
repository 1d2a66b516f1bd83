"""Web searches are billed: Anthropic's $10 per 1,000 web searches (the model's `web_search_per_1k`,
the catalog's `web_search` class) are on each attempt's ledger row and cost, in the usage report and
its CSV, in the spend by class and the request log, and charged to the tenant's budget, which admission
reserves them in (the tool's `max_uses`) beside the tokens."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from typing import Any

import anthropic
import httpx
import pytest

from tests.fakes import FakeAnthropic
from tests.fixtures.db import wait_rows
from tests.fixtures.gateway import Weir
from tests.gateway.test_messages import final_message

CONFIG = """\
backends:
  - {name: anthropic, type: anthropic, base_url: "ANTHROPIC_URL", api_key: "ANTHROPIC_KEY"}
models:
  - name: claude-sonnet
    backend: anthropic
    model: claude-sonnet-4-5
    price: {input: 3.0, output: 15.0, web_search_per_1k: 10}
database_url: "${DB_URL}"
"""
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}
ASKED = {
    "model": "claude-sonnet",
    "max_tokens": 200,
    "tools": [WEB_SEARCH],
    "messages": [{"role": "user", "content": "search the web for the tallest tree"}],
}
INPUT, OUTPUT = 1000, 100  # every answer's tokens (set_next_usage); the fake searches once
SEARCH = 10**10  # $10 per 1,000 searches: micro-USD per 1M searches, and one search's pico-USD
COST = INPUT * 3 * 10**6 + OUTPUT * 15 * 10**6 + SEARCH  # $0.0045 of tokens + $0.01: $0.0145


@pytest.fixture
def weir_config(fake_anthropic: FakeAnthropic) -> str:
    return CONFIG.replace("ANTHROPIC_URL", fake_anthropic.base_url).replace(
        "ANTHROPIC_KEY", str(fake_anthropic.api_key)
    )


def _client(weir: Weir, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=weir.url, api_key=key, max_retries=0, timeout=20)


def test_web_searches_are_on_the_ledger_and_in_the_reports(weir: Weir, fake_anthropic: FakeAnthropic) -> None:
    tenant_id, _, key = weir.tenant_with_key("searcher")
    for stream in (False, True):
        fake_anthropic.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
        message = final_message(_client(weir, key), stream, ASKED)
        assert message.usage.server_tool_use is not None
        assert message.usage.server_tool_use.web_search_requests == 1

    rows = wait_rows(
        weir.db_url,
        "SELECT web_search_requests, cost_pico_usd, prices FROM usage_events "
        f"WHERE tenant_id = '{tenant_id}'",
        expect=2,
    )
    assert [(n, cost) for n, cost, _ in rows] == [(1, COST), (1, COST)]
    for *_, prices in rows:
        assert (json.loads(prices) if isinstance(prices, str) else prices)["web_search"] == SEARCH

    # The report, from the rollups (whole days) and from the ledger (grouped by tier), and its CSV.
    for group_by, source in (("tenant", "rollups"), ("tenant,service_tier", "events")):
        report = weir.admin.get("/reports/usage", params={"group_by": group_by}).json()
        assert report["source"] == source
        [row] = [r for r in report["rows"] if r["tenant"] == tenant_id]
        assert row["web_search_requests"] == 2 and report["totals"]["web_search_requests"] == 2
        assert Decimal(row["cost_usd"]) == Decimal(2 * COST) / 10**12
    csv = weir.admin.get("/reports/usage", params={"group_by": "tenant", "format": "csv"}).text
    header, line = csv.splitlines()[:2]
    assert dict(zip(header.split(","), line.split(","), strict=True))["web_search_requests"] == "2"

    # The spend by class adds the searches up apart; the request log shows each attempt's.
    spend = weir.admin.get("/reports/spend-by-class").json()["totals"]
    assert Decimal(spend["web_search"]) == Decimal("0.02")
    assert sum(map(Decimal, spend.values())) == Decimal(2 * COST) / 10**12
    log = weir.admin.get("/requests", params={"tenant": tenant_id}).json()["data"]
    assert [a["web_search_requests"] for r in log for a in r["attempts"]] == [1, 1]


def _budget_ratio(weir: Weir, tenant_id: str, above: float, timeout: float = 10) -> float:
    """The tenant's budget use as /metrics exports it (spent over the budget, as of the last
    settlement, which comes off the request path), once above `above`, or as it is at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        lines = httpx.get(f"{weir.url}/metrics").text.splitlines()
        prefix = f'weir_budget_usage_ratio{{tenant="{tenant_id}"}}'
        ratio = next((float(x.split()[-1]) for x in lines if x.startswith(prefix)), 0.0)
        if ratio > above or time.monotonic() > deadline:
            return ratio
        time.sleep(0.05)


def _searching(max_uses: int | None, **more: Any) -> dict[str, Any]:
    tool = {k: v for k, v in WEB_SEARCH.items() if k != "max_uses"}
    return {**ASKED, "tools": [tool if max_uses is None else {**tool, "max_uses": max_uses}], **more}


def _refused(weir: Weir, key: str, asked: dict[str, Any]) -> anthropic.RateLimitError:
    with pytest.raises(anthropic.RateLimitError) as refused:
        _client(weir, key).messages.create(**asked)
    return refused.value


def test_a_budget_reserves_the_searches_and_is_charged_those_run(
    weir: Weir, fake_anthropic: FakeAnthropic
) -> None:
    """Admission reserves a request's web searches (its tool's `max_uses`, 10 without one) at the
    model's search price beside its tokens: a tenant whose budget left covers the tokens but not the
    searches is refused as a request over its budget by its tokens is. Reserved for its tokens alone,
    a request of many searches started on the last cents of a budget and overran it. Settled, an
    answer is charged the searches it ran (one, here), not those reserved."""
    tenant_id, _, key = weir.tenant_with_key("searcher-budget", budget_usd_monthly="0.05")
    budget = 5 * 10**10  # pico-USD
    # Up to 3 searches reserved ($0.03 and ~$0.003 of tokens): admitted, one run and billed ($0.0145).
    fake_anthropic.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    _client(weir, key).messages.create(**_searching(3))
    assert _budget_ratio(weir, tenant_id, above=0.0) == pytest.approx(COST / budget)

    # $0.0355 left. 4 searches ($0.04) do not fit, though the tokens would ($0.003): refused as a
    # request whose tokens do not fit is (3,000 output tokens, $0.045, and no tool).
    by_searches = _refused(weir, key, _searching(4))
    by_tokens = _refused(weir, key, {**ASKED, "tools": [], "max_tokens": 3000})
    # The same refusal, each carrying its own request's id (Anthropic's error shape has `request_id`).
    assert isinstance(by_searches.body, dict) and isinstance(by_tokens.body, dict)
    assert by_searches.body.pop("request_id") != by_tokens.body.pop("request_id")
    assert by_searches.body == by_tokens.body
    assert by_searches.status_code == by_tokens.status_code == 429
    assert "exceeded this tenant's monthly budget" in str(by_searches.body)
    # Spent: no retry within seconds can fit it (only a new month or a raised budget), so the SDKs
    # are told not to retry it, as for a request over the whole budget.
    assert by_searches.response.headers["x-should-retry"] == "false"
    # Without `max_uses`, 10 searches ($0.10): more than the whole budget, which no wait lifts.
    unbounded = _refused(weir, key, _searching(None))
    assert "more than this tenant's whole monthly budget (USD 0.05)" in str(unbounded.body)
    assert "max_uses (10 when unset)" in str(unbounded.body)
    assert unbounded.response.headers["x-should-retry"] == "false"

    # 2 searches fit; the answer runs one and the budget is charged that one, the reservation released.
    fake_anthropic.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    _client(weir, key).messages.create(**_searching(2))
    assert _budget_ratio(weir, tenant_id, above=COST / budget) == pytest.approx(2 * COST / budget)
    ledger = wait_rows(
        weir.db_url,
        f"SELECT web_search_requests, cost_pico_usd FROM usage_events WHERE tenant_id = '{tenant_id}'",
        expect=2,
    )
    assert ledger == [(1, COST), (1, COST)]
