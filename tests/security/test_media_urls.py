"""Image URLs a backend would fetch from inside the gateway's network are refused before any backend
sees them: a self-hosted OpenAI-compatible server (vLLM) fetches a tenant's image URL itself, so
`http://169.254.169.254/...` read the cloud's instance credentials from where it runs. Loopback,
link-local, unspecified and metadata addresses (in every spelling a resolver takes), metadata and
local host names and `file:` URLs are a 400 on every inbound API; other URLs (an internal 10/8 image
server included) go to the backend as before (gateway/media_urls.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.media_urls import refused_host
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway, full_config_text, gateway_on_fakes

HEADERS = {"authorization": f"Bearer {DEMO_KEY}"}
METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"


@pytest.fixture(scope="module")
def weir(fake_vendors: FakeVendors) -> Iterator[RunningGateway]:
    with gateway_on_fakes(full_config_text(), fake_vendors) as gateway:
        yield gateway


@pytest.mark.parametrize(
    "url",
    [
        METADATA,
        "http://2852039166/",  # 169.254.169.254 as one number
        "http://0xa9.0xfe.0xa9.0xfe/",
        "http://0251.0376.0251.0376/",
        "http://169.254.43518/",
        "http://[::ffff:169.254.169.254]/",
        "http://[fe80::1%25eth0]/",
        "http://100.100.100.200/latest/meta-data/",  # Alibaba Cloud's metadata service
        "http://metadata.google.internal/computeMetadata/v1/",
        "HTTP://127.0.0.1:8000/v1/models",
        "http://127.1/",
        "http://[::1]/",
        "http://0.0.0.0/",
        "http://localhost./x.png",
        "http://admin.localhost/x.png",
        "http://user:pw@127.0.0.1/",
        "file:///etc/passwd",
    ],
)
def test_internal_spellings_are_refused(url: str) -> None:
    assert refused_host(url) is not None


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "http://10.0.0.5/cat.png",  # an operator's own image server, for its own backend
        "https://1.2.3.4/cat.png",
        "data:image/png;base64,iVBORw0KGgo=",
        "gs://bucket/cat.png",  # Gemini's file URIs
        "http://[unclosed/",  # no fetcher reads it either; the backend says so
    ],
)
def test_other_urls_pass(url: str) -> None:
    assert refused_host(url) is None


def _image_chat(url: str) -> dict[str, Any]:
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]}


def _image_message(url: str) -> dict[str, Any]:
    image = {"type": "image", "source": {"type": "url", "url": url}}
    return {"model": "gpt-4o-mini", "max_tokens": 20, "messages": [{"role": "user", "content": [image]}]}


def _image_response(url: str) -> dict[str, Any]:
    content = [{"type": "input_image", "image_url": url}]
    return {"model": "gpt-4o-mini", "input": [{"role": "user", "content": content}]}


REQUESTS = {
    "/v1/chat/completions": _image_chat,
    "/v1/messages": _image_message,
    "/v1/messages/count_tokens": _image_message,
    "/v1/responses": _image_response,
}


@pytest.mark.parametrize("path", list(REQUESTS))
def test_a_metadata_image_url_is_a_400_that_reaches_no_backend(
    weir: RunningGateway, fake_vendors: FakeVendors, fresh_fakes: None, path: str
) -> None:
    response = httpx.post(f"{weir.url}{path}", json=REQUESTS[path](METADATA), headers=HEADERS, timeout=20)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "169.254.169.254" in error["message"]
    if path.startswith("/v1/messages"):  # Anthropic's error shape on its paths
        assert error["type"] == "invalid_request_error"
    else:
        assert error["code"] == "invalid_image_url"
    assert fake_vendors.openai.requests == []


def test_a_public_image_url_still_reaches_the_backend(
    weir: RunningGateway, fake_vendors: FakeVendors, fresh_fakes: None
) -> None:
    url = "https://example.com/cat.png"
    response = httpx.post(
        f"{weir.url}/v1/chat/completions", json=_image_chat(url), headers=HEADERS, timeout=20
    )
    assert response.status_code == 200, response.text
    [sent] = [r for r in fake_vendors.openai.requests if r.method == "POST"]
    assert url in sent.body.decode()
