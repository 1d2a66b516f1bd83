"""The gateway's log lines as the production config tags them with the request's fields, for the tests
that check a line names the request it came from."""

from __future__ import annotations

import time
from typing import Any

from structlog.testing import capture_logs

from gateway.logging import add_request_fields


def tagged_logs() -> Any:
    """The log lines as the production config builds them (gateway.logging), before rendering."""
    return capture_logs(processors=[add_request_fields])


def logged(logs: list[dict[str, Any]], event: str) -> dict[str, Any]:
    """The line `event`, once the request's own line is written (a stream's lines come as it unwinds)."""
    deadline = time.monotonic() + 5
    while not any(e["event"] == "request" for e in logs) and time.monotonic() < deadline:
        time.sleep(0.01)
    [line] = [e for e in logs if e["event"] == event]
    return line
