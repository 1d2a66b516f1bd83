"""Backend failure modes beyond the fake vendors' (tests/reliability/test_backend_faults.py), from a
backend that answers with scripted bytes (raw_backend.py): keep-alives forever, an event that never
ends, a gzip bomb, a body nested 100,000 deep, a trickle that never finishes, headers cut off.

Each: the client gets a clear error in the OpenAI shape within the backend's configured timeout
(1 s here), another tenant is served meanwhile, and the ledger holds one row with the status the
client saw: no cost, but for a whole answer whose body the gateway gave up on (the bomb, the trickle),
which its vendor generated and bills, billed an estimate (docs/accounting.md).
"""

from __future__ import annotations

import functools
import gzip
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes import FakeOpenAI
from tests.fixtures.gateway import Weir, sqlite_weir
from tests.reliability.billing import ledger
from tests.reliability.raw_backend import RawBackend, Send, Sleep, http_head

READ_TIMEOUT = 1.0
CONFIG = """\
backends:
  - {name: raw, type: openai, base_url: "${RAW_URL}", api_key: k, timeouts: {first_byte: 1, read: 1}}
  - {name: raw-anthropic, type: anthropic, base_url: "${RAW_ROOT}", api_key: k,
     timeouts: {first_byte: 1, read: 1}}
  - {name: healthy, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: raw-model, backend: raw, model: m, price: {input: 1.0, output: 1.0}}
  - {name: raw-claude, backend: raw-anthropic, model: m, price: {input: 1.0, output: 1.0}}
  - {name: gpt-4o-mini, backend: healthy, price: {input: 0.15, output: 0.60}}
database_url: "${DB_URL}"
"""
SSE = http_head(content_type="text/event-stream")
CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


def keepalive_comments(send: Send, sleep: Sleep) -> None:
    send(SSE)
    while True:  # a wedged backend whose proxy keeps the connection warm
        send(b": keep-alive\n\n")
        sleep(0.1)


def anthropic_pings(send: Send, sleep: Sleep) -> None:
    send(SSE)
    while True:  # Anthropic's own keep-alive event, and nothing else
        send(b'event: ping\ndata: {"type": "ping"}\n\n')
        sleep(0.1)


def endless_line(send: Send, sleep: Sleep) -> None:
    send(SSE + b"data: ")
    block = b"a" * 65536
    while True:
        send(block)


@functools.cache
def _bomb() -> bytes:
    return gzip.compress(b" " * 100_000_000, compresslevel=9)  # ~100 KB that inflate to 100 MB


def gzip_bomb(send: Send, sleep: Sleep) -> None:
    body = _bomb()
    send(http_head(extra=f"content-encoding: gzip\r\ncontent-length: {len(body)}\r\n") + body)


def nested_body(send: Send, sleep: Sleep) -> None:
    send(http_head() + b"[" * 100_000 + b"]" * 100_000)


def nested_error_body(send: Send, sleep: Sleep) -> None:
    send(http_head(status=400) + b"[" * 100_000 + b"]" * 100_000)


def trickle(send: Send, sleep: Sleep) -> None:
    send(http_head() + b'{"id": "x", ')
    while True:
        send(b" ")
        sleep(0.1)


def headers_cut_off(send: Send, sleep: Sleep) -> None:
    send(b"HTTP/1.1 200 OK\r\ncontent-type: appl")
    sleep(60)


def json_to_a_stream(send: Send, sleep: Sleep) -> None:
    # A proxy answers a stream request with a JSON document (its own, or a cached non-stream reply).
    send(http_head() + b'{"id":"x","object":"chat.completion","choices":[]}')


@pytest.fixture(scope="module")
def raw() -> Iterator[RawBackend]:
    _bomb()  # made before any request, so the script answers at once
    with RawBackend(keepalive_comments) as backend:
        yield backend


@pytest.fixture
def weir(
    raw: RawBackend, fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Weir]:
    env = {"RAW_URL": raw.url, "RAW_ROOT": raw.url.removesuffix("/v1")}
    with sqlite_weir(CONFIG, fake_openai, tmp_path, monkeypatch, env) as weir:
        yield weir


def call(weir: Weir, key: str, model: str, stream: bool) -> httpx.Response:
    path = "/v1/messages" if model == "raw-claude" else "/v1/chat/completions"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": 5,
    }
    with httpx.stream(
        "POST", f"{weir.url}{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    ) as response:
        response.read()
    return response


FAULTS = [
    # (script, model, stream, statuses the client may see, words its error message must hold, and the
    # output tokens of the estimate it is billed: None, nothing billed)
    pytest.param(
        keepalive_comments, "raw-model", True, {504}, "no content", None, id="sse-keepalive-comments-forever"
    ),
    pytest.param(
        anthropic_pings, "raw-claude", True, {504}, "no content", None, id="anthropic-pings-forever"
    ),
    # Whichever comes first: 64 MiB without a line end (502), or the read timeout without content.
    pytest.param(endless_line, "raw-model", True, {502, 504}, "", None, id="sse-event-that-never-ends"),
    # 100 MB of answer (past the 64 MiB cap): the output the request allowed, its max_tokens.
    pytest.param(gzip_bomb, "raw-model", False, {502}, "larger than", 5, id="gzip-bomb"),
    pytest.param(nested_body, "raw-model", False, {502}, "", None, id="body-nested-100k-deep"),
    pytest.param(nested_error_body, "raw-model", False, {400}, "", None, id="error-body-nested-100k-deep"),
    # What came of it is less than an answer's envelope: the prompt alone.
    pytest.param(trickle, "raw-model", False, {504}, "", 0, id="body-trickles-forever"),
    pytest.param(headers_cut_off, "raw-model", False, {504}, "", None, id="headers-cut-off"),
    pytest.param(json_to_a_stream, "raw-model", True, {502}, "", None, id="json-to-a-stream-request"),
]


@pytest.mark.parametrize(("script", "model", "stream", "statuses", "words", "output"), FAULTS)
def test_raw_fault_gives_a_clear_error_in_time_and_a_true_ledger(
    weir: Weir,
    raw: RawBackend,
    script: object,
    model: str,
    stream: bool,
    statuses: set[int],
    words: str,
    output: int | None,
) -> None:
    raw.script = script  # type: ignore[assignment]
    tenant_id, _, key = weir.tenant_with_key("faulty")
    other_id, _, other_key = weir.tenant_with_key("bystander")

    result: list[tuple[httpx.Response, float]] = []

    def faulty_call() -> None:
        t0 = time.monotonic()
        response = call(weir, key, model, stream)
        result.append((response, time.monotonic() - t0))

    faulty = threading.Thread(target=faulty_call)
    faulty.start()
    time.sleep(0.1)
    assert httpx.get(f"{weir.url}/healthz", timeout=5).status_code == 200
    assert call(weir, other_key, "gpt-4o-mini", stream).status_code == 200
    faulty.join(20)
    assert result, "the client got no answer in 20 s"
    [(response, elapsed)] = result

    assert response.status_code in statuses, response.text[:300]
    assert elapsed < READ_TIMEOUT + 4  # the configured timeout, plus slack for a loaded machine
    body = response.json()
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and words in error["message"]
    if model != "raw-claude":
        assert {"message", "type", "param", "code"} <= set(error)
    weir.ledger(tenant_id, expect=1)  # the attempt's row landed
    time.sleep(0.2)  # a second row (a double count) would have landed with the first
    [(input_tokens, output_tokens, cost, _, estimated)] = ledger(weir, tenant_id)  # one attempt
    if output is None:
        assert (cost, estimated) == (0, False)  # nothing billed
    else:  # raw-model: USD 1 per 1M tokens, in and out
        assert (output_tokens, estimated) == (output, True) and input_tokens > 0
        assert cost == (input_tokens + output_tokens) * 10**6
    assert len(weir.ledger(other_id, expect=1)) == 1
