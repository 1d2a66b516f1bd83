"""What a client sends in its headers stays at the gateway: its key (`Authorization`, `x-api-key`),
cookies, forwarding headers and anything else never reach a vendor, on either inbound API and to
every vendor; each vendor gets the gateway's own key. The one header passed on is `anthropic-beta`,
from the Messages API to Anthropic backends only (docs/gateway.md)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.fakes.plugin import FakeVendors
from tests.fakes.server import RecordedRequest
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway, full_config_text, gateway_on_fakes

CLIENT_HEADERS = {
    "authorization": f"Bearer {DEMO_KEY}",
    "x-api-key": DEMO_KEY,
    "cookie": "weir_admin=stolen-session",
    "x-forwarded-for": "10.0.0.1",
    "x-client-secret": "client-only-value",
    "openai-organization": "org-client",
    "anthropic-beta": "some-beta-2025-01-01",
}
SAY = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def weir(fake_vendors: FakeVendors) -> Iterator[RunningGateway]:
    with gateway_on_fakes(full_config_text(), fake_vendors) as gateway:
        yield gateway


def _last_post(fake: object) -> RecordedRequest:
    posts = [r for r in fake.requests if r.method == "POST"]  # type: ignore[attr-defined]
    assert posts, "the vendor was not called"
    return posts[-1]


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet", "gemini-flash"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_client_headers_never_reach_a_vendor(
    weir: RunningGateway, fake_vendors: FakeVendors, fresh_fakes: None, model: str, path: str
) -> None:
    body = {"model": model, "messages": SAY, "max_tokens": 20}
    response = httpx.post(f"{weir.url}{path}", json=body, headers=CLIENT_HEADERS, timeout=20)
    assert response.status_code == 200, response.text
    fake = {
        "gpt-4o-mini": fake_vendors.openai,
        "claude-sonnet": fake_vendors.anthropic,
        "gemini-flash": fake_vendors.gemini,
    }[model]
    sent = _last_post(fake).headers
    assert DEMO_KEY not in str(sent)  # the tenant's key, under any header name
    for name in ("cookie", "x-forwarded-for", "x-client-secret", "openai-organization"):
        assert name not in sent, name
    # The vendor's own key, not the client's, under the vendor's own header.
    own = {"gpt-4o-mini": "authorization", "claude-sonnet": "x-api-key", "gemini-flash": "x-goog-api-key"}
    assert fake.api_key in sent[own[model]]
    if model == "claude-sonnet" and path == "/v1/messages":
        assert "some-beta-2025-01-01" in sent.get("anthropic-beta", "")
    else:
        assert "anthropic-beta" not in sent
