"""Every backend failure mode of the fakes, through a real gateway with its ledger on: the client gets
a correct answer or a clear error in the OpenAI shape, the gateway keeps answering others meanwhile,
and the ledger holds exactly one row per attempt with the status the client saw.

(tests/gateway/test_errors.py pins each error's message and code per vendor, tests/routing the
failover; this file checks the gateway as a whole stays responsive and its ledger right.)
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.gateway import Weir

CONFIG = """\
backends:
  - name: openai
    type: openai
    base_url: "${OPENAI_BASE_URL}"
    api_key: "${OPENAI_API_KEY}"
    timeouts: {first_byte: 1.5, read: 1.5}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, cached_input: 0.075, output: 0.60}}
database_url: "${DB_URL}"
"""
HI = [{"role": "user", "content": "one two three four five six"}]


@pytest.fixture
def weir_config() -> str:
    return CONFIG


def call(weir: Weir, key: str, stream: bool) -> httpx.Response:
    """One chat request as raw HTTP, the streamed body read to its end."""
    with httpx.stream(
        "POST",
        f"{weir.url}/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": HI, "stream": stream},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    ) as response:
        response.read()
    return response


FAULTS = [
    # (fault, status the client sees, status the ledger holds)
    pytest.param(Fault.status(429, retry_after=7), 429, 429, id="429-retry-after"),
    pytest.param(Fault.status(500), 502, 500, id="500"),
    pytest.param(Fault.status(503), 503, 503, id="503"),
    pytest.param(Fault.delay(0.3), 200, 200, id="slow-first-byte"),
    pytest.param(Fault.hang(), 504, 0, id="hang"),
    pytest.param(Fault.reset(), 502, 0, id="reset"),
    pytest.param(Fault.garbage(), 502, 502, id="garbage"),
    pytest.param(Fault.wrong_content_type(), 502, 502, id="html"),
    pytest.param(Fault.huge(3_000_000), 200, 200, id="huge"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("fault", "client_status", "ledger_status"), FAULTS)
def test_fault_gives_a_clear_answer_and_a_true_ledger(
    weir: Weir, fake_openai: FakeOpenAI, fault: Fault, client_status: int, ledger_status: int, stream: bool
) -> None:
    tenant_id, _, key = weir.tenant_with_key("faulty")
    other_id, _, other_key = weir.tenant_with_key("bystander")
    fake_openai.fail_next(fault, path="/v1/chat/completions")

    result: list[httpx.Response] = []
    faulty = threading.Thread(target=lambda: result.append(call(weir, key, stream)))
    faulty.start()
    time.sleep(0.1)  # the faulty request is in flight; everyone else is still served
    t0 = time.monotonic()
    assert httpx.get(f"{weir.url}/healthz", timeout=5).status_code == 200
    assert call(weir, other_key, stream).status_code == 200
    assert time.monotonic() - t0 < 1.0 or not faulty.is_alive()
    faulty.join(30)
    [response] = result

    assert response.status_code == client_status, response.text
    if client_status >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    if client_status == 429:
        assert response.headers["retry-after"] == "7"
    rows = weir.ledger(tenant_id, expect=1)
    time.sleep(0.2)  # a second row (a double count) would have landed with the first
    rows = weir.ledger(tenant_id, expect=1)
    assert [row[4] for row in rows] == [ledger_status]
    if client_status == 200:
        reported = fake_openai.usages[0]
        assert rows[0][:3] == (reported.input_tokens, reported.cached_input_tokens, reported.output_tokens)
    else:
        assert rows[0][3] == 0  # nothing produced, nothing billed
    assert len(weir.ledger(other_id, expect=1)) == 1


def test_openai_sdk_sees_each_fault_as_its_own_error(weir: Weir, fake_openai: FakeOpenAI) -> None:
    _, _, key = weir.tenant_with_key("sdk")
    client = weir.client(key)
    for fault, error in [
        (Fault.status(429, retry_after=1), openai.RateLimitError),
        (Fault.hang(), openai.APIStatusError),
        (Fault.garbage(), openai.APIStatusError),
    ]:
        fake_openai.fail_next(fault)
        with pytest.raises(error):
            client.chat.completions.create(model="gpt-4o-mini", messages=HI)  # type: ignore[arg-type]
    assert client.chat.completions.create(model="gpt-4o-mini", messages=HI).choices[0].message.content  # type: ignore[arg-type]
