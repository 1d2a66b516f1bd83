"""A gateway that passed `weir serve`'s checks (gateway.preflight) but fails while it starts (a migration
that fails, the admin DB gone since the check, a server worker that dies): one `Error:` line on stderr
saying what failed and what to do, and an exit status of its own, instead of the server's traceback.

The failure happens in the server's worker (a process of its own under granian), which writes its line
to the file `weir serve` names in FAILURE_FILE_ENV; `weir serve` reads it once the server has stopped."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

# Not `..._FILE`: every `weir` process, the supervised engine included, reads `WEIR_*_FILE` as a secret.
FAILURE_FILE_ENV = "WEIR_STARTUP_FAILURE_PATH"
# Exit statuses of `weir serve` (1: the config or a check before any server starts; 2: usage).
EXIT_STARTUP_FAILED = 3  # passed the checks, then failed to start
EXIT_WORKER_DIED = 4  # started, then its server worker died (granian)
DEBUG_HINT = "--log-level debug logs the traceback"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]  # Litestar's own types its scopes and events narrower


class StartupFailed(Exception):
    """What failed while the gateway started, and what to do, in one line."""


def describe(exc: BaseException) -> str:
    """The line for a failed start: a StartupFailed's own, else the exception's type and words."""
    # Litestar's lifespan runs in a task group, which wraps what it raises in a group of one.
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, StartupFailed):
        return str(exc)
    words = str(exc).strip().splitlines()
    return (
        f"the gateway failed to start: {type(exc).__name__}{': ' + words[0] if words else ''} ({DEBUG_HINT})"
    )


def reporting_startup_failure(app: ASGIApp) -> ASGIApp:
    """`app`, whose failed lifespan startup is one log line (its traceback at debug level only) and
    one line in the failure file, not the traceback the server would log as the failure's message."""
    import structlog  # here: `weir --help` imports this module, and must stay fast

    log = structlog.get_logger("weir.gateway")

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        failed = False

        async def hold_failure(message: Message) -> None:
            nonlocal failed
            if message["type"] == "lifespan.startup.failed":
                failed = True  # said below, once the exception that follows it is known
                return
            await send(message)

        try:
            await app(scope, receive, hold_failure)
        except BaseException as exc:
            if not failed:
                raise
            said = describe(exc)
            log.error("gateway_startup_failed", error=said)
            log.debug("gateway_startup_failed", exc_info=exc)
            record_failure(said)
            # Without a message: the server logs only that the start failed, its traceback not at all.
            await send({"type": "lifespan.startup.failed", "message": ""})

    return wrapped


def record_failure(said: str) -> None:
    """`said` to the failure file `weir serve` named, for it to say once the server has stopped."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if path:
        Path(path).write_text(said)


def failure_said(path: Path) -> str | None:
    """The line a worker wrote to the failure file at `path`, if it wrote one."""
    try:
        said = path.read_text().strip()
    except OSError:
        return None
    return said or None
