"""Anthropic bills prompt-cache reads and writes as multiples of the input price: reads at 0.1x,
5-minute writes at 1.25x, 1-hour writes at 2x. A price that leaves a cache class out used to bill
reads at the input price (10x what Anthropic bills) and 1-hour writes at the 5-minute price (or the
input price), under-billing them by 37.5% (or half); on an Anthropic backend the classes left out now
bill by Anthropic's rule, in billing and in `cheapest` alike, on any other backend by the catalog's
fallbacks."""

from __future__ import annotations

import datetime as dt

import pytest

from gateway.accounting.pricing import TokenClass, price_usage
from gateway.config import Backend, parse_config
from gateway.pipeline import Pipeline
from gateway.router_basic import Target
from gateway.types import ChatRequest, Message
from gateway.usage import Usage
from routing.plan import Choice, features
from routing.policies import PolicyContext, expected_cost
from routing.routes import Candidate
from routing.stats import RoutingStats

AT = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
WRITES = Usage(input_tokens=100, cache_write_5m_tokens=1_000, cache_write_1h_tokens=10_000, output_tokens=10)
READS = Usage(input_tokens=100, cached_input_tokens=100_000, output_tokens=10)


def _billing(
    vendor: str,
    price: str,
    catalog: dict[TokenClass, int] | None = None,
    prompt_tokens: int = 0,
    tier: str | None = None,
) -> dict[TokenClass, int]:
    text = (
        f"backends: [{{name: b, type: {vendor}, base_url: u}}]\n"
        f"models: [{{name: claude, backend: b, price: {price}}}]"
    )
    model = parse_config(text).models[0]
    pipeline = Pipeline(None, None, None, [model])  # type: ignore[arg-type]
    if catalog is not None:
        pipeline.catalog = lambda backend, upstream, at, tier: catalog
    target = Target(model, Backend(name="b", type=vendor, base_url="u"), None)  # type: ignore[arg-type]
    return pipeline.billing_prices(target, AT, prompt_tokens or WRITES.prompt_tokens, tier)


@pytest.mark.parametrize("from_catalog", [False, True])
def test_unpriced_writes_on_anthropic_bill_at_its_multiples_of_input(from_catalog: bool) -> None:
    catalog = {TokenClass.INPUT: 3_000_000, TokenClass.OUTPUT: 15_000_000} if from_catalog else None
    prices = _billing("anthropic", "{input: 3, output: 15}", catalog)
    assert (prices[TokenClass.CACHE_WRITE_5M], prices[TokenClass.CACHE_WRITE_1H]) == (3_750_000, 6_000_000)
    cost = price_usage(WRITES, prices).cost_pico_usd
    assert cost == 100 * 3_000_000 + 1_000 * 3_750_000 + 10_000 * 6_000_000 + 10 * 15_000_000


def test_a_5_minute_price_set_alone_leaves_1_hour_writes_at_twice_input() -> None:
    prices = _billing("anthropic", "{input: 3, cache_write_5m: 3.75, output: 15}")
    assert prices[TokenClass.CACHE_WRITE_1H] == 6_000_000  # not the 5-minute 3.75


def test_prices_set_for_the_writes_are_kept() -> None:
    prices = _billing("anthropic", "{input: 3, cache_write_5m: 4, cache_write_1h: 5, output: 15}")
    assert (prices[TokenClass.CACHE_WRITE_5M], prices[TokenClass.CACHE_WRITE_1H]) == (4_000_000, 5_000_000)


def test_the_rule_follows_the_service_tier_s_input_price() -> None:
    text = (
        "backends: [{name: b, type: anthropic, base_url: u}]\n"
        "models: [{name: claude, backend: b, price: {input: 3, output: 15, tiers: {batch: {input: 1.5, output: 7.5}}}}]"
    )
    model = parse_config(text).models[0]
    pipeline = Pipeline(None, None, None, [model])  # type: ignore[arg-type]
    target = Target(model, Backend(name="b", type="anthropic", base_url="u"), None)  # type: ignore[arg-type]
    prices = pipeline.billing_prices(target, AT, 10, "batch")
    assert (prices[TokenClass.CACHE_WRITE_5M], prices[TokenClass.CACHE_WRITE_1H]) == (1_875_000, 3_000_000)


def test_other_vendors_keep_the_catalog_s_fallbacks() -> None:
    prices = _billing("openai", "{input: 3, output: 15}")
    assert TokenClass.CACHE_WRITE_1H not in prices and TokenClass.CACHED_INPUT not in prices
    cost = price_usage(WRITES, prices).cost_pico_usd
    assert cost == (100 + 1_000 + 10_000) * 3_000_000 + 10 * 15_000_000
    assert price_usage(READS, prices).cost_pico_usd == (100 + 100_000) * 3_000_000 + 10 * 15_000_000


@pytest.mark.parametrize("from_catalog", [False, True])
def test_unpriced_reads_on_anthropic_bill_at_a_tenth_of_input(from_catalog: bool) -> None:
    catalog = {TokenClass.INPUT: 3_000_000, TokenClass.OUTPUT: 15_000_000} if from_catalog else None
    prices = _billing("anthropic", "{input: 3, output: 15}", catalog, READS.prompt_tokens)
    assert prices[TokenClass.CACHED_INPUT] == 300_000
    cost = price_usage(READS, prices)
    assert cost.cost_pico_usd == 100 * 3_000_000 + 100_000 * 300_000 + 10 * 15_000_000
    assert cost.savings_pico_usd == 100_000 * (3_000_000 - 300_000)


def test_a_read_price_set_is_kept() -> None:
    prices = _billing("anthropic", "{input: 3, cached_input: 0.075, output: 15}")
    assert prices[TokenClass.CACHED_INPUT] == 75_000


def test_reads_follow_the_service_tier_s_and_the_long_context_input_price() -> None:
    price = "{input: 3, output: 15, tiers: {batch: {input: 1.5, output: 7.5}}, long_context: {above_prompt_tokens: 200000, input: 6, output: 22.5}}"
    assert _billing("anthropic", price, prompt_tokens=10, tier="batch")[TokenClass.CACHED_INPUT] == 150_000
    assert _billing("anthropic", price, prompt_tokens=200_001)[TokenClass.CACHED_INPUT] == 600_000
    # A batch attempt's long prompt: the batch input price times the long-context multiple, a tenth of it.
    assert (
        _billing("anthropic", price, prompt_tokens=200_001, tier="batch")[TokenClass.CACHED_INPUT] == 300_000
    )


@pytest.mark.parametrize(("vendor", "read_usd"), [("anthropic", 0.3), ("openai", 3)])
def test_cheapest_expects_the_reads_billing_will_bill(vendor: str, read_usd: float) -> None:
    text = f"backends: [{{name: b, type: {vendor}, base_url: u}}]\nmodels: [{{name: m, backend: b, price: {{input: 3, output: 15}}}}]"
    config = parse_config(text)
    target = Target(config.models[0], config.backends[0], None)  # type: ignore[arg-type]
    marked = Message(role="user", content="w " * 400, cache_control={"type": "ephemeral"})
    feats = features(ChatRequest(model="m", messages=[marked]), None, None)
    choice = Choice(target, Candidate(model="m", cache_hit_rate=0.5))
    cost = expected_cost(choice, feats, 100, PolicyContext(RoutingStats()))
    prompt = feats.prompt_tokens
    assert cost == pytest.approx((prompt * 0.5 * 3 + prompt * 0.5 * read_usd + 100 * 15) / 1e6)
