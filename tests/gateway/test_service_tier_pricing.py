"""Service tiers without an admin DB: the config's `price.tiers` (checked as the config loads) bill an
attempt its vendor says it served at that tier, and `cheapest` prices a request at the tier it asks
for. With the admin DB, the ledger and the catalog: tests/control/test_service_tiers.py."""

from __future__ import annotations

import datetime as dt

import pytest

from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.config import ConfigError, Model, parse_config
from gateway.estimate import Produced, asked_tier, whole_answer
from gateway.pipeline import Pipeline
from gateway.router_basic import Target
from gateway.types import ChatRequest, Message
from routing.plan import Choice, features
from routing.policies import PolicyContext, expected_cost
from routing.routes import Candidate
from routing.stats import RoutingStats


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ("{Flex: {input: 1}}", r"models\[0\]\.price\.tiers \(a key\): Expected `str` matching regex"),
        ("{'': {input: 1}}", r"models\[0\]\.price\.tiers \(a key\): Expected `str` matching regex"),
        ("{flex: {}}", r"models\[0\]\.price: tiers\.flex: sets no price"),
        (
            "{flex: {output: -1}}",
            r"models\[0\]\.price\.tiers\[\.\.\.\]: output: price must be a non-negative",
        ),
        ("{flex: {input: 0.0000001}}", r"models\[0\]\.price\.tiers\[\.\.\.\]: input: .*more than 6 decimals"),
        ("{flex: {inptu: 1}}", r"models\[0\]\.price\.tiers\[\.\.\.\]: Object contains unknown field `inptu`"),
        ("{flex: {input: 1, above_prompt_tokens: 5}}", r"unknown field `above_prompt_tokens`"),
    ],
)
def test_a_bad_service_tier_price_is_a_config_error(tiers: str, message: str) -> None:
    text = f"backends: [{{name: b, type: openai, base_url: u}}]\nmodels: [{{name: m, backend: b, price: {{input: 3, tiers: {tiers}}}}}]"
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


def test_service_tier_prices_parse() -> None:
    text = "backends: [{name: b, type: openai, base_url: u}]\nmodels: [{name: m, backend: b, price: {input: 2, output: 8, tiers: {flex: {input: 1}, priority: {input: 3.5, output: 14}}}}]"
    tiers = parse_config(text).models[0].price.tiers
    assert set(tiers) == {"flex", "priority"}
    assert str(tiers["flex"].input) == "1" and tiers["flex"].output is None


def _model() -> Model:
    text = (
        "backends: [{name: b, type: openai, base_url: u}]\n"
        "models: [{name: m, backend: b, price: {input: 0.25, output: 2, "
        "tiers: {flex: {input: 0.125, output: 1}, priority: {input: 0.45}}}}]"
    )
    return parse_config(text).models[0]


def test_the_config_s_tier_prices_bill_an_attempt_served_at_that_tier() -> None:
    model = _model()
    pipeline = Pipeline(None, None, None, [model])  # type: ignore[arg-type]
    target = Target(model, parse_config("backends: [{name: b, type: openai, base_url: u}]").backends[0], None)  # type: ignore[arg-type]
    at = dt.datetime.now(dt.UTC)
    assert pipeline.billing_prices(target, at, 10, "flex") == {
        TokenClass.INPUT: 125_000,
        TokenClass.OUTPUT: 1_000_000,
    }
    # A class the tier leaves out keeps the base price; an unpriced or unreported tier is the base.
    assert pipeline.billing_prices(target, at, 10, "priority") == {
        TokenClass.INPUT: 450_000,
        TokenClass.OUTPUT: 2_000_000,
    }
    base = {TokenClass.INPUT: 250_000, TokenClass.OUTPUT: 2_000_000}
    assert pipeline.billing_prices(target, at, 10, "default") == base
    assert pipeline.billing_prices(target, at, 10, None) == base


def _cost(model: Model, tier: str | None, ctx: PolicyContext) -> tuple[int, float]:
    target = Target(model, parse_config("backends: [{name: b, type: openai, base_url: u}]").backends[0], None)  # type: ignore[arg-type]
    request = ChatRequest(model="m", messages=[Message(role="user", content="w " * 50)], service_tier=tier)
    feats = features(request, None, None)
    assert feats.service_tier == tier
    return feats.prompt_tokens, expected_cost(Choice(target, Candidate(model="m")), feats, 100, ctx)


@pytest.mark.parametrize(
    ("tier", "input_usd", "output_usd"),
    [("flex", 0.125, 1), ("priority", 0.45, 2), ("auto", 0.25, 2), (None, 0.25, 2)],
)
def test_cheapest_prices_a_request_at_the_tier_it_asks_for(
    tier: str | None, input_usd: float, output_usd: float
) -> None:
    prompt, cost = _cost(_model(), tier, PolicyContext(RoutingStats()))
    assert cost == pytest.approx((prompt * input_usd + 100 * output_usd) / 1e6)


def test_cheapest_prices_the_tier_asked_for_from_the_catalog() -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    catalog = PriceCatalog(
        [
            PriceRow("*", "m", TokenClass.INPUT, 300_000, t0),
            PriceRow("*", "m", TokenClass.OUTPUT, 3_000_000, t0),
            PriceRow("*", "m", TokenClass.OUTPUT, 1_500_000, t0, "flex"),
        ]
    )
    ctx = PolicyContext(
        RoutingStats(), prices=lambda backend, model, tier: catalog.prices_at(backend, model, t0, tier)
    )
    prompt, cost = _cost(_model(), "flex", ctx)
    assert cost == pytest.approx((prompt * 0.30 + 100 * 1.5) / 1e6)


@pytest.mark.parametrize(
    ("body", "tier"),
    [
        (b'{"model": "m", "service_tier": "flex"}', "flex"),
        (b'{"model": "m", "service_tier": "priority", "stream": true}', "priority"),
        # The vendor decides (`auto`), the base price (`default`, Anthropic's `standard_only`), none.
        (b'{"model": "m", "service_tier": "auto"}', None),
        (b'{"model": "m", "service_tier": "default"}', None),
        (b'{"model": "m", "service_tier": "standard_only"}', None),
        (b'{"model": "m"}', None),
        (b'{"model": "m", "service_tier": ["flex"]}', None),
        (b'{"messages": [{"content": "\\"service_tier\\""}]', None),  # cut short: unreadable
    ],
)
def test_the_tier_a_request_body_asks_for(body: bytes, tier: str | None) -> None:
    assert asked_tier(body) == tier
    assert Produced().estimate(body).service_tier == tier
    assert whole_answer(body, None, 0).service_tier == tier
