"""A vendor's error message reaches the client as the vendor wrote it (the request is at fault, so the
client must see why), but some vendors and proxies echo what they were sent: the `Authorization`
header, the whole request URL with its `?key=`. The gateway's credentials for the backend (its API
key, and configured headers or query parameters named like a credential) are blanked in what the
client gets, in a whole answer's error and in an error event mid-stream; the rest of the message is
kept. The gateway's own log lines about a broken upstream exchange name its URL without the query,
and neither they nor the vendor's words on a refused key, which are logged alone, hold what looks like
a key: OpenAI quotes the key it refused, masked, and a proxy may echo the whole token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from structlog.testing import capture_logs

from gateway.config import Timeouts, parse_config
from gateway.errors import BadGateway
from gateway.pipeline import redact_secrets
from gateway.providers.base import UpstreamRequest
from gateway.transport import Transport, describe
from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway, running_gateway

TENANT_KEY = "sk-weir-tenant-redaction-0123"
HEADER_TOKEN = "tok-extra-credential-987654321"
QUERY_KEY = "AIzaQueryKeyAbcdefghijklmnop"
CONFIG = """\
backends:
  - name: openai
    type: openai
    base_url: "{url}"
    api_key: "{key}"
    headers: {{x-upstream-token: "{token}", x-tenant-label: "plainlabel-0001"}}
    query: {{key: "{query}"}}
models:
  - {{name: gpt-4o-mini, backend: openai}}
tenants:
  - {{name: t, api_keys: ["{tenant}"]}}
"""


@pytest.fixture(scope="module")
def weir(_fake_openai_server: FakeOpenAI) -> Iterator[RunningGateway]:
    fake = _fake_openai_server
    text = CONFIG.format(
        url=fake.base_url, key=fake.api_key, token=HEADER_TOKEN, query=QUERY_KEY, tenant=TENANT_KEY
    )
    with running_gateway(parse_config(text, {})) as gateway:
        yield gateway


def _echo(fake: FakeOpenAI) -> str:
    # What a careless upstream says back: its URL with the query key, the headers it was sent.
    return (
        f"model not served at {fake.base_url}/chat/completions?key={QUERY_KEY} "
        f"(Authorization: Bearer {fake.api_key}; x-upstream-token: {HEADER_TOKEN}; "
        "x-tenant-label: plainlabel-0001)"
    )


def _assert_redacted(message: str, fake: FakeOpenAI) -> None:
    for secret in (fake.api_key, HEADER_TOKEN, QUERY_KEY):
        assert secret not in message, message
    assert "[redacted]" in message
    # What is no credential stays: the client still learns what went wrong.
    assert "model not served at" in message and "plainlabel-0001" in message


def test_a_vendor_error_echoing_credentials_is_redacted(
    weir: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.status(400, message=_echo(fake_openai)), path="/v1/chat/completions")
    response = httpx.post(
        f"{weir.url}/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {TENANT_KEY}"},
        timeout=20,
    )
    assert response.status_code == 400
    _assert_redacted(response.json()["error"]["message"], fake_openai)


def test_a_stream_error_echoing_credentials_is_redacted(
    weir: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(
        Fault.stream_error(after=1, code=400, message=_echo(fake_openai)), path="/v1/chat/completions"
    )
    with httpx.stream(
        "POST",
        f"{weir.url}/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers={"authorization": f"Bearer {TENANT_KEY}"},
        timeout=20,
    ) as response:
        body = response.read().decode()
    assert "model not served at" in body  # the error event reached the client
    _assert_redacted(body, fake_openai)


async def test_a_broken_upstream_answer_logs_its_url_without_the_query_key() -> None:
    """aiohttp's errors name the request's URL, with the backend's configured query (`?key=`): the
    log line keeps the URL for the operator, never its query string."""

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = Transport()
    url = f"http://127.0.0.1:{port}/v1/chat/completions?key={QUERY_KEY}"
    try:
        with capture_logs() as logs, pytest.raises(BadGateway):
            await transport.send(UpstreamRequest(url, {}, b"{}"), Timeouts(connect=2, first_byte=2), "b")
    finally:
        await transport.close()
        server.close()
    [line] = [entry for entry in logs if entry["event"] == "upstream_request_broken"]
    assert f"127.0.0.1:{port}/v1/chat/completions" in line["error"]  # still says where
    assert QUERY_KEY not in line["error"]


# A 401's words as OpenAI writes them, quoting the refused key masked.
MASKED_KEY = "sk-proj-********************************************a1B2"


def test_a_vendors_words_on_the_gateways_key_are_logged_without_the_key(
    weir: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """The client gets a 502 of the gateway's own words; the operator's `upstream_credentials_refused`
    line says why the vendor refused the key, and a log line outlives the key: what the vendor quoted
    of it is blanked, the rest of its words kept."""
    said = f"Incorrect API key provided: {MASKED_KEY}. (Authorization: Bearer {fake_openai.api_key})"
    fake_openai.fail_next(Fault.status(401, message=said), path="/v1/chat/completions")
    with capture_logs() as logs:
        response = httpx.post(
            f"{weir.url}/v1/chat/completions",
            json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {TENANT_KEY}"},
            timeout=20,
        )
    assert response.status_code == 502
    [line] = [entry for entry in logs if entry["event"] == "upstream_credentials_refused"]
    assert line["message"] == "Incorrect API key provided: [redacted]. (Authorization: Bearer [redacted])"


def test_an_upstream_exception_is_logged_without_a_key_it_quotes() -> None:
    """A decoder's error may quote the vendor's body, and the body the key it was sent: `describe`,
    which writes every upstream exception to the log, blanks it."""
    key = "sk-ant-api03-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0Fe"
    error = ValueError(f"invalid literal for int(): 'x-api-key {key} is invalid'")
    assert describe(error) == "ValueError: invalid literal for int(): 'x-api-key [redacted] is invalid'"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("cookie", "CF_Authorization=eyJhbGciOiJSUzI1NiJ9.proxy-session"),
        ("x-goog-credentials", "ya29.credential-of-a-proxy-0001"),
        ("x-session-id", "proxy-session-0123456789"),
    ],
)
def test_a_configured_cookie_or_credential_header_is_a_secret_too(name: str, value: str) -> None:
    """A backend behind a proxy that signs in with a cookie or a credential header of another name:
    echoed by the proxy, the value is blanked like a key's (it was passed on in clear)."""
    config = parse_config(
        f"""backends:
  - {{name: b, type: openai, base_url: "http://127.0.0.1:9", headers: {{"{name}": "{value}"}}}}
models:
  - {{name: m, backend: b}}
""",
        {},
    )
    error = BadGateway(f"proxy said: you sent {name}: {value}, which expired")
    redact_secrets(error, config.backend("b"))
    assert value not in error.message and "[redacted]" in error.message
    assert error.message.startswith("proxy said: you sent")
