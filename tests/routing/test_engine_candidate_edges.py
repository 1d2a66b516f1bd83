"""The bundled engine as a route candidate, with a vendor behind it: an engine still loading its model,
one whose loop dies mid-stream or for good (its process living on), one that sends a garbage load
report, one too slow on a CPU for the route's hedge; what the client sees, which attempts the ledger
holds and what each cost. The real engine server runs the tiny random Llama in this process; where a
process has to die or misbehave on cue, a small stand-in (`STAND_IN`) plays the engine."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from structlog.testing import capture_logs

from gateway import engine_supervisor
from gateway.config import Backend, parse_config
from gateway.providers.base import CONTINUE_INSTRUCTION
from gateway.transport import Transport
from routing.breaker import Breakers
from routing.health import HealthProber
from routing.load import LoadReports
from tests.fakes import FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.vendor_gateway import RunningGateway, running_gateway
from tests.fixtures.waiting import wait_for
from tests.routing.engine_candidate import (
    BS,
    ECHO,
    FAST,
    HI,
    config_text,
    engine_gateway,
    failing_steps,
    slow_steps,
    tiny_engine,
)
from tests.routing.routed import route_header, settled

# An engine in one file: /health, /v1/models and chat as `weir engine serve` answers them, plus
# `POST /__die__`, after which it answers as an engine whose loop died does (the process lives on:
# /health 503 "error", every request 503 `engine_dead`). argv: port [load report header value].
STAND_IN = """
import json, os, sys, time
from aiohttp import web

dead = False
report = sys.argv[2] if len(sys.argv) > 2 else None

def engine_dead():
    error = {"message": "the engine stopped: RuntimeError('step')", "type": "server_error",
             "param": None, "code": "engine_dead"}
    return web.json_response({"error": error}, status=503)

async def health(request):
    if dead:
        return web.json_response({"status": "error", "detail": "RuntimeError('step')"}, status=503)
    return web.json_response({"status": "ok", "model": "tiny"})

async def models(request):
    return engine_dead() if dead else web.json_response({"object": "list", "data": [{"id": "tiny"}]})

async def die(request):
    global dead
    dead = True
    return web.json_response({})

async def chat(request):
    if dead:
        return engine_dead()
    body = await request.json()
    text = f"engine pid {os.getpid()} says: {body['messages'][-1]['content']}"
    response = web.json_response({
        "id": "chatcmpl-engine", "object": "chat.completion", "created": int(time.time()),
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    })
    return response

async def add_report(request, response):  # on every answer, as the engine's own does
    if report is not None and "endpoint-load-metrics-format" in request.headers:
        response.headers["endpoint-load-metrics"] = report

app = web.Application()
app.on_response_prepare.append(add_report)
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
app.router.add_post("/__die__", die)
app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

# A load report no engine means: a queue length too large for a float, or JSON nested past any
# decoder's depth. Both fit in one header line.
HUGE_QUEUE = 'JSON {"named_metrics": {"num_requests_waiting": 1' + "0" * 400 + "}}"
DEEP = "JSON " + "[" * 5000


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def engine_state(url: str) -> tuple[int, str]:
    """/readyz's status code and what it says of the engine `local`."""
    response = httpx.get(url, timeout=2)
    return response.status_code, response.json()["engines"]["local"]


def events(gateway: RunningGateway) -> list[Any]:
    return sorted(gateway.sink.events, key=lambda e: e.attempt)


@contextmanager
def stand_in(tmp_path: Path, report: str | None = None) -> Iterator[int]:
    """The stand-in engine as a process of its own; yields its port once it answers."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    port = free_port()
    process = subprocess.Popen([sys.executable, str(script), str(port), *([report] if report else [])])
    try:
        wait_for(lambda: answers(f"http://127.0.0.1:{port}/health"))
        yield port
    finally:
        process.terminate()
        process.wait(10)


# --- load reports ------------------------------------------------------------------------------------


@pytest.mark.parametrize("report", [HUGE_QUEUE, DEEP], ids=["huge-number", "deep-json"])
def test_a_garbage_load_report_never_fails_the_request_it_came_with(
    tmp_path: Path, fake_openai: FakeOpenAI, report: str
) -> None:
    """A report is advice: one that cannot be read is ignored. A JSON report whose queue length does
    not fit a float raised OverflowError (and one nested thousands deep RecursionError) out of the
    pipeline: the engine had answered, yet the client got a 500 and nothing failed over."""
    with stand_in(tmp_path, report) as port, engine_gateway(fake_openai, port) as gateway:
        client = gateway.openai()
        reply = client.chat.completions.create(model="small", messages=HI)  # type: ignore[arg-type]
        assert (reply.choices[0].message.content or "").endswith(f"says: {ECHO}")
        raw = client.chat.completions.with_raw_response.create(model="auto", messages=HI)  # type: ignore[arg-type]
        header = route_header(raw)
        assert header["candidate"] == "small" and header["attempts"] == "1"
        assert fake_openai.requests == []  # the engine answered both: the vendor was never asked
        assert [e.status for e in events(gateway)] == [200, 200]


@pytest.mark.parametrize("report", [HUGE_QUEUE, DEEP], ids=["huge-number", "deep-json"])
async def test_a_garbage_load_report_does_not_stop_the_probe_round(tmp_path: Path, report: str) -> None:
    """A probe round asks every backend at once; an engine's unreadable report raised out of the
    round, so no breaker of any backend heard of that round: a dead vendor stayed closed."""
    with stand_in(tmp_path, report) as port:
        loads, transport, breakers = LoadReports(), Transport(), Breakers()
        prober = HealthProber(transport, breakers, interval=1.0, loads=loads)
        engine = msgspec.convert(
            {"name": "local", "type": "engine", "base_url": f"http://127.0.0.1:{port}/v1"}, Backend
        )
        dead = msgspec.convert(
            {"name": "dead", "type": "openai", "base_url": f"http://127.0.0.1:{free_port()}/v1"}, Backend
        )
        try:
            prober.watch({"local": (engine, ["local:tiny"]), "dead": (dead, ["dead:gpt-4o-mini"])})
            await prober.run_once()
        finally:
            await transport.close()
        assert breakers.get("dead:gpt-4o-mini").failures == 1  # the dead vendor's probe counted
        assert breakers.get("local:tiny").failures == 0  # the engine answered: it is up
        assert loads.waiting("local") is None  # and said nothing usable about its queue


# --- the supervised engine ---------------------------------------------------------------------------


def test_an_engine_whose_loop_died_is_restarted_and_clients_fail_over_meanwhile(
    tmp_path: Path, fake_openai: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception inside the engine's step (a CUDA fault, an engine bug) stops its loop but not its
    process: /health says 503 "error" and every request gets 503 `engine_dead`, for ever. The
    supervisor only restarted an engine whose process exited, so the engine stayed dead, and the
    gateway's /readyz kept saying the engine was up. Now the supervisor watches /health and restarts
    it; the route's vendor answers the clients meanwhile, none of them sees an error."""
    monkeypatch.setattr(engine_supervisor, "WATCH_INTERVAL_S", 0.2, raising=False)
    monkeypatch.setattr(engine_supervisor, "RESTART_BACKOFF", (0.2,) * 5)
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    port = free_port()
    engine = f'model: tiny, port: {port}, command: ["{sys.executable}", "{script}", "{port}"]'
    with running_gateway(parse_config(config_text(engine, fake_openai), {})) as gateway:
        ready = f"{gateway.url}/readyz"
        wait_for(lambda: answers(ready))
        client = gateway.openai()

        def ask() -> tuple[str, str]:
            raw = client.chat.completions.with_raw_response.create(model="auto", messages=HI)  # type: ignore[arg-type]
            return route_header(raw)["candidate"], raw.parse().choices[0].message.content or ""

        candidate, text = ask()
        assert candidate == "small"
        first_pid = int(text.split()[2])
        httpx.post(f"http://127.0.0.1:{port}/__die__")  # the loop dies; the process lives on
        assert ask() == ("gpt-4o-mini", ECHO)  # the vendor answers, invisibly
        # /readyz says the engine is down, the replica staying in the pool (its vendor answers)...
        wait_for(lambda: engine_state(ready) == (200, "restarting"), timeout=5)
        wait_for(lambda: engine_state(ready) == (200, "ready"), timeout=8)  # ...until a new one is up
        supervised = gateway.app.state.gateway.engines[0]  # type: ignore[attr-defined]
        assert supervised.restarts == 1 and supervised.process.pid != first_pid
        wait_for(lambda: ask()[0] == "small", timeout=5)  # the breaker lets the engine back in
        assert int(ask()[1].split()[2]) == supervised.process.pid
        assert all(e.status in (200, 503) for e in gateway.sink.events)  # never anything else


# --- the real engine, tiny ---------------------------------------------------------------------------


def test_an_engine_still_loading_its_model_fails_over_invisibly(fake_openai: FakeOpenAI) -> None:
    """At start the engine's port is open before its model is: it answers 503 `model_not_ready`. A
    route that lists it first answers from the vendor (JSON and streams); the engine's attempt is an
    event of its own, priced 0; the plain model gets the engine's 503 in OpenAI's shape."""
    with tiny_engine(loading=True) as (port, _), engine_gateway(fake_openai, port) as gateway:
        client = gateway.openai()
        raw = client.chat.completions.with_raw_response.create(model="auto", messages=HI)  # type: ignore[arg-type]
        route = route_header(raw)
        assert raw.parse().choices[0].message.content == ECHO
        assert route["candidate"] == "gpt-4o-mini" and route["tried"] == "small:503,gpt-4o-mini:ok"
        stream = client.chat.completions.create(model="auto", messages=HI, stream=True)  # type: ignore[arg-type]
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ECHO
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="small", messages=HI)  # type: ignore[arg-type]
        assert refused.value.status_code == 503 and "loading" in str(refused.value.message)
        settled(gateway, 5)
        got = [(e.backend, e.status, e.cost_pico_usd, e.attempt) for e in events(gateway)]
        engine = [g for g in got if g[0] == "local"]
        assert engine == [("local", 503, 0, 1)] * 3  # one event per attempt, nothing billed
        assert sorted(g[:2] for g in got if g[0] == "vendor") == [("vendor", 200)] * 2


def test_a_loading_engine_is_passed_over_at_once_not_retried_in_place(fake_openai: FakeOpenAI) -> None:
    """The engine's 503 `model_not_ready` reached the route as the gateway's `backend_unavailable`,
    so a route that retries in place asked the loading engine again after its backoff (0.2 s, one
    more attempt in the ledger) before its vendor. Now the engine's own code decides: the vendor is
    asked at once. A client of the engine's model itself still sees the gateway's 503 in OpenAI's
    shape, with the engine's `retry-after` hint, which the engine now sends."""
    patient = "  - {name: patient, candidates: [{model: small}], fallbacks: [gpt-4o-mini]}"  # 2 attempts
    with tiny_engine(loading=True) as (port, _), engine_gateway(fake_openai, port, patient) as gateway:
        direct = httpx.get(f"http://127.0.0.1:{port}/v1/models")
        assert direct.status_code == 503 and direct.headers["retry-after"] == "5"
        assert direct.json()["error"]["code"] == "model_not_ready"
        client = gateway.openai()
        raw = client.chat.completions.with_raw_response.create(model="patient", messages=HI)  # type: ignore[arg-type]
        assert raw.parse().choices[0].message.content == ECHO
        assert route_header(raw)["tried"] == "small:503,gpt-4o-mini:ok"
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="small", messages=HI)  # type: ignore[arg-type]
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "5"
        assert refused.value.code == "backend_unavailable"
        settled(gateway, 3)
        assert sorted((e.backend, e.status) for e in events(gateway)) == [
            ("local", 503),
            ("local", 503),
            ("vendor", 200),
        ]


def test_engine_attempts_are_billed_their_cached_prompt_tokens_at_the_configured_price(
    fake_openai: FakeOpenAI,
) -> None:
    """The engine's prefix cache shows as `cached_tokens`; the usage event splits the prompt into
    input and cached input and prices both (and the output) at the model's configured prices, and
    x-weir-route names the engine candidate."""
    prompt = [{"role": "user", "content": "a shared document the engine caches. " * 4}]
    with tiny_engine() as (port, _), engine_gateway(fake_openai, port) as gateway:
        client = gateway.openai()
        replies = []
        for stream in (False, False, True):
            if stream:
                chunks = list(
                    client.chat.completions.create(
                        model="auto",
                        messages=prompt,  # type: ignore[arg-type]
                        max_tokens=2,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                replies.append(chunks[-1].usage)
            else:
                raw = client.chat.completions.with_raw_response.create(
                    model="auto",
                    messages=prompt,  # type: ignore[arg-type]
                    max_tokens=2,
                )
                assert route_header(raw)["candidate"] == "small"
                replies.append(raw.parse().usage)
        assert fake_openai.requests == []
        got = events(gateway)
        assert len(got) == 3 and all(e.backend == "local" and e.status == 200 for e in got)
        assert all("candidate=small" in (e.routing or "") for e in got)
        for usage, event in zip(replies, got, strict=True):
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            assert event.usage.cached_input_tokens == cached
            assert event.usage.input_tokens == usage.prompt_tokens - cached
            assert event.usage.output_tokens == usage.completion_tokens
            # USD per 1M tokens: 1.0 input, 0.25 cached input, 2.0 output -> pico-USD per token x 1e6
            expected = (event.usage.input_tokens * 1.0 + cached * 0.25 + usage.completion_tokens * 2.0) * 1e6
            assert event.cost_pico_usd == round(expected)
        assert got[0].usage.cached_input_tokens == 0 and got[1].usage.cached_input_tokens >= 32


IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
WITH_IMAGE = [
    {
        "role": "user",
        "content": [{"type": "text", "text": ECHO}, {"type": "image_url", "image_url": {"url": IMAGE}}],
    }
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize(
    ("asked", "param"),
    [
        ({"messages": WITH_IMAGE}, "messages[0].content"),
        ({"messages": HI, "tools": TOOLS}, "tools"),
    ],
    ids=["image", "tools"],
)
def test_what_the_engine_cannot_take_is_answered_by_the_routes_vendor(
    fake_openai: FakeOpenAI, asked: dict[str, Any], param: str
) -> None:
    """The tiny model reads no images and its chat template writes no tool prompt. Its 400 said so
    without OpenAI's `unsupported_*` code, so the gateway took it for the client's mistake and ended
    the request, although the route's vendor takes both. Asked for the engine's model alone, the
    client still gets that 400, naming the parameter."""
    with tiny_engine() as (port, _), engine_gateway(fake_openai, port) as gateway:
        client = gateway.openai()
        raw = client.chat.completions.with_raw_response.create(model="auto", **asked)
        header = route_header(raw)
        assert header["candidate"] == "gpt-4o-mini" and header["tried"].startswith("small:")
        assert raw.parse().choices[0].message.content and len(fake_openai.requests) == 1
        settled(gateway, 2)
        assert [(e.backend, e.status, e.cost_pico_usd) for e in events(gateway)] == [
            ("local", 400, 0),
            ("vendor", 200, events(gateway)[1].cost_pico_usd),
        ]
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="small", **asked)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == param
        assert len(fake_openai.requests) == 1


def test_an_engine_dying_mid_stream_is_continued_on_the_vendor(fake_openai: FakeOpenAI) -> None:
    with tiny_engine() as (port, llm), engine_gateway(fake_openai, port) as gateway, failing_steps(llm, 4):
        stream = gateway.openai().chat.completions.create(
            model="auto",
            messages=HI,  # type: ignore[arg-type]
            stream=True,
            max_tokens=12,
            temperature=0,
            logit_bias=BS,  # type: ignore[arg-type]
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == "BBBB" + ECHO  # the engine's four tokens, then the vendor's continuation
        assert fake_openai.last_request.json["messages"][-2] == {"role": "assistant", "content": "BBBB"}
        assert fake_openai.last_request.json["messages"][-1] == {
            "role": "user",
            "content": CONTINUE_INSTRUCTION,
        }
        settled(gateway, 2)
        got = events(gateway)
        assert [(e.backend, e.status) for e in got] == [("local", 502), ("vendor", 200)]
        assert got[0].usage.output_tokens > 0 and got[0].estimated  # what the engine had streamed
        # The process lives on, dead, saying so as the stand-in does (the supervisor restarts it).
        health = httpx.get(f"http://127.0.0.1:{port}/health")
        assert health.status_code == 503 and health.json()["status"] == "error"


def test_an_engine_dying_mid_stream_ends_with_an_sse_error_where_the_route_forbids_resuming(
    fake_openai: FakeOpenAI,
) -> None:
    with tiny_engine() as (port, llm), engine_gateway(fake_openai, port) as gateway, failing_steps(llm, 4):
        stream = gateway.openai().chat.completions.create(
            model="auto-no-resume",
            messages=HI,  # type: ignore[arg-type]
            stream=True,
            max_tokens=12,
            temperature=0,
            logit_bias=BS,  # type: ignore[arg-type]
        )
        text = ""
        with pytest.raises(openai.APIError, match="engine stopped"):
            for chunk in stream:
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        assert text == "BBBB" and fake_openai.requests == []


SLOW_ROUTES = f"""\
  - {{name: hedged, hedge: {{delay: 0.2}}, candidates: [{{model: small}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: impatient, ttft_timeout: 0.3, candidates: [{{model: small}}], fallbacks: [gpt-4o-mini], {FAST}}}
"""


@pytest.mark.parametrize("route", ["hedged", "impatient"])
def test_a_slow_cpu_engine_is_hedged_or_timed_out_to_the_vendor_and_its_request_aborted(
    fake_openai: FakeOpenAI, route: str
) -> None:
    """An engine too slow for the route (its first token later than the hedge delay or the TTFT
    timeout) loses to the vendor; its attempt is an event of its own (499 cancelled by the hedge, 504
    timed out), and the request it was computing is aborted in the engine, not left to run on for
    nobody."""
    with (
        tiny_engine() as (port, llm),
        engine_gateway(fake_openai, port, SLOW_ROUTES) as gateway,
        slow_steps(llm, 0.6),
    ):
        client = gateway.openai()
        raw = client.chat.completions.with_raw_response.create(
            model=route,
            messages=HI,  # type: ignore[arg-type]
            stream=True,
            max_tokens=8,
        )
        header = route_header(raw)
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        assert text == ECHO and header["candidate"] == "gpt-4o-mini"
        settled(gateway, 2)
        lost = 499 if route == "hedged" else 504
        assert sorted((e.backend, e.status) for e in gateway.sink.events) == [
            ("local", lost),
            ("vendor", 200),
        ]
        wait_for(lambda: not llm.has_unfinished_requests(), timeout=5)


def test_an_engine_command_that_cannot_run_is_logged_and_given_up_on_and_shutdown_stays_clean(
    fake_openai: FakeOpenAI,
) -> None:
    """A supervised engine whose `command` cannot be started (a typo, a missing binary) ended the
    supervisor's task on its first try: no log line, /readyz 503 for ever, and the exception only
    surfaced when the gateway shut down. Then it was retried for ever, /readyz "starting" meanwhile.
    A configuration error: given up on at once, said in the log and /readyz; the route's vendor
    serves meanwhile."""
    engine = f'model: tiny, port: {free_port()}, command: ["/nonexistent/weir-engine"]'
    config = parse_config(config_text(engine, fake_openai), {})
    with capture_logs() as logs, running_gateway(config) as gateway:
        reply = gateway.openai().chat.completions.create(model="auto", messages=HI)  # type: ignore[arg-type]
        assert reply.choices[0].message.content == ECHO
        wait_for(lambda: engine_state(f"{gateway.url}/readyz") == (200, "failed"), timeout=5)
    failed = [e for e in logs if e["event"] == "engine_failed"]
    assert len(failed) == 1 and failed[0]["error"].startswith("cannot run /nonexistent/weir-engine: ")
    assert "No such file" in failed[0]["error"]
