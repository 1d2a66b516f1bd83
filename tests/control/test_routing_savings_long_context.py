"""The routing-savings report prices its baseline (the route's most expensive candidate) as the
attempt itself was billed: at the long-context rates of a prompt above the model's threshold."""

from __future__ import annotations

from decimal import Decimal

import openai
import pytest

from tests.fakes import FakeOpenAI
from tests.fixtures.db import wait_rows
from tests.fixtures.gateway import Weir

# USD per 1M tokens; both models bill a prompt above 1,000 tokens at twice their base rates, as
# Gemini 2.5 Pro and Claude Sonnet's 1M context do above 200K.
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - name: small
    backend: openai
    model: gpt-5-mini
    price: {input: 1, output: 2, long_context: {above_prompt_tokens: 1000, input: 2, output: 4}}
  - name: large
    backend: openai
    model: gpt-5
    price: {input: 1.5, output: 3, long_context: {above_prompt_tokens: 1000, input: 3, output: 6}}
routes:
  - {name: pair, candidates: [{model: small}, {model: large}], probe_interval: null}
database_url: "${DB_URL}"
"""


@pytest.fixture
def weir_config() -> str:
    return CONFIG


def micro(input_usd: str, output_usd: str, input_tokens: int, output_tokens: int) -> Decimal:
    """USD of these tokens at these USD-per-1M prices."""
    return (input_tokens * Decimal(input_usd) + output_tokens * Decimal(output_usd)) / 10**6


@pytest.mark.parametrize(("prompt", "long"), [(2000, True), (800, False)])
def test_the_baseline_of_a_long_prompt_is_priced_at_its_long_context_rates(
    weir: Weir, fake_openai: FakeOpenAI, prompt: int, long: bool
) -> None:
    tenant_id, _, key = weir.tenant_with_key("savings")
    fake_openai.set_next_usage(input_tokens=prompt, output_tokens=100)
    client = openai.OpenAI(base_url=f"{weir.url}/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="pair", messages=[{"role": "user", "content": "hello"}])
    [(model, cost)] = wait_rows(
        weir.db_url, f"SELECT model, cost_pico_usd FROM usage_events WHERE tenant_id = '{tenant_id}'"
    )
    small, large = (("2", "4"), ("3", "6")) if long else (("1", "2"), ("1.5", "3"))
    assert (model, Decimal(cost) / 10**12) == ("gpt-5-mini", micro(*small, prompt, 100))
    totals = weir.admin.get("/reports/routing-savings").json()["totals"]
    assert Decimal(totals["cost_usd"]) == micro(*small, prompt, 100)
    # The large model would have billed this prompt at its own long-context rates: at its base rates
    # the baseline was below what the request cost, and routing "saved" a negative amount.
    assert Decimal(totals["strongest_cost_usd"]) == micro(*large, prompt, 100)
    assert Decimal(totals["saved_usd"]) > 0
