"""Bounded fuzzing (hypothesis) of what a client or a backend can send the gateway: request bodies of
any shape through the real HTTP server, and arbitrary vendor stream events through each decoder.

Properties: a client never gets a 5xx for its own bad input, every rejection is in the OpenAI error
shape, and a decoder fed garbage raises only the gateway's own error (which becomes a clean 502).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.pipeline import decode
from gateway.providers import anthropic, gemini, openai
from gateway.types import ChatRequest, Message
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway

FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
KEYS = [
    "model",
    "messages",
    "role",
    "content",
    "stream",
    "max_tokens",
    "temperature",
    "tools",
    "n",
    "stop",
    "type",
    "text",
    "choices",
    "delta",
    "usage",
    "index",
    "stream_options",
    "top_p",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)
# Bodies that look like chat requests with one field broken, and bodies that look like nothing.
chat_like = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["gpt-4o-mini", "claude-sonnet", "", "x" * 300]) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "tool", "x"]), "content": json_values}
            ),
            max_size=3,
        )
        | json_values,
    },
    optional={
        "max_tokens": json_values,
        "temperature": json_values,
        "n": json_values,
        "stream": json_values,
        "tools": json_values,
        "stop": json_values,
    },
)


def assert_clean(response: httpx.Response) -> None:
    # An overload is a 503 to OpenAI clients, Anthropic's 529 to Anthropic clients.
    overloaded = 529 if response.url.path == "/v1/messages" else 503
    assert response.status_code < 500 or response.status_code in (502, overloaded, 504), response.text[:300]
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"]
        if response.url.path == "/v1/messages":  # Anthropic clients get Anthropic's error shape
            assert body["type"] == "error" and "type" in error
        else:
            assert {"type", "param", "code"} <= set(error)


def post(gw: RunningGateway, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(
        f"{gw.url}{path}",
        content=body,
        timeout=30,
        headers={"authorization": f"Bearer {DEMO_KEY}", "content-type": "application/json"},
    )


@FUZZ
@given(body=chat_like | json_values)
def test_any_json_body_gets_an_answer_or_a_clean_4xx(_running_gateway: RunningGateway, body: Any) -> None:
    if isinstance(body, dict) and body.get("stream") is True:
        body["stream"] = False  # a stream's errors arrive as SSE events; the JSON path is the one fuzzed
    response = post(_running_gateway, json.dumps(body).encode())
    assert_clean(response)
    if response.status_code == 400:
        assert response.json()["error"]["type"] == "invalid_request_error"


@FUZZ
@given(raw=st.binary(max_size=300))
def test_any_bytes_get_a_clean_4xx(_running_gateway: RunningGateway, raw: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/embeddings", "/v1/completions"):
        response = post(_running_gateway, raw, path)
        assert_clean(response)


@pytest.mark.parametrize("depth", [64, 10_000])
def test_deeply_nested_and_huge_bodies(_running_gateway: RunningGateway, depth: int) -> None:
    nested = b'{"model": "gpt-4o-mini", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    assert_clean(post(_running_gateway, nested))
    unicode = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "\u202e\U0001f600\x00" * 5000}],
    }
    assert_clean(post(_running_gateway, json.dumps(unicode).encode()))
    absurd = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": -(10**30),
        "n": 10**9,
        "temperature": 1e308,
    }
    response = post(_running_gateway, json.dumps(absurd).encode())
    assert_clean(response)
    assert response.status_code == 400


REQUEST = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
DECODERS = {"openai": openai.ChatStream, "anthropic": anthropic.ChatStream, "gemini": gemini.ChatStream}
events = st.lists(
    st.tuples(
        st.none()
        | st.sampled_from(["message_start", "content_block_delta", "message_delta", "error", "ping"]),
        st.text(max_size=60) | json_values.map(json.dumps) | st.just("[DONE]"),
    ),
    max_size=8,
)


@pytest.mark.parametrize("vendor", DECODERS)
@FUZZ
@given(stream=events)
def test_stream_decoders_raise_only_gateway_errors(vendor: str, stream: list[tuple[str | None, str]]) -> None:
    """As the pipeline runs them (`gateway.pipeline.decode`): garbage is a 502, never a crash."""
    decoder = DECODERS[vendor](REQUEST, "m")
    try:
        for event, data in stream:
            decode(decoder.feed, vendor, event, data)
        decode(decoder.close, vendor)
    except GatewayError as exc:
        assert 400 <= exc.status < 600


@pytest.mark.parametrize("vendor", DECODERS)
@FUZZ
@given(body=json_values.map(json.dumps) | st.binary(max_size=100).map(lambda b: b.decode("latin-1")))
def test_response_parsers_raise_only_gateway_errors(vendor: str, body: str) -> None:
    provider = {"openai": openai, "anthropic": anthropic, "gemini": gemini}[vendor].PROVIDER
    try:
        decode(provider.chat_response, vendor, body.encode(), "m")
    except GatewayError as exc:
        assert 400 <= exc.status < 600
