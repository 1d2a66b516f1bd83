"""Hostile clients against a real gateway with the default body limit (20 MiB): JSON nested 100,000
deep, bodies over the limit (refused fast, before they are read), unicode a JSON decoder can produce
but UTF-8 cannot carry (lone surrogates), absurd parameters, odd headers. Each gets a clean 4xx in
the OpenAI error shape (or an answer), never a 5xx, and the gateway keeps answering.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

KEY = "sk-weir-hostile-0123456789"
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
  - {name: anthropic, type: anthropic, base_url: "${ANTHROPIC_BASE_URL}", api_key: "${ANTHROPIC_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai}
  - {name: claude, backend: anthropic, model: claude-sonnet-4-5}
tenants:
  - {name: t, api_keys: ["${KEY}"]}
"""
HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
LIMIT = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def url(_fake_openai_server: FakeOpenAI, _fake_anthropic_server: FakeAnthropic) -> Iterator[str]:
    env = {
        "OPENAI_BASE_URL": _fake_openai_server.base_url,
        "OPENAI_API_KEY": _fake_openai_server.api_key,
        "ANTHROPIC_BASE_URL": _fake_anthropic_server.base_url,
        "ANTHROPIC_API_KEY": _fake_anthropic_server.api_key,
        "KEY": KEY,
    }
    with serve(create_app(parse_config(CONFIG, env)), free_port()) as base:
        yield base


def post(url: str, body: bytes, path: str = "/v1/chat/completions", **headers: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers={**HEADERS, **headers}, timeout=30)


def assert_clean_4xx(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if status is not None:
        assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error) and error["message"]
    return error


def test_json_nested_100k_deep_is_a_400(url: str) -> None:
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        body = b'{"model": "gpt-4o-mini", "messages": ' + opener * 100_000 + closer * 100_000 + b"}"
        assert_clean_4xx(post(url, body), 400)


def test_a_body_over_the_limit_is_refused_before_it_is_read(url: str) -> None:
    """content-length says 1 GB: the 413 comes at once, while the client has sent almost nothing."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(5)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {10**9}\r\n\r\n"
        )
        t0 = time.monotonic()
        conn.sendall(head.encode() + b'{"model": ')
        answer = conn.recv(65536)
        assert time.monotonic() - t0 < 2
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"request_too_large"' in answer


def test_a_chunked_body_over_the_limit_is_a_413(url: str) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:  # no content-length: the limit is counted as it arrives
        nonlocal sent
        block = b" " * (1024 * 1024)
        while sent < 4 * LIMIT:
            sent += len(block)
            yield block

    try:
        response = httpx.post(f"{url}/v1/chat/completions", content=chunks(), headers=HEADERS, timeout=30)
    except httpx.HTTPError:  # the gateway answered and closed while the client was still sending
        assert sent <= 2 * LIMIT
        return
    assert_clean_4xx(response, 413)


@pytest.mark.parametrize(
    "content",
    [
        "\ud800",  # a lone surrogate: valid in JSON's \\u escapes, not encodable as UTF-8
        "a\udfffb",
        "\u0000\u202e\ufeff\u200b",
        "\U0010ffff" * 1000,
        "e\u0301" * 5000,  # combining marks
    ],
)
@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude"])
def test_unicode_edge_cases_get_an_answer_or_a_400(url: str, model: str, content: str) -> None:
    import json

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}]}).encode()
    response = post(url, body)
    assert response.status_code in (200, 400), response.text[:300]
    if response.status_code == 400:
        assert_clean_4xx(response)


def test_a_utf8_bom_and_invalid_utf8_are_400s(url: str) -> None:
    body = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}'
    assert_clean_4xx(post(url, b"\xef\xbb\xbf" + body), 400)
    assert_clean_4xx(post(url, body.replace(b"hi", b"\xc0\xaf\xed\xa0\x80")), 400)  # overlong, surrogate


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1),
        ("max_tokens", 0),
        ("max_tokens", 10**12),
        ("max_tokens", 1e12),
        ("max_tokens", 2**64),
        ("temperature", "NaN"),
        ("temperature", -1e308),
        ("n", 0),
        ("n", -5),
        ("top_p", "1"),
        ("stop", [None]),
        ("messages", []),
        ("model", ""),
        ("model", "x" * 100_000),
        ("stream", "yes"),
    ],
)
def test_absurd_parameters_are_4xx_never_5xx(url: str, field: str, value: Any) -> None:
    import json

    body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    body[field] = value
    response = post(url, json.dumps(body).encode())
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        assert_clean_4xx(response)


def test_nan_and_infinity_literals_are_a_400(url: str) -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        body = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "temperature": '
        response = post(url, body + literal + b"}")
        assert response.status_code < 500, response.text[:300]
        if response.status_code >= 400:
            assert_clean_4xx(response, 400)


def test_odd_headers_get_a_4xx(url: str) -> None:
    body = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}'
    for headers in (
        {"authorization": "Bearer " + "k" * 8000},
        {"authorization": "Basic Zm9vOmJhcg=="},
        {"authorization": "Bearer"},
        {"content-type": "text/plain"},
        {"content-type": "application/json; charset=latin-1"},
    ):
        response = httpx.post(
            f"{url}/v1/chat/completions", content=body, headers={**HEADERS, **headers}, timeout=10
        )
        assert response.status_code < 500, (headers, response.text[:300])
        if response.status_code >= 400:
            assert_clean_4xx(response)
    raw = httpx.post(
        f"{url}/v1/chat/completions",
        content=body,
        headers=[(b"authorization", b"Bearer \xff\xfe-not-latin"), (b"content-type", b"application/json")],
        timeout=10,
    )
    assert_clean_4xx(raw, 401)
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
