"""Pricing: every token class at its own price, in exact integers/Decimal, with the prices valid when
the request ran."""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable
from decimal import Decimal

import msgspec
import pytest

from gateway.accounting.money import (
    format_usd,
    pico_to_usd,
    usd_per_1k_requests_to_micro,
    usd_per_mtok_to_micro,
    usd_to_micro,
)
from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass, price_usage
from gateway.usage import Usage

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
T1 = dt.datetime(2026, 6, 1, tzinfo=dt.UTC)

# Claude-style sheet: USD per 1M tokens.
SHEET = {
    TokenClass.INPUT: usd_per_mtok_to_micro("3"),
    TokenClass.CACHED_INPUT: usd_per_mtok_to_micro("0.30"),
    TokenClass.CACHE_WRITE_5M: usd_per_mtok_to_micro("3.75"),
    TokenClass.CACHE_WRITE_1H: usd_per_mtok_to_micro("6"),
    TokenClass.OUTPUT: usd_per_mtok_to_micro("15"),
}


@pytest.mark.parametrize(
    ("field", "usd_per_mtok"),
    [
        ("input_tokens", "3"),
        ("cached_input_tokens", "0.30"),
        ("cache_write_5m_tokens", "3.75"),
        ("cache_write_1h_tokens", "6"),
        ("output_tokens", "15"),
    ],
)
def test_each_token_class_at_its_price(field: str, usd_per_mtok: str) -> None:
    usage = Usage(**{field: 1234})
    cost = price_usage(usage, SHEET)
    assert pico_to_usd(cost.cost_pico_usd) == Decimal(1234) * Decimal(usd_per_mtok) / 1_000_000


def test_mixed_usage_is_the_exact_sum_and_reasoning_is_not_billed_twice() -> None:
    usage = Usage(
        input_tokens=1001,
        cached_input_tokens=2002,
        cache_write_5m_tokens=303,
        cache_write_1h_tokens=44,
        output_tokens=555,
        reasoning_tokens=500,  # inside output_tokens
    )
    cost = price_usage(usage, SHEET)
    expected = (
        Decimal(1001) * Decimal("3")
        + Decimal(2002) * Decimal("0.30")
        + Decimal(303) * Decimal("3.75")
        + Decimal(44) * Decimal("6")
        + Decimal(555) * Decimal("15")
    ) / 1_000_000
    assert pico_to_usd(cost.cost_pico_usd) == expected
    assert (
        format_usd(pico_to_usd(cost.cost_pico_usd)) == "0.01332885"
    )  # 3003 + 600.6 + 1136.25 + 264 + 8325 micro-USD
    # Savings: the 2002 cache reads at the input price, minus what they cost.
    assert pico_to_usd(cost.savings_pico_usd) == Decimal(2002) * (Decimal("3") - Decimal("0.30")) / 1_000_000


def test_tiny_prices_stay_exact() -> None:
    sheet = {
        TokenClass.INPUT: usd_per_mtok_to_micro("0.075"),
        TokenClass.OUTPUT: usd_per_mtok_to_micro("0.000001"),
    }
    cost = price_usage(Usage(input_tokens=1, output_tokens=3), sheet)
    assert pico_to_usd(cost.cost_pico_usd) == Decimal("0.000000075003")


def test_unpriced_classes_fall_back_to_the_input_price() -> None:
    sheet = {TokenClass.INPUT: usd_per_mtok_to_micro("2"), TokenClass.OUTPUT: usd_per_mtok_to_micro("8")}
    cost = price_usage(Usage(cached_input_tokens=10, cache_write_1h_tokens=10), sheet)
    assert cost.prices["cached_input"] == cost.prices["cache_write_1h"] == 2_000_000
    assert cost.savings_pico_usd == 0


def test_prices_with_more_than_six_decimals_are_refused() -> None:
    with pytest.raises(ValueError, match="6 decimals"):
        usd_per_mtok_to_micro("0.0000001")
    with pytest.raises(ValueError):
        usd_per_mtok_to_micro("-1")


@pytest.mark.parametrize("convert", [usd_per_mtok_to_micro, usd_to_micro, usd_per_1k_requests_to_micro])
def test_amounts_beyond_what_a_decimal_holds_are_refused_in_words(convert: Callable[[str], int]) -> None:
    """An exponent that overflowed Decimal's context (`1E+1000000`) raised decimal.Overflow, which the
    admin API answered with a 500; a digit past Decimal's 28 significant ones was rounded away, and the
    amount passed for a whole number of micro-dollars it is not."""
    with pytest.raises(ValueError, match="too large"):
        convert("1E+1000000")
    with pytest.raises(ValueError, match="decimals"):
        convert("0.1000000000000000000000000000001")
    assert convert("1.000000000000000000000000000000000") == convert("1")  # zeros only: exact


def test_price_valid_when_the_request_ran_and_history_never_changes() -> None:
    catalog = PriceCatalog(
        [
            PriceRow("*", "gpt-x", TokenClass.INPUT, 2_500_000, T0),
            PriceRow("*", "gpt-x", TokenClass.OUTPUT, 10_000_000, T0),
        ]
    )
    usage = Usage(input_tokens=1000, output_tokens=100)
    before = catalog.price(usage, "openai", "gpt-x", T1 - dt.timedelta(seconds=1))
    catalog.add(PriceRow("*", "gpt-x", TokenClass.INPUT, 1_250_000, T1))
    again = catalog.price(usage, "openai", "gpt-x", T1 - dt.timedelta(seconds=1))
    after = catalog.price(usage, "openai", "gpt-x", T1)
    assert before == again
    assert before.cost_pico_usd == 1000 * 2_500_000 + 100 * 10_000_000
    assert after.cost_pico_usd == 1000 * 1_250_000 + 100 * 10_000_000
    # Nothing was valid before the first row.
    assert catalog.price(usage, "openai", "gpt-x", T0 - dt.timedelta(days=1)).cost_pico_usd == 0


def test_backend_specific_prices_win_over_any_backend() -> None:
    catalog = PriceCatalog(
        [
            PriceRow("*", "llama", TokenClass.INPUT, 1_000_000, T0),
            PriceRow("self-hosted", "llama", TokenClass.INPUT, 50_000, T0),
        ]
    )
    assert catalog.prices_at("self-hosted", "llama", T1) == {TokenClass.INPUT: 50_000}
    assert catalog.prices_at("together", "llama", T1) == {TokenClass.INPUT: 1_000_000}


def test_cached_lookups_match_fresh_ones_across_price_changes() -> None:
    """prices_at remembers an answer for the interval in which no row takes effect; asked in random
    order around many changes (backend rows and `*` rows), it must answer as a fresh catalog does."""
    rng = random.Random(5)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    rows = [
        PriceRow(
            rng.choice(["b1", "*"]),
            "m",
            rng.choice(list(TokenClass)),
            rng.randint(1, 10**7),
            t0 + dt.timedelta(hours=rng.randint(1, 100)),
        )
        for _ in range(40)
    ]
    cached = PriceCatalog(rows)
    for _ in range(500):
        at = t0 + dt.timedelta(hours=rng.randint(0, 110), minutes=rng.choice([0, 0, 30]))
        backend = rng.choice(["b1", "b2"])
        assert cached.prices_at(backend, "m", at) == PriceCatalog(rows).prices_at(backend, "m", at)


def test_a_backend_row_prices_only_its_own_token_class() -> None:
    """An admin gives one backend of a model its own output price: that backend's other classes stay
    at the `*` rows' prices (they used to cost 0: the backend's rows replaced the whole `*` sheet),
    and the class fallbacks apply to what the two together price."""
    catalog = PriceCatalog(
        [
            *(PriceRow("*", "claude", token_class, price, T0) for token_class, price in SHEET.items()),
            PriceRow("bedrock", "claude", TokenClass.OUTPUT, 12_000_000, T0),
            PriceRow("*", "llama", TokenClass.INPUT, 1_000_000, T0),
            PriceRow("*", "llama", TokenClass.OUTPUT, 4_000_000, T0),
            PriceRow("cheap", "llama", TokenClass.INPUT, 500_000, T1),
        ]
    )
    assert catalog.prices_at("bedrock", "claude", T1) == {**SHEET, TokenClass.OUTPUT: 12_000_000}
    assert catalog.prices_at("anthropic", "claude", T1) == SHEET
    usage = Usage(
        input_tokens=1000, cached_input_tokens=2000, cache_write_5m_tokens=300, cache_write_1h_tokens=40
    )
    billed = catalog.price(
        Usage(**{**msgspec.structs.asdict(usage), "output_tokens": 10}), "bedrock", "claude", T1
    )
    assert billed.cost_pico_usd == price_usage(usage, SHEET).cost_pico_usd + 10 * 12_000_000
    # Cache reads and writes unpriced everywhere fall back to the input price this backend pays.
    cheap = catalog.price(
        Usage(input_tokens=10, cached_input_tokens=20, output_tokens=1), "cheap", "llama", T1
    )
    assert cheap.prices == {
        "input": 500_000,
        "output": 4_000_000,
        "cached_input": 500_000,
        "cache_write_5m": 500_000,
        "cache_write_1h": 500_000,
    }
    assert cheap.cost_pico_usd == 30 * 500_000 + 4_000_000
    # Before the backend's own row took effect, the `*` rows alone.
    assert catalog.prices_at("cheap", "llama", T0) == {
        TokenClass.INPUT: 1_000_000,
        TokenClass.OUTPUT: 4_000_000,
    }


# --- service tiers ----------------------------------------------------------------------------------


def _tiered_catalog() -> PriceCatalog:
    micro = usd_per_mtok_to_micro
    return PriceCatalog(
        [
            PriceRow("*", "gpt-5-mini", TokenClass.INPUT, micro("0.25"), T0),
            PriceRow("*", "gpt-5-mini", TokenClass.OUTPUT, micro("2"), T0),
            PriceRow("*", "gpt-5-mini", TokenClass.INPUT, micro("0.125"), T0, "flex"),
            PriceRow("*", "gpt-5-mini", TokenClass.OUTPUT, micro("1"), T0, "flex"),
            PriceRow("azure", "gpt-5-mini", TokenClass.OUTPUT, micro("2.2"), T0),  # the base, one backend
            PriceRow("*", "gpt-5-mini", TokenClass.OUTPUT, micro("0.9"), T1, "flex"),  # a later flex price
        ]
    )


def test_a_tier_served_is_priced_at_its_own_rows_over_the_base() -> None:
    catalog = _tiered_catalog()
    at = T0 + dt.timedelta(days=1)
    assert catalog.prices_at("openai", "gpt-5-mini", at, "flex") == {
        TokenClass.INPUT: 125_000,
        TokenClass.OUTPUT: 1_000_000,
    }
    # A tier's row wins over a backend's base row: flex is priced as flex on every backend.
    assert catalog.prices_at("azure", "gpt-5-mini", at, "flex")[TokenClass.OUTPUT] == 1_000_000
    # A tier without rows of its own, or none reported: the base prices.
    base = {TokenClass.INPUT: 250_000, TokenClass.OUTPUT: 2_000_000}
    assert catalog.prices_at("openai", "gpt-5-mini", at, "priority") == base
    assert catalog.prices_at("openai", "gpt-5-mini", at, None) == base
    assert catalog.prices_at("openai", "gpt-5-mini", at) == base
    # A tier's price change applies from its moment on, as any other (the cache's window included).
    assert catalog.prices_at("openai", "gpt-5-mini", T1, "flex")[TokenClass.OUTPUT] == 900_000
    assert catalog.prices_at("openai", "gpt-5-mini", at, "flex")[TokenClass.OUTPUT] == 1_000_000
    usage = Usage(input_tokens=1000, output_tokens=100, service_tier="flex")
    assert catalog.price(usage, "openai", "gpt-5-mini", at).cost_pico_usd == 1000 * 125_000 + 100 * 1_000_000
