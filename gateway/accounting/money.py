"""Money units. Prices are integer micro-dollars per million tokens; costs are integer pico-dollars
(10^-12 USD): tokens x micro-dollars-per-1M is then exactly a cost in pico-dollars, with no rounding."""

from __future__ import annotations

from decimal import Decimal, Inexact, localcontext

PICO_PER_USD = 10**12
MICRO_PER_USD = 10**6
# Amounts live in 64-bit columns. A price is capped lower, so that tokens x price (a request's cost
# in pico-dollars) fits too for requests up to ~9M tokens.
MAX_PRICE_MICRO = 10**12  # USD 1,000,000 per 1M tokens
# A monthly budget's counter (spent + reserved, in pico-dollars) is a signed 64-bit integer in Redis
# (HINCRBY), which holds USD 9.22M. Admission keeps spent + reserved + the next estimate within the
# budget, so the counter passes it only by what settled costs exceed their estimates: a budget of at
# most USD 1M (10^18 pico) leaves USD 8.2M of headroom for that, and any request estimated above the
# budget is refused before it is counted.
MAX_BUDGET_MICRO = 10**12  # USD 1,000,000 a month


def _scaled(amount: Decimal, factor: int) -> Decimal | None:
    """`amount` x `factor` exactly, or None where that needs more digits than a Decimal's 28: rounded,
    a digit past them was dropped, and the amount passed for a whole number of units it is not."""
    with localcontext() as context:
        context.traps[Inexact] = True
        try:
            return amount * factor
        except Inexact:
            return None


def usd_per_mtok_to_micro(value: Decimal | str | int, *, limit: int = MAX_PRICE_MICRO) -> int:
    """`"2.50"` USD per 1M tokens -> 2_500_000. More than six decimals cannot be held exactly: refused."""
    amount = Decimal(str(value))
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"price must be a non-negative number, got {value!r}")
    # Compared before it is scaled: an exponent such as 1E+1000000 overflowed the multiplication.
    if amount > Decimal(limit) / MICRO_PER_USD:
        raise ValueError(f"{value!r} is too large (at most {Decimal(limit) / MICRO_PER_USD} USD)")
    micro = _scaled(amount, MICRO_PER_USD)
    if micro is None or micro != micro.to_integral_value():
        raise ValueError(f"price {value!r} has more than 6 decimals (USD per 1M tokens)")
    return int(micro)


def micro_to_usd(micro: int) -> Decimal:
    return Decimal(micro) / MICRO_PER_USD


# A class billed per request (web searches) is held like a token class, in micro-USD per 1M requests,
# but vendors quote it per 1,000 requests ($10 per 1,000 searches): the admin API reads and writes it
# in their unit, so nobody has to multiply by 1,000 to type a price.
MICRO_PER_USD_PER_1K = MICRO_PER_USD * 1000


def usd_per_1k_requests_to_micro(value: Decimal | str | int) -> int:
    """`"10"` USD per 1,000 requests -> 10^10 micro-USD per 1M requests. More than nine decimals
    cannot be held exactly: refused, as is more than the price cap."""
    amount = Decimal(str(value))
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"price must be a non-negative number, got {value!r}")
    limit = Decimal(MAX_PRICE_MICRO) / MICRO_PER_USD_PER_1K
    if amount > limit:  # before it is scaled, as above
        raise ValueError(f"{value!r} is too large (at most {limit} USD per 1,000 requests)")
    micro = _scaled(amount, MICRO_PER_USD_PER_1K)
    if micro is None or micro != micro.to_integral_value():
        raise ValueError(f"price {value!r} has more than 9 decimals (USD per 1,000 requests)")
    return int(micro)


def micro_to_usd_per_1k_requests(micro: int) -> Decimal:
    return Decimal(micro) / MICRO_PER_USD_PER_1K


def usd_to_micro(value: Decimal | str | int) -> int:
    """Budgets: `"100.25"` USD -> 100_250_000 micro-dollars (more than six decimals, or more than
    MAX_BUDGET_MICRO, refused)."""
    return usd_per_mtok_to_micro(value, limit=MAX_BUDGET_MICRO)


def pico_to_usd(pico: int) -> Decimal:
    # Decimal division by a power of ten is exact within the default 28-digit context.
    return Decimal(pico) / PICO_PER_USD


def micro_to_pico(micro: int) -> int:
    """Budgets are set in micro-dollars and counted in pico-dollars, as the ledger counts costs."""
    return micro * (PICO_PER_USD // MICRO_PER_USD)


def format_usd(amount: Decimal) -> str:
    """Plain decimal string (no exponent) for JSON and CSV: `0.000000123`, not `1.23E-7`."""
    text = format(amount.normalize(), "f")
    return text if text != "-0" else "0"
