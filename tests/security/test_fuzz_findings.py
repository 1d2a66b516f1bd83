"""What the fuzzers (test_fuzz_openapi.py, test_fuzz.py) found, pinned as plain tests, each against a
real gateway in front of the fake vendors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes import FakeOpenAI
from tests.fixtures.gateway import CONFIG, Weir, sqlite_weir
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway


def post(gw: RunningGateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gw.url}{path}", json=body, headers={"authorization": f"Bearer {DEMO_KEY}"}, timeout=10
    )


@pytest.mark.parametrize(
    ("path", "field", "model"),
    [
        ("/v1/embeddings", "input", "text-embedding-3-small"),
        ("/v1/completions", "prompt", "gpt-instruct"),  # native completions: passed on as sent
    ],
)
@pytest.mark.parametrize("value", [[None, None], [], [["a"]], [1, "a"], [True], [[]]])
def test_malformed_text_or_tokens_is_a_400_without_an_upstream_call(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    path: str,
    field: str,
    model: str,
    value: Any,
) -> None:
    """schemathesis: `input: [null, null]` reached the backend, which failed with a 500 (the
    client saw a 502)."""
    response = post(gateway, path, {"model": model, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert fake_openai.requests == []


@pytest.mark.parametrize("dimensions", [0, -164453])
def test_embedding_dimensions_below_1_are_a_400_without_an_upstream_call(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    dimensions: int,
) -> None:
    """schemathesis (deep pass): `dimensions: -164453` reached the backend (the fake failed: a 502)."""
    body = {"model": "text-embedding-3-small", "input": "hi", "dimensions": dimensions}
    response = post(gateway, "/v1/embeddings", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "dimensions"
    assert fake_openai.requests == []


@pytest.mark.parametrize("value", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_every_documented_input_form_still_passes(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    value: Any,
) -> None:
    response = post(gateway, "/v1/embeddings", {"model": "text-embedding-3-small", "input": value})
    assert response.status_code == 200, response.text
    assert len(fake_openai.requests) == 1


DEEP = "[" * 20_000 + "]" * 20_000


@pytest.mark.parametrize("model", ["claude-sonnet", "gemini-flash"])
def test_tool_json_nested_20k_deep_is_a_400_not_a_500(
    gateway: RunningGateway,
    model: str,
) -> None:
    """A tool call's arguments (and a tool result, for Gemini) are JSON inside a string: the gateway
    parses them to translate for Anthropic and Gemini. Nested 20,000 deep they crashed the parser
    (RecursionError, a 500)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": DEEP},
    ]
    response = post(gateway, "/v1/chat/completions", {"model": model, "messages": messages})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture
def weir(fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Weir]:
    """A gateway with the control plane (SQLite admin DB) and its admin API."""
    with sqlite_weir(CONFIG, fake_openai, tmp_path, monkeypatch) as weir:
        yield weir


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_a_route_id_beyond_64_bits_is_a_404(weir: Weir, method: str) -> None:
    """schemathesis (deep pass): /routes/1334629427925470413492831911936 was a 500 (SQLite cannot
    bind an integer that large)."""
    body = {"name": "r", "candidates": [{"model": "gpt-4o-mini"}]} if method == "PUT" else None
    response = weir.admin.request(method, f"/routes/{2**100}", json=body)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("usd", ["1e30", 1e30, 10**40, "1000000.000001", "NaN", "-1", "1e-30"])
def test_an_absurd_price_or_budget_is_a_400(weir: Weir, usd: object) -> None:
    """schemathesis (deep pass): a price of 1e30 USD was a 500 (too large for the 64-bit column)."""
    price = {"model": "gpt-4o-mini", "token_class": "input", "usd_per_1m_tokens": usd}
    response = weir.admin.put("/prices", json={"prices": [price]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prices[0].usd_per_1m_tokens"
    if usd not in ("NaN", "-1", "1e-30"):
        tenant = weir.admin.post("/tenants", json={"name": "rich", "budget_usd_monthly": usd})
        assert tenant.status_code == 400, tenant.text


def test_the_largest_price_and_budget_are_kept(weir: Weir) -> None:
    price = {"model": "gpt-4o-mini", "token_class": "input", "usd_per_1m_tokens": "1000000"}
    assert weir.admin.put("/prices", json={"prices": [price]}).status_code == 200
    # USD 1M a month: what a 64-bit pico-dollar budget counter holds with headroom (docs/accounting.md).
    tenant = weir.admin.post("/tenants", json={"name": "rich", "budget_usd_monthly": "1000000"})
    assert tenant.status_code == 201, tenant.text
