"""The health probes ask each backend's model list as its adapter asks every request: with the
backend's own key (the config's, or the one stored for it in the admin DB), in the vendor's header
(OpenAI's bearer token, Anthropic's `x-api-key` with `anthropic-version`, Gemini's `x-goog-api-key`).
So a vLLM server started with `--api-key` (the fake OpenAI with `serve_windows`) shows the gateway
the window it serves. A refused key still counts the backend up (it answered) and is logged once per
backend, never with the key; a backend with no key is probed without one; a redirect is never
followed with the key."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from gateway.config import Backend
from gateway.credentials import CredentialStore, context
from gateway.transport import Transport
from gateway.vault import Vault
from routing.breaker import Breakers
from routing.health import HealthProber
from routing.windows import ContextWindows
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fakes.server import FakeServer

SERVED = 1_000  # the window the keyed vLLM stand-in lists for gpt-4o-mini
WRONG = "sk-wrong-0123456789abcdef"
KEY_HEADERS = {"openai": "authorization", "anthropic": "x-api-key", "gemini": "x-goog-api-key"}


def backend_of(fake: FakeServer, kind: str, api_key: str | None) -> Backend:
    base_url = fake.base_url
    return msgspec.convert({"name": kind, "type": kind, "base_url": base_url, "api_key": api_key}, Backend)


def sent_key(fake: FakeServer, kind: str) -> str | None:
    """The key the fake's last model-list GET carried in the vendor's header."""
    [probe] = [r for r in fake.requests if r.method == "GET"][-1:]
    value = probe.headers.get(KEY_HEADERS[kind])
    return value.removeprefix("Bearer ") if value is not None else None


@pytest.fixture
async def transport() -> AsyncIterator[Transport]:
    transport = Transport()
    yield transport
    await transport.close()


@pytest.fixture
def vendors(
    fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> dict[str, FakeServer]:
    return {"openai": fake_openai, "anthropic": fake_anthropic, "gemini": fake_gemini}


async def rounds(prober: HealthProber, backend: Backend, count: int = 1) -> list[bool]:
    """`count` probe rounds of `backend` alone: what each said of its health."""
    said: list[bool] = []
    prober.on_result = lambda _name, healthy, _ms, _at: said.append(healthy)
    prober.watch({backend.name: (backend, [f"{backend.name}/m"])})
    for _ in range(count):
        await prober.run_once()
    return said


async def test_a_probe_with_the_backends_key_learns_the_window_a_keyed_server_lists(
    fake_openai: FakeOpenAI, transport: Transport
) -> None:
    """vLLM started with `--api-key` answers a keyless list with a 401: its window was never known."""
    fake_openai.serve_windows({"gpt-4o-mini": SERVED})
    windows, breakers = ContextWindows(), Breakers()
    backend = backend_of(fake_openai, "openai", fake_openai.api_key)
    prober = HealthProber(transport, breakers, interval=60, windows=windows)
    with capture_logs() as logs:
        assert await rounds(prober, backend) == [True]
    assert windows.window("openai", "gpt-4o-mini") == SERVED
    assert sent_key(fake_openai, "openai") == fake_openai.api_key
    assert breakers.get("openai/m").failures == 0
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == []


async def test_the_probe_carries_the_key_stored_for_the_backend(
    fake_openai: FakeOpenAI, transport: Transport
) -> None:
    """A key stored through the admin API wins over the config's for the probes too, as for requests."""
    fake_openai.serve_windows({"gpt-4o-mini": SERVED})
    backend = backend_of(fake_openai, "openai", "sk-config-key-revoked")
    vault = Vault([os.urandom(32)])
    store = CredentialStore(None, [backend], vault)  # type: ignore[arg-type]  # apply alone: no DB
    store.apply({"openai": vault.encrypt(fake_openai.api_key, context("openai"))})
    windows = ContextWindows()
    prober = HealthProber(transport, Breakers(), interval=60, windows=windows)
    await rounds(prober, backend)
    assert sent_key(fake_openai, "openai") == fake_openai.api_key
    assert windows.window("openai", "gpt-4o-mini") == SERVED


@pytest.mark.parametrize("kind", ["anthropic", "gemini"])
async def test_each_vendor_is_probed_with_its_key_in_its_own_header(
    vendors: dict[str, FakeServer], kind: str, transport: Transport
) -> None:
    fake = vendors[kind]
    prober = HealthProber(transport, Breakers(), interval=60)
    with capture_logs() as logs:
        assert await rounds(prober, backend_of(fake, kind, fake.api_key)) == [True]
    assert sent_key(fake, kind) == fake.api_key
    [probe] = [r for r in fake.requests if r.method == "GET"]
    assert probe.query == {}  # a header, never `?key=` in the URL
    if kind == "anthropic":
        assert probe.headers["anthropic-version"] == "2023-06-01"
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == []  # the fake let it in


async def test_a_backend_without_a_key_is_probed_without_one(
    fake_openai: FakeOpenAI, transport: Transport
) -> None:
    prober = HealthProber(transport, Breakers(), interval=60)
    assert await rounds(prober, backend_of(fake_openai, "openai", None)) == [True]  # a 401 is an answer
    [probe] = fake_openai.requests
    assert "authorization" not in probe.headers and "api-key" not in probe.headers


@pytest.mark.parametrize(("kind", "status"), [("openai", 401), ("anthropic", 401), ("gemini", 400)])
async def test_a_refused_key_is_still_up_and_logged_once_until_it_is_let_in(
    vendors: dict[str, FakeServer], kind: str, status: int, transport: Transport
) -> None:
    """Gemini refuses a wrong key with a 400 `API_KEY_INVALID`, read as requests read it."""
    fake = vendors[kind]
    backend = backend_of(fake, kind, WRONG)
    breakers = Breakers()
    prober = HealthProber(transport, breakers, interval=60)
    with capture_logs() as logs:
        assert await rounds(prober, backend, 3) == [True] * 3
        backend.api_key = fake.api_key  # put right (the admin API's stored key, say)
        await rounds(prober, backend)
        backend.api_key = WRONG  # and wrong again: said again
        await rounds(prober, backend)
    refused = [e for e in logs if e["event"] == "backend_probe_key_refused"]
    assert [(e["backend"], e["status"], e["log_level"]) for e in refused] == [(kind, status, "warning")] * 2
    assert breakers.get(f"{kind}/m").failures == 0
    assert WRONG not in str(logs) and fake.api_key not in str(logs)


@pytest.fixture
async def redirecting() -> AsyncIterator[tuple[TestServer, list[dict[str, Any]]]]:
    """A backend whose every answer is a redirect to a second server, which records what reaches it."""
    reached: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        reached.append({name.lower(): value for name, value in request.headers.items()})
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 7}]})

    target_app = web.Application()
    target_app.router.add_route("*", "/{tail:.*}", record)
    target = TestServer(target_app, host="127.0.0.1")
    await target.start_server()

    async def redirect(request: web.Request) -> web.Response:
        reached.append({"backend": True, **{name.lower(): value for name, value in request.headers.items()}})
        return web.Response(status=307, headers={"Location": str(target.make_url("/v1/models"))})

    backend_app = web.Application()
    backend_app.router.add_route("*", "/{tail:.*}", redirect)
    backend = TestServer(backend_app, host="127.0.0.1")
    await backend.start_server()
    try:
        yield backend, reached
    finally:
        await backend.close()
        await target.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic", "gemini"])
async def test_a_redirected_probe_is_not_followed_with_the_key(
    redirecting: tuple[TestServer, list[dict[str, Any]]], kind: str, transport: Transport
) -> None:
    server, reached = redirecting
    backend = msgspec.convert(
        {"name": kind, "type": kind, "base_url": str(server.make_url("/v1")), "api_key": WRONG}, Backend
    )
    windows = ContextWindows()
    prober = HealthProber(transport, Breakers(), interval=60, windows=windows)
    assert await rounds(prober, backend) == [True]  # a 3xx is an answer
    [asked] = reached  # the backend alone: the redirect's target was never reached
    assert asked["backend"] and WRONG in asked[KEY_HEADERS[kind]]
    assert windows.window(kind, "m") is None
