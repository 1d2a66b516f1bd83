"""The 499 that `gateway.disconnect` answers for a client gone before its response started: the server
drops it, but the request's log line and anything between the gateway and the client (a proxy that
logs bodies) read it, in the shape of the request's API."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.disconnect import cancel_on_disconnect
from gateway.pipeline import RequestInfo


async def _answer_of_a_client_that_left(path: str) -> tuple[int, dict[str, Any]]:
    async def never_answers(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the body; the guard then watches the connection
        await asyncio.Event().wait()

    messages = iter(
        [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]
    )

    async def receive() -> Any:
        return next(messages)

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "path": path, "state": {"weir": RequestInfo(request_id="req-gone-1")}}
    await asyncio.wait_for(cancel_on_disconnect(never_answers)(scope, receive, send), 10)  # type: ignore[arg-type]
    start, body = sent
    return start["status"], json.loads(body["body"])


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_the_499_of_an_anthropic_request_is_in_anthropics_shape(path: str) -> None:
    status, body = await _answer_of_a_client_that_left(path)
    assert status == 499
    assert body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "The client disconnected before the response started.",
        },
        "request_id": "req-gone-1",
    }


async def test_the_499_of_an_openai_request_is_in_openais_shape() -> None:
    status, body = await _answer_of_a_client_that_left("/v1/chat/completions")
    assert status == 499 and body["error"]["code"] == "client_disconnected"
