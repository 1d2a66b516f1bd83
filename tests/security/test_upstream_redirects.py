"""A backend that answers with a redirect is not followed: neither a request (which carries the
vendor key in `x-api-key` / `x-goog-api-key`, which aiohttp keeps across origins, and on 307/308 the
prompt) nor a health probe reaches the address the `Location` names, which may be an internal one
(cloud metadata, the admin API). The client gets a 502 that does not name that address."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from gateway.config import Backend, Timeouts
from gateway.errors import BadGateway
from gateway.providers.base import UpstreamRequest
from gateway.transport import Transport
from routing.breaker import Breakers
from routing.health import HealthProber

VENDOR_KEY = "sk-ant-vendor-secret-0123456789"
TIMEOUTS = Timeouts(connect=2, first_byte=2, read=2)


@dataclass
class Servers:
    backend: TestServer
    target: TestServer  # where the backend's redirects point: must never be reached
    reached: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    reached: list[tuple[str, str, dict[str, str], bytes]] = []

    async def record(request: web.Request) -> web.Response:
        reached.append((request.method, request.path_qs, dict(request.headers), await request.read()))
        return web.json_response({"id": "chatcmpl-x", "object": "chat.completion", "choices": []})

    target_app = web.Application()
    target_app.router.add_route("*", "/{tail:.*}", record)
    target = TestServer(target_app, host="127.0.0.1")
    await target.start_server()

    async def redirect(request: web.Request) -> web.Response:
        status = int(request.query.get("status", "307"))
        location = str(target.make_url("/latest/meta-data/iam?key=" + VENDOR_KEY))
        return web.Response(status=status, headers={"Location": location})

    backend_app = web.Application()
    backend_app.router.add_route("*", "/{tail:.*}", redirect)
    backend = TestServer(backend_app, host="127.0.0.1")
    await backend.start_server()
    try:
        yield Servers(backend, target, reached)
    finally:
        await backend.close()
        await target.close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirected_request_is_not_followed(servers: Servers, status: int) -> None:
    transport = Transport()
    request = UpstreamRequest(
        str(servers.backend.make_url(f"/v1/messages?status={status}")),
        {"x-api-key": VENDOR_KEY, "content-type": "application/json"},
        b'{"messages": [{"role": "user", "content": "the secret plan"}]}',
    )
    try:
        with capture_logs() as logs, pytest.raises(BadGateway) as caught:
            await transport.send(request, TIMEOUTS, "anthropic")
    finally:
        await transport.close()
    assert servers.reached == []  # neither the key nor the prompt left for the redirect's target
    assert caught.value.status == 502
    message = str(caught.value)
    assert f"redirect ({status})" in message and "anthropic" in message
    assert VENDOR_KEY not in message and str(servers.target.port) not in message
    [line] = [entry for entry in logs if entry["event"] == "upstream_redirect_refused"]
    assert line["status"] == status and VENDOR_KEY not in str(line)  # the query string is left out


async def test_a_health_probe_does_not_follow_a_redirect(servers: Servers) -> None:
    transport = Transport()
    backend = Backend(
        name="aggregator",
        type="openai",
        base_url=str(servers.backend.make_url("/v1")),
        headers={"x-api-key": VENDOR_KEY},
    )
    prober = HealthProber(transport, Breakers(), interval=60, timeout=2)
    try:
        await prober.probe(backend)
    finally:
        await transport.close()
    assert servers.reached == []
