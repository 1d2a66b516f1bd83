"""Ending a request whose client left before its response started.

uvicorn does not cancel a request's task when its client disconnects, and Litestar only listens for
the disconnect once a streamed response is being sent. Until then the router went on as if the client
were still there: it waited out a retry's `retry-after`, started hedges, let a TTFT timeout fail over
to the next candidate and sent further upstream requests, all for an answer nobody would read, while
the request held the tenant's stream slot and a half-open breaker's one trial.

`cancel_on_disconnect` watches the connection from the moment the request body has been read; a
disconnect before the response starts cancels the request's task (the attempts under way are
cancelled with it and recorded as the client's 499s). It swallows the cancellation it caused, so the
server sees a request that ended without a response (logged as 499 by gateway.middleware).
"""

from __future__ import annotations

import asyncio

from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from gateway.errors import GatewayError, encode_anthropic_error, encode_openai_error, is_anthropic_path
from gateway.pipeline import RequestInfo

_GONE = GatewayError(
    "The client disconnected before the response started.",
    status=499,
    type="invalid_request_error",
    code="client_disconnected",
)


def _gone_body(scope: Scope) -> bytes:
    """The 499's body, in the shape of the request's API (the server drops it: its client is gone)."""
    if not is_anthropic_path(scope["path"]):
        return encode_openai_error(_GONE)
    state = scope.get("state", {})
    info = state.get("weir") if isinstance(state, dict) else None
    return encode_anthropic_error(_GONE, info.request_id if isinstance(info, RequestInfo) else None)


def cancel_on_disconnect(app: ASGIApp) -> ASGIApp:
    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") or task is None:
            await app(scope, receive, send)
            return
        started = False  # the response started: from then on Litestar's own listener handles it
        cancelled = False  # this guard cancelled the request
        # Once the body is in, only the watcher reads `receive`; the app's later reads (a streamed
        # response listening for the disconnect) get the message the watcher got.
        heard: asyncio.Future[ReceiveMessage] | None = None
        watcher: asyncio.Task[None] | None = None

        async def watch(heard: asyncio.Future[ReceiveMessage]) -> None:
            nonlocal cancelled
            message = await receive()
            heard.set_result(message)
            if message["type"] == "http.disconnect" and not started:
                state = scope.get("state", {})
                info = state.get("weir") if isinstance(state, dict) else None
                if isinstance(info, RequestInfo):
                    info.client_gone = True  # the attempts it cancels are the client's 499s
                    info.error = "client_disconnected"  # the request's log line: why it ended
                cancelled = True
                task.cancel()

        async def receive_body() -> ReceiveMessage:
            nonlocal heard, watcher
            if heard is not None:
                return await asyncio.shield(heard)
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                heard = asyncio.get_running_loop().create_future()
                watcher = asyncio.get_running_loop().create_task(watch(heard))
                watcher.add_done_callback(_retrieved)
            return message

        async def send_started(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await app(scope, receive_body, send_started)
        except asyncio.CancelledError:
            # Ours alone: the request ends here. Anyone else's (shutdown) goes on up.
            if not cancelled or task.uncancel() > 0:
                raise
            if not started:
                # The server drops it (its client is gone); the middlewares above count and log
                # the request as the client's 499, not as one that ended without a response (500).
                await send(
                    {
                        "type": "http.response.start",
                        "status": 499,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": _gone_body(scope), "more_body": False})
        finally:
            if watcher is not None:
                # Not awaited: an outer cancellation (shutdown) must not be spent waiting on it.
                watcher.cancel()

    return guard


def _retrieved(watcher: asyncio.Task[None]) -> None:
    """A watcher that failed (a server whose `receive` raised) must not be logged as a task exception
    nobody retrieved: the request then simply goes on unwatched."""
    if not watcher.cancelled():
        watcher.exception()
