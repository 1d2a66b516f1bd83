"""`weir engine serve --max-queued N` with the rest of routing: two tiny engine replicas behind a
`prefix_affinity` route, a hedged route, a `lowest_latency` route and a resumed stream, each with an
engine that refuses because it is full. The real engine servers run the tiny random Llama in this
process (`tests/routing/test_engine_queue_limit.py` shows the engine side alone)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from gateway.config import ConfigError, parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway, running_gateway
from tests.fixtures.waiting import wait_for
from tests.routing.engine_candidate import BS, ECHO, HI, busy, failing_steps, refused, tiny_engine
from tests.routing.routed import route_header, runtime, settled

FAST = "retry: {attempts: 2, backoff: 0.02}, breaker: {failures: 1, cooldown: 30}, probe_interval: null"


def two_engines_config(a: int, b: int, vendor: FakeOpenAI, routes: str) -> str:
    return f"""
backends:
  - {{name: local-a, type: engine, url: "http://127.0.0.1:{a}"}}
  - {{name: local-b, type: engine, url: "http://127.0.0.1:{b}"}}
  - {{name: vendor, type: openai, base_url: "{vendor.base_url}", api_key: "{vendor.api_key}"}}
models:
  - {{name: small-a, backend: local-a, model: tiny, price: {{input: 1.0, output: 2.0}}}}
  - {{name: small-b, backend: local-b, model: tiny, price: {{input: 1.0, output: 2.0}}}}
  - {{name: gpt-4o-mini, backend: vendor, price: {{input: 0.15, output: 0.60}}}}
routes:
{routes}"""


ROUTES = f"""\
  - {{name: smol, policy: prefix_affinity, candidates: [{{model: small-a}}, {{model: small-b}}], {FAST}}}
  - {{name: fast, policy: lowest_latency, candidates: [{{model: small-a}}, {{model: small-b}}], {FAST}}}
  - {{name: hedged, hedge: {{delay: 0.3}}, candidates: [{{model: small-a}}, {{model: small-b}}], {FAST}}}
"""


def one_at_a_time(llms: Iterable[Any]) -> None:
    """The engines step one at a time: the model's attention metadata is a module global, which two
    engines in one process (never so in production, where each is its own process) would share."""
    lock = threading.Lock()
    for llm in llms:

        def step(real: Callable[[], Any] = llm.step) -> Any:
            with lock:
                return real()

        llm.step = step


@contextmanager
def replicas(
    vendor: FakeOpenAI, routes: str = ROUTES
) -> Iterator[tuple[RunningGateway, list[tuple[int, Any]]]]:
    """Two tiny engines (one batch slot, no queue: one long stream fills each) and a gateway."""
    with ExitStack() as stack:
        engines = [stack.enter_context(tiny_engine(max_num_seqs=1, max_queued=0)) for _ in range(2)]
        one_at_a_time(llm for _, llm in engines)
        text = two_engines_config(engines[0][0], engines[1][0], vendor, routes)
        gateway = stack.enter_context(running_gateway(parse_config(text, {})))
        yield gateway, engines


def attempts_metric(gateway: RunningGateway, route: str, candidate: str, outcome: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics").text
    want = f'weir_route_attempts_total{{candidate="{candidate}",outcome="{outcome}",route="{route}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))


def test_prefix_affinity_sends_past_a_full_preferred_replica_at_once(fake_openai: FakeOpenAI) -> None:
    """The preferred replica refuses (full): the other one answers at once. `affinity=miss` and the hit
    counters count where it was served (documented: hit = served by the preferred replica), `tried`
    says the preferred one refused; the engine counts the refusal; the breaker stays closed, so the prefix returns home once there is room."""
    with replicas(fake_openai) as (gateway, engines):
        client = gateway.openai()
        raw = client.chat.completions.with_raw_response.create(model="smol", messages=HI, max_tokens=4)  # type: ignore[arg-type]
        home = route_header(raw)["candidate"]
        other = "small-b" if home == "small-a" else "small-a"
        port, llm = engines[0] if home == "small-a" else engines[1]
        with busy(port, llm, 1):
            started = time.monotonic()
            raw = client.chat.completions.with_raw_response.create(model="smol", messages=HI, max_tokens=4)  # type: ignore[arg-type]
            assert time.monotonic() - started < 0.9  # not the engine's retry-after of 1 s
            header = route_header(raw)
            assert header["candidate"] == other and header["tried"] == f"{home}:429,{other}:ok"
            assert header["affinity"] == "miss" and header["affinity_hit_rate"] == "0.500"
            assert refused(port) == 1
        assert attempts_metric(gateway, "smol", home, "429") == 1
        assert attempts_metric(gateway, "smol", other, "ok") == 1
        wait_for(lambda: not llm.has_unfinished_requests(), timeout=5)
        raw = client.chat.completions.with_raw_response.create(model="smol", messages=HI, max_tokens=4)  # type: ignore[arg-type]
        assert route_header(raw)["candidate"] == home and "tried" not in route_header(raw)


def test_a_hedged_route_and_a_lowest_latency_route_past_a_full_engine(fake_openai: FakeOpenAI) -> None:
    """Hedged: the primary's refusal moves to the next candidate at once, unhedged (nothing after it
    to hedge with), long before the hedge delay. Lowest latency: the refusal adds nothing to the
    engine's speed estimates; as any 429 (documented) it marks the unmeasured engine as failed."""
    with replicas(fake_openai) as (gateway, engines):
        client = gateway.openai()
        (port_a, llm_a), _ = engines
        with busy(port_a, llm_a, 1):
            started = time.monotonic()
            raw = client.chat.completions.with_raw_response.create(model="hedged", messages=HI, max_tokens=4)  # type: ignore[arg-type]
            assert time.monotonic() - started < 0.3  # the hedge delay
            assert route_header(raw)["tried"] == "small-a:429,small-b:ok"
            raw = client.chat.completions.with_raw_response.create(model="fast", messages=HI, max_tokens=4)  # type: ignore[arg-type]
            assert route_header(raw)["candidate"] == "small-b"
        text = httpx.get(f"{gateway.url}/metrics").text
        hedges = [line for line in text.splitlines() if line.startswith("weir_route_hedges_total{")]
        assert not any('result="started"' in line for line in hedges)
        stats = runtime(gateway).router.context.stats.get("local-a", "tiny")
        assert stats.samples == 0 and stats.latency_s is None and stats.ttft_s is None
        assert stats.failed_at is not None


def test_a_resumed_stream_passes_over_a_full_engine(fake_openai: FakeOpenAI) -> None:
    """Engine A dies mid-stream; its continuation's next candidate, engine B, is full: the vendor
    continues the answer, and the ledger holds each attempt."""
    routes = f"  - {{name: r, candidates: [{{model: small-a}}], fallbacks: [small-b, gpt-4o-mini], {FAST}}}\n"
    with replicas(fake_openai, routes) as (gateway, engines):
        (_, llm_a), (port_b, llm_b) = engines
        with busy(port_b, llm_b, 1), failing_steps(llm_a, 4):
            stream: Any = gateway.openai().chat.completions.create(
                model="r",
                messages=HI,  # type: ignore[arg-type]
                stream=True,
                max_tokens=12,
                temperature=0,
                logit_bias=BS,
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == "BBBB" + ECHO
        settled(gateway, 3)
        got = sorted(gateway.sink.events, key=lambda e: e.attempt)
        assert [(e.backend, e.status) for e in got] == [("local-a", 502), ("local-b", 429), ("vendor", 200)]
        assert got[-1].routing is not None and "small-a:cut,small-b:429" in got[-1].routing


@pytest.mark.parametrize(
    "backend",
    [
        'type: engine, url: "http://127.0.0.1:9"',
        "type: engine, model: tiny, command: [stand-in]",
        'type: openai, base_url: "http://127.0.0.1:9", api_key: k',
    ],
    ids=["url", "command", "openai"],
)
def test_engine_args_where_weir_starts_no_engine_are_a_config_error(backend: str) -> None:
    """`args` go only on the `weir engine serve` command line Weir itself starts: on an engine it only
    connects to, one started by a `command` of its own, or another backend type, they reached nothing,
    and `--max-queued` there silently limited no queue."""
    text = f"""
backends:
  - {{name: local, {backend}, args: ["--max-queued", "16"]}}
models:
  - {{name: small, backend: local, model: tiny}}
"""
    with pytest.raises(ConfigError, match="args"):
        parse_config(text, {})
