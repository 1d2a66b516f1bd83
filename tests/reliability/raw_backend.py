"""A backend that answers with whatever bytes a test scripts, at whatever pace: for the failure modes
the fake vendors do not model (keep-alives forever, an event that never ends, a body nested 100k
deep, a trickle that never finishes).

    with RawBackend(lambda send, sleep: send(http_head() + b"{}")) as backend:
        backend.url  # http://127.0.0.1:PORT/v1

The script gets `send(bytes)` and `sleep(seconds)`; it runs once per request, in the connection's
own thread, and the connection closes when it returns. When the backend stops, `send` and `sleep`
raise `Stopped`, so a script that never ends on its own still ends then.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Callable
from types import TracebackType

Send = Callable[[bytes], None]
Sleep = Callable[[float], None]
Script = Callable[[Send, Sleep], None]


class Stopped(Exception):
    """The backend is stopping: the script should return."""


def http_head(status: int = 200, content_type: str = "application/json", extra: str = "") -> bytes:
    """Response headers of a body that runs to the connection's close (no length, no chunking)."""
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\nconnection: close\r\n{extra}\r\n"
    ).encode()


class RawBackend:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.stopping = threading.Event()
        self.requests = 0
        backend = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                conn: socket.socket = self.request
                conn.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head:
                    piece = conn.recv(65536)
                    if not piece:
                        return
                    head += piece
                if head.startswith(b"GET "):  # the gateway's health prober: healthy, whatever the script
                    conn.sendall(http_head() + b'{"data": []}')
                    return
                backend.requests += 1  # the body (if any) is never read: none of the scripts need it

                def send(data: bytes) -> None:
                    if backend.stopping.is_set():
                        raise Stopped
                    conn.sendall(data)

                with contextlib.suppress(Stopped, OSError):
                    backend.script(send, backend.sleep)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def sleep(self, seconds: float) -> None:
        """For scripts: wait, returning at once when the backend stops."""
        if self.stopping.wait(seconds):
            raise Stopped

    def __enter__(self) -> RawBackend:
        self.thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
