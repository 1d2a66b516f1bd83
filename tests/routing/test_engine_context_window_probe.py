"""The context window an engine serves, known to the gateway before any request: its `/v1/models` says
each model's `max_model_len`, as vLLM's and SGLang's do, and the gateway's health probes (and, for an
engine it started, its supervisor) read it. A request asking for more output than the window has room
for is then sent at once for the room its prompt leaves (`output_capped=N`), with no refused attempt
first, and an engine restarted with another window is followed from the next probe, where a window
learnt from a 400 was kept for the gateway's life.

The real engine server on the tiny random Llama (a 1,024-token window, one token per byte) behind a
real gateway, as in test_engine_context_room.py; the route here probes its backends every 0.1 s."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from structlog.testing import capture_logs

from gateway import estimate
from gateway.config import Backend, parse_config
from gateway.transport import Transport
from routing.breaker import Breakers
from routing.health import HealthProber
from routing.windows import ANY_MODEL, ContextWindows, served_windows
from tests.fakes import FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.vendor_gateway import RunningGateway, running_gateway
from tests.fixtures.waiting import wait_for
from tests.gateway.test_engine_backend import TINY_ENGINE
from tests.routing.engine_candidate import config_text, engine_gateway, tiny_engine
from tests.routing.routed import ledger, route_header, runtime, settled

WINDOW = 1024  # the tiny model's: max_position_embeddings, and 64 KV blocks of 16
CLAUDE_CODE = 32_000
PROBED = "  - {name: probed, candidates: [{model: small}], retry: {attempts: 1}, probe_interval: 0.1}\n"
SHORT = [{"role": "user", "content": "hi"}]
EOS = {"0": 100}  # the engine's EOS at once: an answer of no length
# What the gateway's estimate of SHORT adds for a chat template (`estimate.template_tokens`): a
# window's room is that much lower than its JSON alone leaves.
TEMPLATE = estimate.CHAT_TOKENS + estimate.MESSAGE_TOKENS


@pytest.fixture(autouse=True)
def byte_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's estimate of a prompt at one byte a token: the tiny model's tokens are bytes, where
    a real tokenizer's are about the 4 bytes the gateway counts. So the room it takes off the probed
    window fits here as it does there (an estimate below the engine's count gets the engine's 400,
    which says the exact room: test_engine_context_room.py)."""
    monkeypatch.setattr(estimate, "BYTES_PER_TOKEN", 1)


def known_window(gateway: RunningGateway) -> int | None:
    """The window the gateway would fit a request to the engine's `tiny` in (None: none known yet)."""
    window: int | None = runtime(gateway).router.windows.window("local", "tiny")
    return window


def prompt_tokens(port: int) -> int:
    body = {"model": "tiny", "messages": SHORT}
    count = httpx.post(f"http://127.0.0.1:{port}/tokenize", json=body, timeout=10).json()["count"]
    assert isinstance(count, int)
    return count


def ask(gateway: RunningGateway, model: str = "probed") -> dict[str, str]:
    """`x-weir-route` of a chat asking Claude Code's output limit, answered in full."""
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=model,
        messages=SHORT,  # type: ignore[arg-type]
        max_tokens=CLAUDE_CODE,
        logit_bias=EOS,  # type: ignore[arg-type]
    )
    assert raw.parse().choices[0].finish_reason == "stop"
    return route_header(raw)


@pytest.fixture
def probed(fake_openai: FakeOpenAI) -> Iterator[tuple[int, RunningGateway]]:
    with tiny_engine() as (port, _), engine_gateway(fake_openai, port, PROBED) as gateway:
        yield port, gateway


def test_a_short_prompt_fits_its_first_attempt_at_the_gateways_usual_estimate(
    probed: tuple[int, RunningGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 4 bytes a token the JSON of "hi" is 10 tokens and the engine counts 20 (its chat template's
    tokens): the gateway's estimate holds a chat template's allowance (`estimate.template_tokens`), so
    the room it takes off the window fits and the first attempt is not refused."""
    monkeypatch.setattr(estimate, "BYTES_PER_TOKEN", 4)
    port, gateway = probed
    wait_for(lambda: known_window(gateway) == WINDOW, timeout=5)
    header = ask(gateway)
    assert header["attempts"] == "1" and "tried" not in header
    assert int(header["output_capped"]) <= WINDOW - prompt_tokens(port)


def test_the_engine_lists_its_window_as_vllm_does(probed: tuple[int, RunningGateway]) -> None:
    port, _ = probed
    models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", WINDOW)]


def test_the_first_request_is_capped_by_the_probed_window_with_no_refused_attempt(
    probed: tuple[int, RunningGateway],
) -> None:
    port, gateway = probed
    wait_for(lambda: known_window(gateway) == WINDOW, timeout=5)
    header = ask(gateway)
    room = WINDOW - prompt_tokens(port)
    assert header["attempts"] == "1" and "tried" not in header  # no refused attempt
    assert room - 64 < int(header["output_capped"]) <= room  # the estimate's room: it fits
    settled(gateway, 1)
    assert ledger(gateway) == [("local", 200)]


def test_an_engine_restarted_with_a_smaller_window_is_followed_after_the_next_probe(
    fake_openai: FakeOpenAI,
) -> None:
    port = free_port()
    with engine_gateway(fake_openai, port, PROBED) as gateway:
        with tiny_engine(port=port):
            wait_for(lambda: known_window(gateway) == WINDOW, timeout=5)
            assert int(ask(gateway)["output_capped"]) > 512
        with tiny_engine(port=port, max_model_len=512):  # started again with `--max-model-len 512`
            wait_for(lambda: known_window(gateway) == 512, timeout=5)
            header = ask(gateway)
            assert header["attempts"] == "1" and 512 - 64 - TEMPLATE < int(header["output_capped"]) < 512
        settled(gateway, 2)
        assert ledger(gateway) == [("local", 200), ("local", 200)]  # no 400, before or after


async def test_a_probe_of_a_list_without_windows_changes_nothing_and_logs_nothing(
    fake_openai: FakeOpenAI,
) -> None:
    """OpenAI's own list (the fake's, asked with the backend's key) says no window: the backend is
    up, a window its 400 reported stands, and nothing is logged, round after round."""
    windows, transport, breakers = ContextWindows(), Transport(), Breakers()
    windows.reported("vendor", "gpt-4o-mini", 128_000)
    prober = HealthProber(transport, breakers, interval=1.0, windows=windows)
    vendor = msgspec.convert(
        {
            "name": "vendor",
            "type": "openai",
            "base_url": fake_openai.base_url,
            "api_key": fake_openai.api_key,
        },
        Backend,
    )
    try:
        prober.watch({"vendor": (vendor, ["vendor/gpt-4o-mini"])})
        with capture_logs() as logs:
            for _ in range(3):
                await prober.run_once()
    finally:
        await transport.close()
    assert len(fake_openai.requests) == 3 and breakers.get("vendor/gpt-4o-mini").failures == 0
    assert windows.window("vendor", "gpt-4o-mini") == 128_000
    assert [e for e in logs if e["log_level"] != "debug"] == []


def test_the_window_of_an_engine_the_gateway_started_is_known_from_the_moment_it_is_up(
    fake_openai: FakeOpenAI,
) -> None:
    """An engine the gateway starts (`model:` without `url:`) is read by its supervisor as it comes
    up, flags such as `--max-model-len` included, even where no route probes it (`auto` does not)."""
    port = free_port()
    serve = [sys.executable, TINY_ENGINE, "engine", "serve", "--model", "tiny", "--port", str(port)]
    command = msgspec.json.encode([*serve, "--max-model-len", "512"]).decode()
    engine = f"model: tiny, port: {port}, command: {command}"
    with running_gateway(parse_config(config_text(engine, fake_openai), {})) as gateway:
        wait_for(lambda: known_window(gateway) == 512, timeout=60)
        header = ask(gateway, "auto")
        assert header["attempts"] == "1" and 512 - 64 - TEMPLATE < int(header["output_capped"]) < 512
        settled(gateway, 1)
        assert ledger(gateway) == [("local", 200)]


@pytest.mark.parametrize(
    ("body", "sole", "windows"),
    [
        # vLLM: each served name and LoRA adapter with its window
        (
            {
                "data": [
                    {"id": "llama", "object": "model", "max_model_len": 8192},
                    {"id": "llama-lora", "object": "model", "max_model_len": 8192, "parent": "llama"},
                ]
            },
            False,
            {"llama": 8192, "llama-lora": 8192},
        ),
        # the engine: one model, whatever name it is asked by
        ({"data": [{"id": "tiny", "max_model_len": 1024}]}, True, {"tiny": 1024, ANY_MODEL: 1024}),
        # OpenAI's own list, and values that are no window: nothing known
        ({"object": "list", "data": [{"id": "gpt-4o", "owned_by": "system"}]}, False, {}),
        ({"data": [{"id": "a", "max_model_len": "8k"}, {"id": "b", "max_model_len": True}]}, True, {}),
        ({"data": [{"id": "a", "max_model_len": 0}, {"id": "b", "max_model_len": None}]}, False, {}),
        # no model list at all: not "no window", nothing said
        ({"models": []}, False, None),
        ([1, 2], False, None),
    ],
)
def test_model_lists_say_windows(body: Any, sole: bool, windows: dict[str, int] | None) -> None:
    assert served_windows(msgspec.json.encode(body), sole=sole) == windows
    assert served_windows(b"<html>", sole=sole) is None


def test_a_declared_window_lowers_the_backends_never_raises_it_and_the_newest_fact_wins() -> None:
    windows = ContextWindows()
    assert windows.window("local", "tiny") is None and windows.window("local", "tiny", 512) == 512
    windows.served("local", {"tiny": 1024})
    assert windows.window("local", "tiny") == 1024
    assert windows.window("local", "tiny", 512) == 512  # the operator's lower limit is kept
    assert windows.window("local", "tiny", 4096) == 1024  # the engine holds no more than it says
    windows.reported("local", "tiny", 2048)  # a 400 since the last probe: newer
    assert windows.window("local", "tiny") == 2048
    assert windows.served("local", {"tiny": 2048}) == {"tiny": 2048}  # a change, to log
    assert windows.served("local", {"tiny": 2048}) == {}  # the same again: nothing to log
    assert windows.served("local", {}) == {"tiny": 0}  # no longer said
    assert windows.window("local", "tiny") is None
    windows.served("local", {ANY_MODEL: 512})  # an engine asked by another name than it lists
    assert windows.window("local", "smollm2-135m") == 512 and windows.window("other", "tiny") is None
