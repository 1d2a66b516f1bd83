"""Slowloris against `weir serve` (uvicorn, the default server): clients that send their headers or
body a byte at a time, or nothing at all, are answered 408 and dropped after
`server.header_timeout` / `server.body_timeout` (1 s each here), while other clients are served
as usual, and responses (a 2-second stream) are not cut by those limits. Headers larger than
`server.max_header_bytes` (16 KiB here) are answered 431 at once, instead of being buffered.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.net import free_port
from tests.fixtures.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-weir-slowloris-0123456789"
TIMEOUT = 1.0
MAX_HEADER_BYTES = 16 * 1024


@pytest.fixture(scope="module")
def weir_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slowloris")


@pytest.fixture(scope="module")
def weir_url(_fake_openai_server: FakeOpenAI, weir_dir: Path) -> Iterator[str]:
    tmp = weir_dir
    fake = _fake_openai_server
    (tmp / "weir.yaml").write_text(
        f"""backends:
  - {{name: openai, type: openai, base_url: "{fake.base_url}", api_key: "{fake.api_key}"}}
models:
  - {{name: gpt-4o-mini, backend: openai}}
tenants:
  - {{name: t, api_keys: ["{KEY}"]}}
server: {{header_timeout: {TIMEOUT}, body_timeout: {TIMEOUT}, max_header_bytes: {MAX_HEADER_BYTES}}}
"""
    )
    port = free_port()
    log = (tmp / "weir.log").open("wb")
    proc = subprocess.Popen(
        [str(ROOT / ".venv/bin/weir"), "serve", "--config", "weir.yaml", "--port", str(port)],
        cwd=tmp,
        env=os.environ,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, (tmp / "weir.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def slow_client(url: str, first: bytes, drip: bytes) -> tuple[bytes, float]:
    """Send `first`, then `drip` a byte every 0.1 s, until the server answers or hangs up (10 s at
    most): what it answered and after how long."""
    port = int(url.rsplit(":", 1)[1])
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(0.1)
        if first:
            conn.sendall(first)
        received = b""
        for i in range(100):  # 10 s at most
            try:
                piece = conn.recv(65536)
            except TimeoutError:
                if i < len(drip):
                    with contextlib.suppress(OSError):
                        conn.sendall(drip[i : i + 1])
                continue
            except ConnectionResetError:
                break
            if not piece:
                break
            received += piece
        return received, time.monotonic() - t0


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


@pytest.mark.parametrize(
    ("first", "drip", "what"),
    [
        (b"", b"GET /healthz HTTP/1.1\r\nx-pad: " + b"a" * 200, "headers"),
        (b"", b"", "headers"),  # connects and sends nothing
        (b"POST /v1/chat/com", b"pletions HTTP/1.1\r\n", "headers"),
        (
            HEAD + f"authorization: Bearer {KEY}\r\ncontent-length: 500\r\n\r\n".encode(),
            b'{"model": ',
            "body",
        ),
    ],
    ids=["drip-from-start", "silent", "drip-request-line", "drip-body"],
)
def test_a_slow_client_gets_408_and_is_dropped_after_the_timeout(
    weir_url: str, weir_dir: Path, first: bytes, drip: bytes, what: str
) -> None:
    received, elapsed = slow_client(weir_url, first, drip)
    assert TIMEOUT - 0.1 < elapsed < TIMEOUT + 3, (elapsed, received)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received
    error = httpx.Response(408, content=body).json()["error"]
    assert error["code"] == "request_timeout" and what in error["message"]
    if what == "body":  # the handler waiting for the body logs the client's fault, not a 500
        time.sleep(0.2)
        log = (weir_dir / "weir.log").read_text()
        assert '"status":499' in log and '"status":500' not in log, log[-2000:]


MESSAGES_HEAD = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


@pytest.mark.parametrize(
    ("first", "drip", "what"),
    [
        (b"POST /v1/messages", b"/count_tokens HTTP/1.1\r\n", "headers"),
        (MESSAGES_HEAD + f"x-api-key: {KEY}\r\ncontent-length: 500\r\n\r\n".encode(), b'{"model": ', "body"),
    ],
    ids=["drip-request-line", "drip-body"],
)
def test_a_slow_anthropic_client_gets_anthropics_408(
    weir_url: str, weir_dir: Path, first: bytes, drip: bytes, what: str
) -> None:
    """On the Messages API's paths the 408 is in Anthropic's error shape, which its clients read (it
    was OpenAI's); once the headers were in, with the request's id, as its log line has it."""
    received, _ = slow_client(weir_url, first, drip)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received
    response = httpx.Response(
        408, content=body, headers=[line.split(b": ", 1) for line in head.split(b"\r\n")[1:]]
    )
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert what in error["error"]["message"]
    if what == "body":
        request_id = response.headers["request-id"]
        assert request_id == response.headers["x-request-id"] == error["request_id"]
        wait_for(lambda: f'"request_id":"{request_id}"' in (weir_dir / "weir.log").read_text())
    else:
        assert "request_id" not in error and "x-request-id" not in response.headers


def test_others_are_served_while_many_slow_clients_hold_connections(
    weir_url: str, _fake_openai_server: FakeOpenAI
) -> None:
    port = int(weir_url.rsplit(":", 1)[1])
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        for conn in slow:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        t0 = time.monotonic()
        assert httpx.get(f"{weir_url}/healthz", timeout=5).status_code == 200
        # A stream that lasts longer than both timeouts: responses are not limited by them.
        _fake_openai_server.fail_next(Fault.slow_stream(0.3))
        reply = httpx.post(
            f"{weir_url}/v1/chat/completions",
            json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert reply.status_code == 200 and reply.text.rstrip().endswith("data: [DONE]"), reply.text[-300:]
        assert time.monotonic() - t0 > TIMEOUT  # it did outlast the timeouts
        time.sleep(TIMEOUT + 1)
        for conn in slow:  # every slow client has been answered 408 and dropped
            conn.settimeout(5)
            assert conn.recv(65536).startswith(b"HTTP/1.1 408")
    finally:
        for conn in slow:
            conn.close()


def _answer(url: str, request: bytes) -> httpx.Response:
    """What the server answers `request`, sent in one piece on a connection of its own."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(request)
        received = b""
        while piece := conn.recv(65536):  # the server hangs up after its answer
            received += piece
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = [tuple(line.split(b": ", 1)) for line in lines]
    return httpx.Response(int(status_line.split()[1]), content=body, headers=headers)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_headers_over_the_limit_get_431_at_once(weir_url: str, path: str) -> None:
    """uvicorn's parser kept every header byte a client sent (50 MB were read and held within the
    header timeout): past `max_header_bytes` the request is refused without waiting for the rest."""
    pad = b"x-pad: " + b"a" * (MAX_HEADER_BYTES + 4096) + b"\r\n"
    t0 = time.monotonic()
    # The headers never end: the refusal cannot wait for them, nor for the header timeout.
    response = _answer(weir_url, f"POST {path} HTTP/1.1\r\nhost: x\r\n".encode() + pad)
    assert time.monotonic() - t0 < TIMEOUT
    assert response.status_code == 431, response.content
    body = response.json()
    if path == "/v1/messages":  # Anthropic's error shape on its paths, as its SDK reads it
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["code"] == "request_headers_too_large"
    assert f"larger than {MAX_HEADER_BYTES} bytes" in body["error"]["message"]


def test_headers_under_the_limit_are_served_on_every_request_of_a_connection(weir_url: str) -> None:
    """The limit is per request: a kept-alive connection's requests together may send more."""
    pad = "a" * (MAX_HEADER_BYTES // 2)
    with httpx.Client(base_url=weir_url) as client:
        for _ in range(3):
            assert client.get("/healthz", headers={"x-pad": pad}).status_code == 200
        assert client.get("/healthz", headers={"x-pad": pad * 3}).status_code == 431
