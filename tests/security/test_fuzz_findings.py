"""What the fuzzers (test_fuzz_openapi.py, test_fuzz.py) found, pinned as plain tests, each against a
real gateway in front of the fake vendors."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.fakes import FakeOpenAI
from tests.gateway.conftest import (  # noqa: F401  (the session gateway and its per-test reset)
    DEMO_KEY,
    RunningGateway,
    _running_gateway,
    gateway,
)


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
    gateway: RunningGateway,  # noqa: F811
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


@pytest.mark.parametrize("value", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_every_documented_input_form_still_passes(
    gateway: RunningGateway,  # noqa: F811
    fake_openai: FakeOpenAI,
    value: Any,
) -> None:
    response = post(gateway, "/v1/embeddings", {"model": "text-embedding-3-small", "input": value})
    assert response.status_code == 200, response.text
    assert len(fake_openai.requests) == 1


DEEP = "[" * 20_000 + "]" * 20_000


@pytest.mark.parametrize("model", ["claude-sonnet", "gemini-flash"])
def test_tool_json_nested_20k_deep_is_a_400_not_a_500(
    gateway: RunningGateway,  # noqa: F811
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
