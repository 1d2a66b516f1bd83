"""Token counts (Anthropic's /v1/messages/count_tokens) that reach a backend are free at the vendors and
rate limited apart from the requests they count: Weir counts them on RPM windows of their own and
never on TPM or a budget, where each counted against the tenant's RPM and reserved the default output
estimate (1,024 tokens) on its TPM and budget."""

from __future__ import annotations

import anthropic
import pytest

from tests.fakes import FakeAnthropic
from tests.fixtures.gateway import Weir

CONFIG = """\
backends:
  - {name: anthropic, type: anthropic, base_url: "ANTHROPIC_URL", api_key: "ANTHROPIC_KEY"}
models:
  - name: claude-sonnet
    backend: anthropic
    model: claude-sonnet-4-5
    price: {input: 3.0, output: 15.0}
database_url: "${DB_URL}"
"""
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def weir_config(fake_anthropic: FakeAnthropic) -> str:
    return CONFIG.replace("ANTHROPIC_URL", fake_anthropic.base_url).replace(
        "ANTHROPIC_KEY", str(fake_anthropic.api_key)
    )


def test_token_counts_have_their_own_rpm_and_spend_no_tpm_or_budget(
    weir: Weir, fake_anthropic: FakeAnthropic
) -> None:
    # A count reserving 1,024 output tokens ($0.015 at $15/M) was over this budget and, twice, this TPM.
    _, _, key = weir.tenant_with_key("counter", rpm=2, tpm=1_500, budget_usd_monthly="0.01")
    client = anthropic.Anthropic(base_url=weir.url, api_key=key, max_retries=0, timeout=20)
    for left in ("1", "0"):
        counted = client.messages.with_raw_response.count_tokens(model="claude-sonnet", messages=HI)  # type: ignore[arg-type]
        assert counted.headers["x-weir-token-count"] == "backend"
        assert fake_anthropic.last_request.path == "/v1/messages/count_tokens"  # type: ignore[union-attr]
        assert counted.headers["anthropic-ratelimit-requests-remaining"] == left
        assert "anthropic-ratelimit-tokens-limit" not in counted.headers  # counts spend no tokens
    # The counts used none of the requests' RPM: both messages are admitted.
    for left in ("1", "0"):
        raw = client.messages.with_raw_response.create(model="claude-sonnet", max_tokens=5, messages=HI)  # type: ignore[arg-type]
        assert raw.headers["anthropic-ratelimit-requests-remaining"] == left
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.count_tokens(model="claude-sonnet", messages=HI)  # type: ignore[arg-type]
    assert "token counting requests per minute" in refused.value.message
    assert int(refused.value.response.headers["retry-after"]) >= 55
