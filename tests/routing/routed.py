"""A real gateway with routes (the gateway tests' config plus a `routes:` section) in front of the fakes."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Protocol

from gateway.config import parse_config
from gateway.runtime import Gateway
from gateway.state import Limit, MemoryState
from routing.execute import SpendCap
from routing.plan import Plan
from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway, full_config_text, gateway_on_fakes, running_gateway
from tests.reliability.raw_backend import Send, Sleep

# Small waits everywhere: the behaviour is the same as with production settings, only faster.
FAST = "retry: {attempts: 2, backoff: 0.02, max_backoff: 0.1, max_retry_after: 1.0}, "
FAST += "breaker: {failures: 3, cooldown: 0.5}, probe_interval: null"
ROUTES = f"""\
routes:
  - {{name: resilient, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: no-resume, resume: false, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: anthropic-first, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: impatient-route, ttft_timeout: 0.3, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: hedged, hedge: {{delay: 0.15}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
  - {{name: hedged-sonnet, hedge: {{delay: 0.15}}, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: hedged-capped, hedge: {{delay: 0.15, max_spend_usd_per_hour: 0.0}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
  - {{name: chain, candidates: [{{model: dead-model}}], fallbacks: [gemini-flash], {FAST}}}
  - {{name: counted, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], fallbacks: [gemini-flash], {FAST}}}
  - {{name: recovering, candidates: [{{model: deepseek-chat}}, {{model: claude-sonnet}}], retry: {{attempts: 2, backoff: 0.02, max_backoff: 0.1}}, breaker: {{failures: 3, cooldown: 2.0}}, probe_interval: null}}
"""


def routed_config_text(routes: str = ROUTES) -> str:
    return full_config_text() + routes


# A backend of a test's own raw HTTP server (tests.reliability.raw_backend) at ${RAW_URL}, and its
# model `raw-model`, beside the fakes: for answers no fake vendor gives (scripted bytes, in-band errors).
RAW_BACKEND = """\
  - {name: raw, type: openai, base_url: "${RAW_URL}", api_key: unused}
"""
RAW_MODEL = """\
  - {name: raw-model, backend: raw, model: gpt-4o-mini, price: {input: 0.15, output: 0.60}}
"""


def raw_config_text(routes: str) -> str:
    """`routed_config_text(routes)` with the raw backend and its model."""
    text = routed_config_text(routes)
    return text.replace("backends:\n", "backends:\n" + RAW_BACKEND, 1).replace(
        "models:", "models:\n" + RAW_MODEL.rstrip("\n"), 1
    )


class RawScript(Protocol):
    """What a module's raw backend answers (a `tests.reliability.raw_backend.Script`), kept for the
    module's gateway, and put back as each test starts (`reset`)."""

    def __call__(self, send: Send, sleep: Sleep) -> None: ...

    def reset(self) -> None: ...


@contextmanager
def routed_gateway(vendors: FakeVendors, routes: str = ROUTES) -> Iterator[RunningGateway]:
    with gateway_on_fakes(routed_config_text(routes), vendors) as gateway:
        yield gateway


# Two engine replicas of one small model: `smol-a` on the fake OpenAI, `smol-b` on the fake DeepSeek.
ENGINE_REPLICAS = """\
backends:
  - {name: replica-a, type: engine, url: "${A_URL}", api_key: "${A_KEY}"}
  - {name: replica-b, type: engine, url: "${B_URL}", api_key: "${B_KEY}"}
models:
  - {name: smol-a, backend: replica-a, model: gpt-4o-mini}
  - {name: smol-b, backend: replica-b, model: deepseek-chat}
"""


# A vendor beside the replicas (`engine_replicas(..., vendor=)`): its model `claude-sonnet`.
VENDOR_BACKEND = """\
  - {name: vendor, type: anthropic, base_url: "${V_URL}", api_key: "${V_KEY}"}
"""
VENDOR_MODEL = """\
  - {name: claude-sonnet, backend: vendor, model: claude-sonnet-4-5}
"""


@contextmanager
def engine_replicas(
    a: FakeOpenAI, b: FakeOpenAI, routes: str, vendor: FakeAnthropic | None = None
) -> Iterator[RunningGateway]:
    """A gateway in front of `ENGINE_REPLICAS` (`smol-a` on `a`, `smol-b` on `b`) with `routes`, and
    with `vendor`, the model `claude-sonnet` on that vendor (a fallback that is no replica)."""
    env = {"A_URL": a.base_url, "A_KEY": a.api_key, "B_URL": b.base_url, "B_KEY": b.api_key}
    config = ENGINE_REPLICAS
    if vendor is not None:
        env |= {"V_URL": vendor.base_url, "V_KEY": vendor.api_key}
        config = config.replace("models:\n", VENDOR_BACKEND + "models:\n", 1) + VENDOR_MODEL
    with running_gateway(parse_config(config + routes, env)) as gateway:
        yield gateway


def runtime(gateway: RunningGateway) -> Gateway:
    return gateway.app.state.gateway  # type: ignore[attr-defined]


def route_header(raw: object) -> dict[str, str]:
    """The x-weir-route header as a dict."""
    value = raw.headers["x-weir-route"]  # type: ignore[attr-defined]
    return dict(part.split("=", 1) for part in value.split("; "))


async def sent(planning: Awaitable[Plan]) -> Plan:
    """A router's plan for a request that then went upstream and its first candidate answered: what its
    policy learnt from it is kept (`Plan.commit`, which the executor calls once the first attempt is
    admitted and sent) and what it counts by where the request was served is counted (`Plan.serve`)."""
    plan = await planning
    plan.commit()
    if plan.choices:
        plan.serve(plan.choices[0])
    return plan


def counted_micro_usd(cap: SpendCap, tenant: str, route: str, expected: int, tolerance: int) -> bool:
    """Whether the cap's window holds `expected` micro-dollars for `tenant` on `route`, give or take `tolerance`
    (each call's cost is rounded once): a zero-cost probe fits under a limit just above it and not under
    one just below it."""
    state = cap.state
    assert isinstance(state, MemoryState)
    key = cap.key(tenant, route)
    fits = state.admit_now([Limit(key, expected + tolerance, 0, window_s=3600)]).allowed
    return fits and not state.admit_now([Limit(key, expected - tolerance - 1, 0, window_s=3600)]).allowed


def ledger(gateway: RunningGateway) -> list[tuple[str, int]]:
    """(backend, status) of every attempt's usage event, in attempt order."""
    return [(e.backend, e.status) for e in sorted(gateway.sink.events, key=lambda e: e.attempt)]


def attempts(gateway: RunningGateway) -> list[tuple[str, bool]]:
    """(backend, ok) of every attempt's usage event, in attempt order."""
    return [(e.backend, e.ok) for e in sorted(gateway.sink.events, key=lambda e: e.attempt)]


def fallbacks(gateway: RunningGateway) -> list[bool]:
    """Each attempt's usage event's `fallback` flag, in attempt order."""
    return [e.fallback for e in sorted(gateway.sink.events, key=lambda e: e.attempt)]


def settled(gateway: RunningGateway, count: int) -> None:
    """Usage events of a cancelled, cut or closed attempt are recorded as it unwinds: wait for them."""
    deadline = time.monotonic() + 5
    while len(gateway.sink.events) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def fresh(gateway: RunningGateway) -> RunningGateway:
    """The routed gateway with closed breakers (routes' latency breakers too) and an empty ledger."""
    runtime(gateway).router.breakers.breakers.clear()
    runtime(gateway).router.breakers.latency.clear()
    gateway.sink.events.clear()
    return gateway
