"""The in-process gateway helper every test uses (`tests.fixtures.server.serve`) must leave nothing
behind: a gateway that outlived its test went on probing the session's fake vendors every 0.2 s and
failed unrelated tests that count the fakes' requests (CI, 2026-11-30)."""

from __future__ import annotations

import threading
import time

import httpx

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fakes.faults import Fault
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.vendor_gateway import DEMO_KEY, fakes_env, full_config_text


def test_a_request_hanging_upstream_does_not_keep_the_gateway_alive(
    fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    config = parse_config(
        full_config_text(), fakes_env(fake_openai, fake_anthropic, fake_gemini, fake_openai)
    )
    fake_openai.fail_next(Fault.hang())
    before = set(threading.enumerate())
    outcome: list[str] = []

    def client(url: str) -> None:
        try:
            response = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hang"}]},
                headers={"authorization": f"Bearer {DEMO_KEY}"},
                timeout=60,
            )
            outcome.append(str(response.status_code))
        except httpx.HTTPError as exc:
            outcome.append(type(exc).__name__)

    with serve(create_app(config), free_port()) as url:
        caller = threading.Thread(target=client, args=(url,), daemon=True)
        caller.start()
        deadline = time.monotonic() + 10
        while not fake_openai.posts:  # the request is upstream now, and hangs there
            assert time.monotonic() < deadline, "the request never reached the fake"
            time.sleep(0.01)
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 10  # the grace period (2 s) plus shutdown, not for ever
    caller.join(10)
    assert outcome and outcome[0] != "200"  # the hung request was cut, not answered
    assert set(threading.enumerate()) - before == set()  # no server thread left behind
