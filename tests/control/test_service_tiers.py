"""Service tiers: every attempt is billed at the prices of the tier its vendor says it served it at
(OpenAI's top-level `service_tier`, Anthropic's `usage.service_tier`), from the config's
`price.tiers` or the admin price catalog; a tier without prices of its own, or none reported, at the
model's base price. The ledger, the request log and the usage report show the tier."""

from __future__ import annotations

import time
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest

from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fixtures.db import wait_rows
from tests.fixtures.gateway import Weir

# USD per 1M tokens. gpt-5-mini: OpenAI's list prices (standard, flex, priority processing).
# Anthropic sells Priority Tier by commitment, without a list price: a made-up one.
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
  - {name: anthropic, type: anthropic, base_url: "ANTHROPIC_URL", api_key: "ANTHROPIC_KEY"}
models:
  - name: gpt-5-mini
    backend: openai
    price:
      input: 0.25
      cached_input: 0.025
      output: 2.00
      tiers:
        flex: {input: 0.125, cached_input: 0.0125, output: 1.00}
        priority: {input: 0.45, cached_input: 0.045, output: 3.60}
  - name: claude-sonnet
    backend: anthropic
    model: claude-sonnet-4-5
    price: {input: 3.0, output: 15.0, tiers: {priority: {input: 4.5, output: 22.5}}}
  - name: gpt-5
    backend: openai
    price: {input: 1.25, output: 10.00, tiers: {flex: {input: 0.625, output: 5.00}}}
routes:
  - {name: pair, candidates: [{model: gpt-5-mini}, {model: gpt-5}], probe_interval: null}
database_url: "${DB_URL}"
"""

INPUT, OUTPUT = 1000, 100  # every answer's usage (set_next_usage)


@pytest.fixture
def weir_config(fake_anthropic: FakeAnthropic) -> str:
    return CONFIG.replace("ANTHROPIC_URL", fake_anthropic.base_url).replace(
        "ANTHROPIC_KEY", str(fake_anthropic.api_key)
    )


def pico(input_usd: str, output_usd: str) -> int:
    """The cost of INPUT and OUTPUT tokens at these USD-per-1M prices, in pico-USD."""
    return int((INPUT * Decimal(input_usd) + OUTPUT * Decimal(output_usd)) * 10**6)


def tiers_and_costs(weir: Weir, tenant_id: str, expect: int, timeout: float = 15) -> list[tuple]:
    """The tenant's ledger rows as (model, service_tier, cost_pico_usd), oldest first."""
    return wait_rows(
        weir.db_url,
        "SELECT model, service_tier, cost_pico_usd FROM usage_events "
        f"WHERE tenant_id = '{tenant_id}' ORDER BY event_id",
        expect,
        timeout,
    )


def test_openai_attempts_are_billed_at_the_tier_served(weir: Weir, fake_openai: FakeOpenAI) -> None:
    tenant_id, _, key = weir.tenant_with_key("tiers")
    client = weir.client(key)
    ask = {"model": "gpt-5-mini", "messages": [{"role": "user", "content": "hello"}]}

    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    flex = client.chat.completions.create(**ask, service_tier="flex")
    assert flex.service_tier == "flex"  # the client sees what the vendor said

    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    stream = client.chat.completions.create(
        **ask, service_tier="priority", stream=True, stream_options={"include_usage": True}
    )
    assert {chunk.service_tier for chunk in stream} == {"priority"}

    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    plain = client.chat.completions.create(**ask)
    assert plain.service_tier == "default"  # a tier without prices of its own: the base price

    fake_openai.serve_auto_at("scale")  # a project with Scale Tier capacity: unpriced, the base price
    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    scaled = client.chat.completions.create(**ask, service_tier="auto")
    assert scaled.service_tier == "scale"

    assert tiers_and_costs(weir, tenant_id, expect=4) == [
        ("gpt-5-mini", "flex", pico("0.125", "1.00")),
        ("gpt-5-mini", "priority", pico("0.45", "3.60")),
        ("gpt-5-mini", "default", pico("0.25", "2.00")),
        ("gpt-5-mini", "scale", pico("0.25", "2.00")),
    ]

    # The request log shows each attempt's tier beside its cost...
    log = weir.admin.get("/requests", params={"tenant": tenant_id}).json()["data"]
    assert sorted(a["service_tier"] for r in log for a in r["attempts"]) == [
        "default",
        "flex",
        "priority",
        "scale",
    ]
    # ...and the usage report breaks costs down by tier, on whole days too (the rollups keep none).
    report = weir.admin.get("/reports/usage", params={"group_by": "tenant,service_tier"}).json()
    assert report["source"] == "events"
    costs = {r["service_tier"]: Decimal(r["cost_usd"]) for r in report["rows"] if r["tenant"] == tenant_id}
    assert costs == {
        "default": Decimal(pico("0.25", "2.00")) / 10**12,
        "flex": Decimal(pico("0.125", "1.00")) / 10**12,
        "priority": Decimal(pico("0.45", "3.60")) / 10**12,
        "scale": Decimal(pico("0.25", "2.00")) / 10**12,
    }
    csv = weir.admin.get("/reports/usage", params={"group_by": "service_tier", "format": "csv"})
    assert csv.text.startswith("service_tier,requests,")


def test_anthropic_attempts_are_billed_at_the_tier_served(weir: Weir, fake_anthropic: FakeAnthropic) -> None:
    tenant_id, _, key = weir.tenant_with_key("claude-tiers")
    client = anthropic.Anthropic(base_url=weir.url, api_key=key, max_retries=0, timeout=20)
    ask = {"model": "claude-sonnet", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}

    fake_anthropic.serve_auto_at("priority")  # a workspace with Priority Tier capacity
    fake_anthropic.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    client.messages.create(**ask)
    fake_anthropic.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    with client.messages.stream(**ask) as stream:
        stream.until_done()
    fake_anthropic.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    client.messages.create(**ask, service_tier="standard_only")

    assert tiers_and_costs(weir, tenant_id, expect=3) == [
        ("claude-sonnet-4-5", "priority", pico("4.5", "22.5")),
        ("claude-sonnet-4-5", "priority", pico("4.5", "22.5")),
        ("claude-sonnet-4-5", "standard", pico("3.0", "15.0")),
    ]


def test_a_responses_client_sees_and_is_billed_the_tier_served(weir: Weir, fake_openai: FakeOpenAI) -> None:
    tenant_id, _, key = weir.tenant_with_key("responses-tiers")
    client = weir.client(key)
    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    response = client.responses.create(model="gpt-5-mini", input="hello", service_tier="flex")
    assert response.service_tier == "flex"
    fake_openai.serve_auto_at("priority")
    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    with client.responses.stream(model="gpt-5-mini", input="hello", service_tier="auto") as stream:
        final = stream.get_final_response()
    assert final.service_tier == "priority"  # what the vendor served, not the `auto` asked for
    assert tiers_and_costs(weir, tenant_id, expect=2) == [
        ("gpt-5-mini", "flex", pico("0.125", "1.00")),
        ("gpt-5-mini", "priority", pico("0.45", "3.60")),
    ]


def test_an_openai_clients_tier_reaches_claude_in_anthropics_words(
    weir: Weir, fake_anthropic: FakeAnthropic
) -> None:
    tenant_id, _, key = weir.tenant_with_key("cross-tiers")
    client = weir.client(key)
    fake_anthropic.serve_auto_at("priority")
    for tier in ("flex", "priority"):  # Claude has no flex: standard processing; priority: `auto`
        fake_anthropic.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
        client.chat.completions.create(
            model="claude-sonnet", messages=[{"role": "user", "content": "hi"}], service_tier=tier
        )
    assert [r.json["service_tier"] for r in fake_anthropic.requests] == ["standard_only", "auto"]
    assert tiers_and_costs(weir, tenant_id, expect=2) == [
        ("claude-sonnet-4-5", "standard", pico("3.0", "15.0")),
        ("claude-sonnet-4-5", "priority", pico("4.5", "22.5")),
    ]


def test_a_tier_priced_in_the_catalog_bills_its_attempts(weir: Weir, fake_openai: FakeOpenAI) -> None:
    tenant_id, _, key = weir.tenant_with_key("catalog-tiers")
    put = weir.admin.put(
        "/prices",
        json={
            "prices": [
                # Flex output at a new price for the backend (the config's prices are its own);
                # flex input keeps the config's flex price.
                {
                    "model": "gpt-5-mini",
                    "backend": "openai",
                    "service_tier": "flex",
                    "token_class": "output",
                    "usd_per_1m_tokens": "0.90",
                },
                # A tier the config does not price: its input alone, its output at the base price.
                {
                    "model": "gpt-5-mini",
                    "service_tier": "scale",
                    "token_class": "input",
                    "usd_per_1m_tokens": "0.20",
                },
            ]
        },
    )
    assert put.status_code == 200, put.text
    assert {p["service_tier"] for p in put.json()["data"]} == {"flex", "scale"}
    listed = weir.admin.get("/prices", params={"model": "gpt-5-mini"}).json()["data"]
    assert {(p["service_tier"], p["token_class"], p["usd_per_1m_tokens"]) for p in listed} >= {
        (None, "input", "0.25"),
        ("flex", "input", "0.125"),
        ("flex", "output", "0.9"),
        ("scale", "input", "0.2"),
    }

    client = weir.client(key)
    ask = {"model": "gpt-5-mini", "messages": [{"role": "user", "content": "hello"}]}
    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    client.chat.completions.create(**ask, service_tier="flex")
    fake_openai.serve_auto_at("scale")
    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    client.chat.completions.create(**ask)
    assert tiers_and_costs(weir, tenant_id, expect=2) == [
        ("gpt-5-mini", "flex", pico("0.125", "0.90")),
        ("gpt-5-mini", "scale", pico("0.20", "2.00")),
    ]


def budget_used(weir: Weir, tenant_id: str, ratio: float, timeout: float = 15) -> None:
    """Wait until the tenant's budget use (/metrics, as of its last settlement) reaches `ratio`."""
    deadline = time.monotonic() + timeout
    gauge = f'weir_budget_usage_ratio{{tenant="{tenant_id}"}}'
    while time.monotonic() < deadline:
        lines = httpx.get(f"{weir.url}/metrics").text.splitlines()
        if any(line.startswith(gauge) and float(line.split()[-1]) >= ratio for line in lines):
            return
        time.sleep(0.05)
    raise AssertionError(f"the budget never reached {ratio}")


def test_a_priority_request_reserves_its_budget_at_the_priority_price(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    """Admission reserves a request's estimate (its prompt, and its max_tokens of output) at the prices
    of the tier it asks for: at the base price, a priority request near the end of a budget was
    admitted and overspent it by what priority costs above the base."""
    tenant_id, _, key = weir.tenant_with_key("priority-budget", budget_usd_monthly="0.01")
    client = weir.client(key)
    ask = {"model": "gpt-5-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}
    # $0.00025 + $0.007 of a $0.01 budget spent: $0.00275 left.
    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=3500)
    client.chat.completions.create(**{**ask, "max_tokens": 4000})
    budget_used(weir, tenant_id, 0.725)

    # 1,000 output tokens at priority's $3.60: $0.0036, more than is left; at the base $2: $0.002.
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(**ask, service_tier="priority")
    assert refused.value.code == "insufficient_quota"
    assert len(fake_openai.posts) == 1
    fake_openai.set_next_usage(input_tokens=10, output_tokens=10)
    assert client.chat.completions.create(**ask).service_tier == "default"


def _cut_stream(weir: Weir, tenant: str, service_tier: str) -> list[tuple]:
    """A new tenant's gpt-5-mini stream at `service_tier`, which its client leaves after the first
    chunk (a 499, billed what was generated, estimated): its ledger row (`_CUT_ROW`) once it lands."""
    tenant_id, _, key = weir.tenant_with_key(tenant)
    stream = weir.client(key).chat.completions.create(
        model="gpt-5-mini",
        messages=[{"role": "user", "content": "one two three four five six"}],
        service_tier=service_tier,
        stream=True,
    )
    next(iter(stream))
    stream.close()
    return wait_rows(weir.db_url, _CUT_ROW.format(tenant_id))


def test_a_stream_cut_before_its_usage_is_billed_at_the_tier_it_asked_for(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    """A stream its client leaves before the vendor's usage report is billed an estimate, at the prices
    of the concrete tier it asked for (`flex`, `priority`): its vendor serves those as asked. It was
    billed at the base price, a flex stream at twice what OpenAI charges."""
    fake_openai.set_latency(per_token=0.3)
    [(tier, estimated, status, input_tokens, output_tokens, cost)] = _cut_stream(weir, "cut-tiers", "flex")
    assert (tier, bool(estimated), status) == ("flex", True, 499)
    assert input_tokens > 0 and output_tokens > 0
    assert cost == input_tokens * 125_000 + output_tokens * 1_000_000  # flex: $0.125 and $1 per 1M


def test_a_stream_cut_before_its_usage_is_billed_at_the_tier_it_was_served_at(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    """OpenAI says the tier it serves a stream at in every chunk, not only the usage chunk: a stream
    that asks for `auto` and is served at `priority` (a project with Priority capacity), cut before its
    usage chunk, is billed at priority's prices. It was billed at the base price (`auto` names none)."""
    fake_openai.serve_auto_at("priority")
    fake_openai.set_latency(per_token=0.3)
    [(tier, estimated, status, input_tokens, output_tokens, cost)] = _cut_stream(
        weir, "cut-served-tier", "auto"
    )
    assert (tier, bool(estimated), status) == ("priority", True, 499)
    assert cost == input_tokens * 450_000 + output_tokens * 3_600_000  # priority: $0.45 and $3.60 per 1M


def test_the_savings_baseline_is_priced_at_the_tier_each_request_was_served_at(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    """A flex request routed to gpt-5-mini is billed at flex's prices; the "strongest model"
    baseline (gpt-5, which prices flex too) is priced at flex's as well, so the savings are
    routing's alone. At gpt-5's base price, flex's discount showed as savings too."""
    tenant_id, _, key = weir.tenant_with_key("flex-savings")
    fake_openai.set_next_usage(input_tokens=INPUT, output_tokens=OUTPUT)
    answer = weir.client(key).chat.completions.create(
        model="pair", messages=[{"role": "user", "content": "hello"}], service_tier="flex"
    )
    assert answer.service_tier == "flex"
    [(model, tier, cost)] = tiers_and_costs(weir, tenant_id, 1)
    assert (model, tier, cost) == ("gpt-5-mini", "flex", pico("0.125", "1.00"))
    totals = weir.admin.get("/reports/routing-savings").json()["totals"]
    assert Decimal(totals["cost_usd"]) * 10**12 == pico("0.125", "1.00")
    assert Decimal(totals["strongest_cost_usd"]) * 10**12 == pico("0.625", "5.00")


_CUT_ROW = (
    "SELECT service_tier, estimated, status, input_tokens, output_tokens, cost_pico_usd "
    "FROM usage_events WHERE tenant_id = '{}'"
)


@pytest.mark.parametrize(
    ("price", "param"),
    [
        ({"service_tier": "Flex"}, "prices[0].service_tier"),
        ({"service_tier": ""}, "prices[0].service_tier"),
        ({"service_tier": "x" * 40}, "prices[0].service_tier"),
        ({"service_tier": 1}, "prices[0].service_tier"),
    ],
)
def test_a_bad_tier_in_the_catalog_is_refused(weir: Weir, price: dict, param: str) -> None:
    body = {"model": "gpt-5-mini", "token_class": "input", "usd_per_1m_tokens": "1"} | price
    response = weir.admin.put("/prices", json={"prices": [body]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
