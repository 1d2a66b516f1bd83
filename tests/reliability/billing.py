"""What the control plane's config (tests/fixtures/gateway.py) bills a request: a prompt of known length,
the tenant's ledger rows once they land, and the price of tokens at the config's prices."""

from __future__ import annotations

from decimal import Decimal

from tests.fixtures.db import wait_rows
from tests.fixtures.gateway import PRICE, Weir

WORDS = " ".join(f"w{i}" for i in range(40))  # the fake echoes one word per chunk, one token per word


def ledger(weir: Weir, tenant_id: str, timeout: float = 15) -> list[tuple]:
    """The tenant's ledger rows (input and output tokens, cost, status, estimated), waiting up to
    `timeout` seconds for the first to land."""
    return wait_rows(
        weir.db_url,
        "SELECT input_tokens, output_tokens, cost_pico_usd, status, estimated "
        f"FROM usage_events WHERE tenant_id = '{tenant_id}'",
        timeout=timeout,
    )


def pico(input_tokens: int, output_tokens: int) -> int:
    """What these tokens cost at the config's prices, in pico-USD."""
    usd = (Decimal(input_tokens) * PRICE["input"] + Decimal(output_tokens) * PRICE["output"]) / 10**6
    return int(usd * 10**12)
