"""Pricing: which price was valid for (backend, model, token class) at a moment, and what usage cost.

The catalog holds every price row ever set; rows are only added, so pricing an old event again gives
the same answer (a price change never rewrites history).
"""

from __future__ import annotations

import bisect
import datetime as dt
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from typing import Annotated

import msgspec

from gateway.usage import Usage

ANY_BACKEND = "*"


class TokenClass(StrEnum):
    """What a price row prices: a class of tokens, or `web_search`, one search of Anthropic's web
    search tool, priced like a token (micro-USD per 1M searches: $10 per 1,000 is 10^10), so one
    catalog, one cost formula and one ledger column per class serve both."""

    INPUT = "input"
    CACHED_INPUT = "cached_input"
    CACHE_WRITE_5M = "cache_write_5m"
    CACHE_WRITE_1H = "cache_write_1h"
    OUTPUT = "output"
    WEB_SEARCH = "web_search"


# Which Usage field each class bills. Reasoning tokens are part of output_tokens and billed there.
USAGE_FIELD: dict[TokenClass, str] = {
    TokenClass.INPUT: "input_tokens",
    TokenClass.CACHED_INPUT: "cached_input_tokens",
    TokenClass.CACHE_WRITE_5M: "cache_write_5m_tokens",
    TokenClass.CACHE_WRITE_1H: "cache_write_1h_tokens",
    TokenClass.OUTPUT: "output_tokens",
    TokenClass.WEB_SEARCH: "web_search_requests",
}

# Classes billed per request, not per token: the admin API takes and shows their price per 1,000
# requests (`usd_per_1k_requests`), as vendors quote it, and refuses a price per 1M tokens for them.
PER_REQUEST: frozenset[TokenClass] = frozenset({TokenClass.WEB_SEARCH})

# A class without its own price is billed like this one (vendors that do not discount cache reads or
# charge extra for writes simply leave those classes out).
FALLBACK: dict[TokenClass, TokenClass] = {
    TokenClass.CACHED_INPUT: TokenClass.INPUT,
    TokenClass.CACHE_WRITE_5M: TokenClass.INPUT,
    TokenClass.CACHE_WRITE_1H: TokenClass.CACHE_WRITE_5M,
}


# Vendors that bill prompt-cache reads and writes as multiples of the input price: a price sheet of one
# of their models that leaves a cache class out bills it by the vendor's rule (`vendor_prices`), not at
# the generic fallback above. Anthropic: cache reads at 0.1x the input price, 5-minute writes at 1.25x,
# 1-hour writes at 2x (a model whose published read price differs sets `cached_input` itself).
CACHE_MULTIPLES: dict[str, dict[TokenClass, Fraction]] = {
    "anthropic": {
        TokenClass.CACHED_INPUT: Fraction(1, 10),
        TokenClass.CACHE_WRITE_5M: Fraction(5, 4),
        TokenClass.CACHE_WRITE_1H: Fraction(2),
    },
}


# A vendor's service tier name as its responses report it: OpenAI's `flex`, `priority`, `default`;
# Anthropic's `priority`, `standard`, `batch`.
TierName = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]

# The service tier of the base prices: the one an attempt is billed at when its vendor reports no
# tier, or one without prices of its own.
BASE_TIER = ""

# (backend, upstream model, moment, service tier served or None) -> the prices valid then, by token
# class (`PriceCatalog.prices_at`); empty where none are.
PricesAt = Callable[[str, str, dt.datetime, str | None], dict[TokenClass, int]]


@dataclass(frozen=True, slots=True)
class PriceRow:
    backend: str
    model: str
    token_class: TokenClass
    micro_usd_per_mtok: int
    effective_from: dt.datetime
    service_tier: str = BASE_TIER  # a tier's price (`flex`, `priority`) overrides the base price


@dataclass(frozen=True, slots=True)
class Cost:
    prices: dict[str, int]  # token class -> micro-USD per 1M tokens (or searches) actually applied
    cost_pico_usd: int
    savings_pico_usd: int  # what the cache reads would have cost at the input price, minus what they cost


def resolve(prices: dict[TokenClass, int]) -> dict[TokenClass, int]:
    """Fill unpriced classes from their fallbacks; a sheet without an input price stays as it is."""
    full = dict(prices)
    for token_class in (TokenClass.CACHED_INPUT, TokenClass.CACHE_WRITE_5M, TokenClass.CACHE_WRITE_1H):
        if token_class not in full and FALLBACK[token_class] in full:
            full[token_class] = full[FALLBACK[token_class]]
    return full


# Sheets a vendor's rule filled (`vendor_prices`), by the id of the sheet filled, kept as `_sheets` are:
# the same filled dict for the same sheet, so that `sheet_of` resolves it once.
_filled: dict[
    tuple[int, str], tuple[dict[TokenClass, int], dict[TokenClass, int], dict[TokenClass, int]]
] = {}


def vendor_prices(prices: dict[TokenClass, int], vendor: str) -> dict[TokenClass, int]:
    """`prices` with the cache classes they leave out priced by `vendor`'s rule (CACHE_MULTIPLES:
    Anthropic's 0.1x the input price for reads, 1.25x and 2x for writes), where it has one and `prices`
    price input; else `prices` itself. Do not modify the result: it is shared."""
    multiples = CACHE_MULTIPLES.get(vendor)
    if not multiples or TokenClass.INPUT not in prices or all(c in prices for c in multiples):
        return prices
    entry = _filled.get((id(prices), vendor))
    if entry is not None and entry[0] is prices and entry[1] == prices:
        return entry[2]
    filled = dict(prices)
    for token_class, multiple in multiples.items():
        if token_class not in filled:
            filled[token_class] = round(prices[TokenClass.INPUT] * multiple)
    if len(_filled) >= _MAX_SHEETS:
        _filled.clear()
    _filled[(id(prices), vendor)] = (prices, dict(prices), filled)
    return filled


@dataclass(frozen=True, slots=True)
class _Sheet:
    """A price sheet resolved once: the applied prices and one integer per token class."""

    prices: dict[str, int]  # shared by every Cost priced from this sheet: do not modify
    input: int
    cached_input: int
    cache_write_5m: int
    cache_write_1h: int
    output: int
    web_search: int
    saved_per_token: int

    @classmethod
    def of(cls, prices: dict[TokenClass, int]) -> _Sheet:
        full = resolve(prices)
        return cls(
            prices={str(c): p for c, p in full.items()},
            input=full.get(TokenClass.INPUT, 0),
            cached_input=full.get(TokenClass.CACHED_INPUT, 0),
            cache_write_5m=full.get(TokenClass.CACHE_WRITE_5M, 0),
            cache_write_1h=full.get(TokenClass.CACHE_WRITE_1H, 0),
            output=full.get(TokenClass.OUTPUT, 0),
            web_search=full.get(TokenClass.WEB_SEARCH, 0),
            saved_per_token=full.get(TokenClass.INPUT, 0) - full.get(TokenClass.CACHED_INPUT, 0),
        )

    def price(self, usage: Usage) -> Cost:
        return Cost(
            prices=self.prices,
            cost_pico_usd=usage.input_tokens * self.input
            + usage.cached_input_tokens * self.cached_input
            + usage.cache_write_5m_tokens * self.cache_write_5m
            + usage.cache_write_1h_tokens * self.cache_write_1h
            + usage.output_tokens * self.output
            + usage.web_search_requests * self.web_search,
            savings_pico_usd=usage.cached_input_tokens * self.saved_per_token,
        )


@dataclass(frozen=True, slots=True)
class LongContextSheet:
    """A model's long-context tier: above `above_prompt_tokens` prompt tokens, every token of the
    attempt is billed at `rates` (the classes the tier sets) over the base prices.

    Vendors publish long-context prices as multiples of each service tier's own: OpenAI bills a long
    prompt at 2x input and 1.5x output at standard, batch and flex alike, Anthropic's and Gemini's
    batch prices are half of each context tier's. `base` holds the base prices the rates were written
    against (the config's): a class priced in both bills at the price the attempt's tier sets times
    rate / base, so a flex or batch attempt's long prompt keeps its discount, and one at the base
    prices bills exactly `rates`. A class `base` leaves unpriced (or at 0) bills at `rates` as set."""

    above_prompt_tokens: int
    rates: dict[TokenClass, int]
    base: dict[TokenClass, int] = field(default_factory=dict)

    def apply(self, prices: dict[TokenClass, int], prompt_tokens: int) -> dict[TokenClass, int]:
        """`prices` (the catalog's or the config's, at the tier served) as they bill a prompt of
        `prompt_tokens`."""
        if prompt_tokens <= self.above_prompt_tokens:
            return prices
        billed = dict(prices)
        for token_class, rate in self.rates.items():
            base = self.base.get(token_class, 0)
            price = prices.get(token_class)
            if base and price is not None:
                rate = _scaled(price, rate, base)
            billed[token_class] = rate
        return billed


def _scaled(price: int, rate: int, base: int) -> int:
    """`price` x `rate` / `base`, rounded half to even."""
    return round(Fraction(price * rate, base))


# Every attempt is priced, almost always from one of a few long-lived price dicts (the catalog's, the
# config's): resolve each once. The entry keeps the dict itself and a copy, so a dict modified since,
# or a new one at a recycled id, is resolved afresh.
_sheets: dict[int, tuple[dict[TokenClass, int], dict[TokenClass, int], _Sheet]] = {}
_MAX_SHEETS = 256


def sheet_of(prices: dict[TokenClass, int]) -> _Sheet:
    entry = _sheets.get(id(prices))
    if entry is not None and entry[0] is prices and entry[1] == prices:
        return entry[2]
    sheet = _Sheet.of(prices)
    if len(_sheets) >= _MAX_SHEETS:
        _sheets.clear()
    _sheets[id(prices)] = (prices, dict(prices), sheet)
    return sheet


def price_usage(usage: Usage, prices: dict[TokenClass, int]) -> Cost:
    """Exact cost of one attempt's usage. Unpriced classes (a model missing from the catalog) cost 0.
    `Cost.prices` is shared by every cost priced from the same sheet: do not modify it."""
    return sheet_of(prices).price(usage)


class PriceCatalog:
    """All price rows, indexed for "valid at" lookups. For each token class, a row of the tier served
    wins over a base row, and a backend-specific row over the `*` row of the same tier."""

    def __init__(self, rows: list[PriceRow] | None = None) -> None:
        self._series: dict[tuple[str, str, str, TokenClass], list[tuple[dt.datetime, int]]] = defaultdict(
            list
        )
        self._tiers: set[tuple[str, str]] = set()  # (model, tier) pairs that have rows of their own
        # (backend, model, tier) -> (from, until, prices): the answer of prices_at for any moment in
        # [from, until), since no row of that pair takes effect in between. Every request asks.
        self._cache: dict[tuple[str, str, str], tuple[dt.datetime, dt.datetime, dict[TokenClass, int]]] = {}
        for row in rows or ():
            self.add(row)

    def add(self, row: PriceRow) -> None:
        series = self._series[(row.backend, row.model, row.service_tier, TokenClass(row.token_class))]
        bisect.insort(series, (row.effective_from, row.micro_usd_per_mtok))
        self._tiers.add((row.model, row.service_tier))
        self._cache.clear()

    def prices_at(
        self, backend: str, model: str, at: dt.datetime, service_tier: str | None = None
    ) -> dict[TokenClass, int]:
        """The prices valid at `at` for an attempt served at `service_tier` (None: the vendor said
        none): the tier's own rows over the base ones (do not modify the dict: it is shared)."""
        # A tier without rows of its own is billed at the base prices: one cache entry for them all.
        tier = service_tier if service_tier and (model, service_tier) in self._tiers else BASE_TIER
        cached = self._cache.get((backend, model, tier))
        if cached is not None and cached[0] <= at < cached[1]:
            return cached[2]
        tiers = (BASE_TIER, tier) if tier else (BASE_TIER,)
        # Per token class: a backend's row for one class (a special output price) leaves its other
        # classes at the `*` rows' prices, not unpriced; a tier's rows leave the classes they do not
        # price at the base prices.
        found: dict[TokenClass, int] = {}
        for each in tiers:
            found |= self.scoped_prices(ANY_BACKEND, model, at, each)
            found |= self.scoped_prices(backend, model, at, each)
        start, until = dt.datetime.min.replace(tzinfo=dt.UTC), dt.datetime.max.replace(tzinfo=dt.UTC)
        for each in tiers:
            for scope in (backend, ANY_BACKEND):
                for token_class in TokenClass:
                    series = self._series.get((scope, model, each, token_class))
                    if series:
                        i = bisect.bisect_right(series, (at, float("inf")))
                        if i:
                            start = max(start, series[i - 1][0])
                        if i < len(series):
                            until = min(until, series[i][0])
        self._cache[(backend, model, tier)] = (start, until, found)
        return found

    def scoped_prices(
        self, backend: str, model: str, at: dt.datetime, service_tier: str = BASE_TIER
    ) -> dict[TokenClass, int]:
        """Prices of exactly this (backend, model, tier) valid at `at`, without falling back to `*`
        or to the base tier."""
        found: dict[TokenClass, int] = {}
        for token_class in TokenClass:
            series = self._series.get((backend, model, service_tier, token_class))
            if series:
                i = bisect.bisect_right(series, (at, float("inf")))
                if i:
                    found[token_class] = series[i - 1][1]
        return found

    def price(self, usage: Usage, backend: str, model: str, at: dt.datetime) -> Cost:
        return price_usage(usage, self.prices_at(backend, model, at, usage.service_tier))
