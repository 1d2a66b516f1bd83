"""Long-context price tiers: a prompt above the model's `price.long_context.above_prompt_tokens` bills
every token of the attempt at the tier's rates; one at or below the threshold at the base rates."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pytest

from gateway.accounting.admission import Admission, Quotas, budget_key, month_of
from gateway.accounting.pricing import LongContextSheet, PriceCatalog, PriceRow, TokenClass, price_usage
from gateway.config import Backend, ConfigError, Model, parse_config
from gateway.pipeline import Pipeline
from gateway.router_basic import Target
from gateway.state import MemoryState
from gateway.usage import Usage
from routing.plan import Choice, features
from routing.policies import PolicyContext, expected_cost
from routing.routes import Candidate
from routing.stats import RoutingStats
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway, full_config_text, gateway_on_fakes

# claude-sonnet's base sheet (conftest): input 3, cached 0.30, 5m writes 3.75, 1h writes 6, output 15.
TIER = (
    "long_context: {above_prompt_tokens: 40, input: 6.0, cached_input: 0.60, cache_write_5m: 7.50, "
    "cache_write_1h: 12.0, output: 22.50}"
)


@pytest.fixture(scope="module")
def tiered(fake_vendors: FakeVendors) -> Iterator[RunningGateway]:
    text = full_config_text().replace(
        "output: 15.0, web_search_per_1k: 10}", f"output: 15.0, web_search_per_1k: 10, {TIER}}}"
    )
    assert TIER in text
    with gateway_on_fakes(text, fake_vendors) as gateway:
        yield gateway


def _ask(gateway: RunningGateway, words: int) -> tuple[int, int, int]:
    gateway.sink.events.clear()
    gateway.anthropic(DEMO_KEY).messages.create(
        model="claude-sonnet", max_tokens=5, messages=[{"role": "user", "content": "w " * words}]
    )
    (event,) = gateway.sink.events
    return event.usage.prompt_tokens, event.usage.output_tokens, event.cost_pico_usd


def test_a_prompt_above_the_threshold_bills_every_token_at_the_tier(tiered: RunningGateway) -> None:
    prompt, output, cost = _ask(tiered, 60)
    assert prompt > 40 and output > 0
    assert tiered.sink.events[0].usage.prompt_tokens == tiered.sink.events[0].usage.input_tokens
    assert cost == prompt * 6_000_000 + output * 22_500_000  # pico-USD: micro-USD per 1M tokens x tokens
    assert tiered.sink.events[0].prices["input"] == 6_000_000


def test_a_prompt_at_or_below_the_threshold_bills_at_the_base(tiered: RunningGateway) -> None:
    prompt, output, cost = _ask(tiered, 10)
    assert 0 < prompt <= 40
    assert cost == prompt * 3_000_000 + output * 15_000_000
    assert tiered.sink.events[0].prices["input"] == 3_000_000


def test_cheapest_estimates_a_long_prompt_at_the_tier(tiered: RunningGateway) -> None:
    from tests.routing.routed import runtime

    target = runtime(tiered).models.targets["claude-sonnet"]
    ctx = PolicyContext(RoutingStats())
    choice = Choice(target, Candidate(model="claude-sonnet"))
    from gateway.types import ChatRequest, Message

    def cost(words: int) -> tuple[int, float]:
        feats = features(
            ChatRequest(model="x", messages=[Message(role="user", content="w " * words)]), None, None
        )
        return feats.prompt_tokens, expected_cost(choice, feats, 100, ctx)

    short_tokens, short = cost(5)
    long_tokens, long = cost(200)
    assert short_tokens <= 40 < long_tokens
    assert short == pytest.approx((short_tokens * 3 + 100 * 15) / 1e6)
    assert long == pytest.approx((long_tokens * 6 + 100 * 22.5) / 1e6)


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        (
            "{above_prompt_tokens: 0, input: 6}",
            r"models\[0\]\.price\.long_context\.above_prompt_tokens: Expected `int` >= 1",
        ),
        (
            "{above_prompt_tokens: 1.5, input: 6}",
            r"models\[0\]\.price\.long_context\.above_prompt_tokens: Expected `int`",
        ),
        (
            "{input: 6}",
            r"models\[0\]\.price\.long_context: Object missing required field `above_prompt_tokens`",
        ),
        (
            "{above_prompt_tokens: 200000, output: -1}",
            r"models\[0\]\.price\.long_context: output: price must be a non-negative",
        ),
        (
            "{above_prompt_tokens: 200000, input: 0.0000001}",
            r"models\[0\]\.price\.long_context: input: .*more than 6 decimals",
        ),
        (
            "{above_prompt_tokens: 200000, inptu: 6}",
            r"models\[0\]\.price\.long_context: Object contains unknown field `inptu`",
        ),
    ],
)
def test_a_bad_tier_is_a_config_error(tier: str, message: str) -> None:
    text = f"backends: [{{name: b, type: openai, base_url: u}}]\nmodels: [{{name: m, backend: b, price: {{input: 3, long_context: {tier}}}}}]"
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


def test_a_tier_parses() -> None:
    text = "backends: [{name: b, type: openai, base_url: u}]\nmodels: [{name: m, backend: b, price: {input: 3, long_context: {above_prompt_tokens: 200000, input: 6}}}]"
    tier = parse_config(text).models[0].price.long_context
    assert (
        tier is not None
        and tier.above_prompt_tokens == 200_000
        and str(tier.input) == "6"
        and tier.output is None
    )


def _tiered_model() -> Model:
    text = (
        "backends: [{name: b, type: anthropic, base_url: u}]\n"
        "models: [{name: m, backend: b, price: {input: 3, output: 15, "
        "long_context: {above_prompt_tokens: 200000, input: 6, output: 22.5}}}]"
    )
    return parse_config(text).models[0]


def test_the_tier_scales_the_catalog_s_prices_and_keeps_the_classes_it_leaves_out() -> None:
    """With an admin DB the catalog's prices bill (seeded from the config): above the threshold each
    class the tier sets bills at the catalog's price times the tier's multiple of the config's base
    (input 6 / 3: twice the catalog's 4), and a class the tier leaves out keeps the catalog's price."""
    model = _tiered_model()
    pipeline = Pipeline(None, None, None, [model])  # type: ignore[arg-type]
    target = Target(model, Backend(name="b", type="anthropic", base_url="u"), None)  # type: ignore[arg-type]
    catalog = {TokenClass.INPUT: 4_000_000, TokenClass.CACHED_INPUT: 400_000, TokenClass.OUTPUT: 20_000_000}
    pipeline.catalog = lambda backend, upstream, at, tier: catalog
    at = dt.datetime.now(dt.UTC)
    # Cache writes the prices leave out: Anthropic's 1.25x and 2x the input price that bills.
    assert pipeline.billing_prices(target, at, 200_000) == catalog | {
        TokenClass.CACHE_WRITE_5M: 5_000_000,
        TokenClass.CACHE_WRITE_1H: 8_000_000,
    }
    assert pipeline.billing_prices(target, at, 200_001) == {
        TokenClass.INPUT: 8_000_000,
        TokenClass.CACHED_INPUT: 400_000,
        TokenClass.CACHE_WRITE_5M: 10_000_000,
        TokenClass.CACHE_WRITE_1H: 16_000_000,
        TokenClass.OUTPUT: 30_000_000,
    }
    # Cache reads and writes count toward the threshold (Anthropic: input + cache reads + writes).
    usage = Usage(input_tokens=1, cached_input_tokens=150_000, cache_write_5m_tokens=50_000, output_tokens=2)
    cost = price_usage(usage, pipeline.billing_prices(target, at, usage.prompt_tokens))
    assert cost.cost_pico_usd == 8_000_000 + 150_000 * 400_000 + 50_000 * 10_000_000 + 2 * 30_000_000


@pytest.mark.parametrize("from_catalog", [False, True])
def test_a_long_prompt_at_a_service_tier_keeps_the_tier_s_discount(from_catalog: bool) -> None:
    """OpenAI bills a prompt above 272K tokens at 2x input and 1.5x output at standard, batch and
    flex alike; Anthropic's and Gemini's batch prices are half of each context tier's. The long
    context's rates replaced the tier's, so a flex attempt's long prompt was billed at the standard
    long-context rates (twice what OpenAI bills): they now scale the tier's own prices."""
    text = (
        "backends: [{name: b, type: openai, base_url: u}]\n"
        "models: [{name: gpt-5.4, backend: b, price: {input: 2.5, cached_input: 0.25, output: 15, "
        "tiers: {flex: {input: 1.25, cached_input: 0.125, output: 7.5}}, "
        "long_context: {above_prompt_tokens: 272000, input: 5, cached_input: 0.5, output: 22.5}}}]"
    )
    model = parse_config(text).models[0]
    pipeline = Pipeline(None, None, None, [model])  # type: ignore[arg-type]
    target = Target(model, Backend(name="b", type="openai", base_url="u"), None)  # type: ignore[arg-type]
    if from_catalog:  # the catalog as the config seeds it, at the flex tier
        flex = {TokenClass.INPUT: 1_250_000, TokenClass.CACHED_INPUT: 125_000, TokenClass.OUTPUT: 7_500_000}
        pipeline.catalog = lambda backend, upstream, at, tier: flex
    at = dt.datetime.now(dt.UTC)
    assert pipeline.billing_prices(target, at, 272_001, "flex") == {
        TokenClass.INPUT: 2_500_000,
        TokenClass.CACHED_INPUT: 250_000,
        TokenClass.OUTPUT: 11_250_000,
    }
    # At the threshold, the flex prices; a standard attempt's long prompt, the tier's rates as set.
    assert pipeline.billing_prices(target, at, 272_000, "flex")[TokenClass.INPUT] == 1_250_000
    if not from_catalog:
        assert pipeline.billing_prices(target, at, 272_001, "default") == {
            TokenClass.INPUT: 5_000_000,
            TokenClass.CACHED_INPUT: 500_000,
            TokenClass.OUTPUT: 22_500_000,
        }


def test_a_scaled_rate_rounds_half_to_even_and_an_unpriced_base_class_bills_the_rate() -> None:
    tier = LongContextSheet(
        10,
        {TokenClass.INPUT: 5, TokenClass.CACHE_WRITE_1H: 12},
        base={TokenClass.INPUT: 2},
    )
    assert tier.apply({TokenClass.INPUT: 3, TokenClass.CACHE_WRITE_1H: 7}, 11) == {
        TokenClass.INPUT: 8,  # 3 x 5 / 2 = 7.5: to even
        TokenClass.CACHE_WRITE_1H: 12,  # the base sets no 1-hour price to scale by: as set
    }


async def test_a_long_prompt_s_budget_estimate_is_at_the_tier() -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    catalog = PriceCatalog(
        [PriceRow("*", "m", TokenClass.INPUT, 10**7, t0), PriceRow("*", "m", TokenClass.OUTPUT, 10**7, t0)]
    )
    tier = LongContextSheet(40, {TokenClass.INPUT: 2 * 10**7, TokenClass.OUTPUT: 3 * 10**7})
    state = MemoryState()
    admission = Admission(state, lambda: catalog)
    quotas = Quotas("t", None, tenant_budget_micro_usd=10**6)
    budget = budget_key("tenant", "t", month_of(dt.datetime.now(dt.UTC)))
    await admission.admit(
        "short", quotas, "b", "m", prompt_tokens=40, max_output_tokens=10, long_context=tier
    )
    assert await state.budget_usage(budget) == (0, 50 * 10**7)
    await admission.admit("long", quotas, "b", "m", prompt_tokens=41, max_output_tokens=10, long_context=tier)
    assert await state.budget_usage(budget) == (0, 50 * 10**7 + 41 * 2 * 10**7 + 10 * 3 * 10**7)
    await state.close()
