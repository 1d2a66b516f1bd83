"""What a client is told when the connection to a backend breaks, through the official SDKs: a clear,
stable message and code that name the backend (and, for a stream, how far it got), never aiohttp's
exception names and text; the gateway's log keeps those for the operator."""

from __future__ import annotations

import socket
import time
from typing import Any

import anthropic
import openai
import pytest
from structlog.testing import capture_logs

from gateway.config import Timeouts
from gateway.errors import GatewayTimeout, Unreachable
from gateway.logging import add_request_fields
from gateway.providers.base import UpstreamRequest
from gateway.transport import Transport
from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway

WORDS = "one two three four five six"
SAY = [{"role": "user", "content": WORDS}]
# What aiohttp's errors say about themselves: none of it is the client's business.
INTERNALS = ("ClientPayloadError", "ServerDisconnected", "ClientOSError", "aiohttp", "payload", "Errno")


def _clean(message: str) -> None:
    assert not any(word in message for word in INTERNALS), message


def _logged(logs: list[dict[str, Any]], event: str) -> dict[str, Any]:
    """The gateway's line about the break, once the request is over (written as the stream unwinds)."""
    deadline = time.monotonic() + 5
    while not any(e["event"] == "request" for e in logs) and time.monotonic() < deadline:
        time.sleep(0.01)
    [line] = [e for e in logs if e["event"] == event]
    return line


@pytest.mark.parametrize(
    ("model", "fake_name", "backend", "after"),
    [
        ("gpt-4o-mini", "fake_openai", "openai", 3),  # role, "one", " two"
        ("claude-sonnet", "fake_anthropic", "anthropic", 5),  # its start events, " one", " two"
    ],
)
def test_a_chat_stream_cut_mid_way_says_so_plainly(
    gateway: RunningGateway,
    request: pytest.FixtureRequest,
    model: str,
    fake_name: str,
    backend: str,
    after: int,
) -> None:
    request.getfixturevalue(fake_name).fail_next(Fault.cut_stream(after=after))
    received = []
    with capture_logs() as logs:
        with pytest.raises(openai.APIError) as caught:
            for chunk in gateway.openai().chat.completions.create(model=model, messages=SAY, stream=True):
                received.append(chunk)
        line = _logged(logs, "upstream_stream_broken")
    assert received  # the text before the break arrived
    _clean(caught.value.message)
    assert (
        caught.value.message == f"the stream from backend {backend} ended unexpectedly after {after} events"
    )
    assert caught.value.code == "upstream_stream_interrupted"
    # The operator still learns what aiohttp saw.
    assert line["backend"] == backend and line["events"] == after
    assert "ClientPayloadError" in line["error"]


def test_an_anthropic_client_is_told_the_same(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        gateway.anthropic().messages.stream(model="gpt-4o-mini", max_tokens=50, messages=SAY) as stream,
    ):
        list(stream)
    _clean(caught.value.message)
    assert "the stream from backend openai ended unexpectedly after 3 events" in caught.value.message
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "the stream from backend openai ended unexpectedly after 3 events",
        },
        "request_id": caught.value.response.headers["request-id"],
    }


def test_a_responses_client_is_told_the_same(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    events = list(gateway.openai().responses.create(model="gpt-4o-mini", input=WORDS, stream=True))
    error, failed = events[-2:]
    assert error.type == "error" and failed.type == "response.failed"
    expected = "the stream from backend openai ended unexpectedly after 3 events"
    assert (error.code, error.message) == ("upstream_stream_interrupted", expected)
    assert failed.response.error is not None and failed.response.error.message == expected


def test_a_json_answer_cut_mid_way_is_a_clear_502(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.cut_stream())  # on a JSON reply: half the body, then the connection drops
    with capture_logs() as logs, pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=SAY)
    assert caught.value.status_code == 502
    _clean(caught.value.message)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["message"] == "the response from backend openai ended before it was complete"
    assert body["code"] == "upstream_response_interrupted"
    [line] = [e for e in logs if e["event"] == "upstream_response_broken"]
    assert line["backend"] == "openai" and "ClientPayloadError" in line["error"]


def test_a_connection_reset_before_the_answer_is_a_clear_502(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.reset())
    with capture_logs() as logs, pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=SAY)
    assert caught.value.status_code == 502
    _clean(caught.value.message)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["message"] == "backend openai closed the connection before answering"
    assert body["code"] == "bad_gateway"
    [line] = [e for e in logs if e["event"] == "upstream_request_broken"]
    assert line["backend"] == "openai" and line["error"]


def test_a_body_of_an_unexpected_shape_is_a_plain_502_and_the_details_are_logged(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message's text that is a number, not a string: the client is told the backend's answer was
    malformed, in words that stay the same, not which Python exception the gateway met."""
    answer = fake_anthropic.json_response

    def malformed(request: Any, payload: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(payload, dict) and payload.get("type") == "message":
            payload = {**payload, "content": [{"type": "text", "text": 5}]}
        return answer(request, payload, *args, **kwargs)

    monkeypatch.setattr(fake_anthropic, "json_response", malformed)
    with (
        capture_logs(processors=[add_request_fields]) as logs,
        pytest.raises(openai.APIStatusError) as caught,
    ):
        gateway.openai().chat.completions.create(model="claude-sonnet", messages=SAY)
    assert caught.value.status_code == 502
    body = caught.value.body
    assert isinstance(body, dict)
    assert (body["message"], body["code"]) == ("backend anthropic sent a malformed response", "bad_gateway")
    [line] = [e for e in logs if e["event"] == "upstream_response_malformed"]
    assert line["backend"] == "anthropic" and line["error"].startswith("TypeError: ")
    assert "gateway/providers/anthropic.py:" in line["at"]
    assert line["request_id"] == caught.value.response.headers["x-request-id"]


async def test_a_backend_that_takes_no_connection_in_time_is_a_504_that_says_so() -> None:
    """A listener whose backlog is full drops the next connection's SYNs (a host cut off by a
    firewall looks the same): the connect timeout ends the attempt. The client is told that no
    connection was made within it, not that the backend "did not answer" within the first-byte
    timeout (10 minutes by default, never waited); the breakers count it as a backend unreachable."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        queued = [socket.socket() for _ in range(3)]
        for filler in queued:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        transport = Transport()
        request = UpstreamRequest(url=f"http://127.0.0.1:{port}/v1/chat/completions", headers={}, body=b"{}")
        try:
            with pytest.raises(GatewayTimeout) as caught:
                await transport.send(request, Timeouts(connect=0.3), "openai")
        finally:
            await transport.close()
            for filler in queued:
                filler.close()
    assert caught.value.message == "cannot connect to backend openai within 0.3s"
    assert isinstance(caught.value, Unreachable) and caught.value.status == 504
