"""A router in this process over two models (`small`, `big`) and the routes, requests and usage events
to drive it, for the tests of what routing keeps per route (tests/routing/test_routing_state_bounded.py,
test_late_route_events.py)."""

from __future__ import annotations

import random
from typing import Any

import msgspec

from gateway.accounting.events import UsageEvent
from gateway.auth import Principal
from gateway.config import parse_config
from gateway.router_basic import ModelTable
from gateway.types import ChatRequest
from gateway.usage import Usage
from routing.plan import Features, features
from routing.router import Router
from routing.routes import Candidate, Route
from tests.control.events import usage_event

# Two models on backends nothing listens on (port 9): for routing decisions, not answers.
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
  - {name: other, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
models:
  - {name: small, backend: openai, price: {input: 0.15, output: 0.6}}
  - {name: big, backend: other, price: {input: 3, output: 15}}
"""
ACME = Principal(tenant_id="t1", tenant_name="acme", key_id="k1")


def router(*routes: Route) -> Router:
    """A router over CONFIG's models with these routes, its randomness seeded and its difficulty scores
    random (seeded) instead of the shipped head's."""
    r = Router(ModelTable(parse_config(CONFIG, {})), routes)
    r.context.rng = random.Random(0)
    rng = random.Random(1)
    r.context.scorer = lambda prompt: rng.random()  # the shipped head's load is not under test
    r.context.serving = "static"
    return r


def difficulty(name: str, **fields: Any) -> Route:
    """A difficulty route from `small` to `big`, 30% strong, unprobed; `fields` set the rest."""
    return Route(
        name=name,
        policy="difficulty",
        candidates=[Candidate(model="small"), Candidate(model="big")],
        strong_share=0.3,
        probe_interval=None,
        **fields,
    )


def affinity(name: str) -> Route:
    """A prefix-affinity route over `small` and `big`, unprobed."""
    return Route(
        name=name,
        policy="prefix_affinity",
        candidates=[Candidate(model="small"), Candidate(model="big")],
        probe_interval=None,
    )


def ask(text: str, principal: Principal = ACME) -> Features:
    """The routing features of a chat request to route `r` with this one user message."""
    request = msgspec.convert({"model": "r", "messages": [{"role": "user", "content": text}]}, ChatRequest)
    return features(request, principal.tenant_name, principal.key_id)


def routed_event(route: str, note: str) -> UsageEvent:
    """A usage event of `small` on `route`, its routing note `note` (as the router writes it)."""
    return usage_event(
        "r",
        tenant_id=None,
        key_id=None,
        route=route,
        backend="openai",
        model="small",
        usage=Usage(input_tokens=80, cached_input_tokens=20, output_tokens=5),
        latency_ms=10.0,
        routing=note,
        event_id="e",
    )
