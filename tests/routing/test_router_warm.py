"""The router loads the difficulty classifier in the background as soon as a difficulty route exists,
so the first request it scores does not wait for torch and the encoder to load."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import ConfigError, parse_config
from gateway.router_basic import ModelTable
from gateway.runtime import Gateway
from gateway.transport import Transport
from routing.difficulty import DifficultyClassifier
from routing.router import Router
from routing.routes import Route
from tests.routing.difficulty_route import CONFIG, DIFFICULTY


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(thread name, head) of each request for a shipped classifier (a stand-in: loading is not
    under test)."""
    seen: list[tuple[str, str]] = []

    def default(head: str = "auto") -> object:
        seen.append((threading.current_thread().name, head))
        return SimpleNamespace(score=lambda prompt: 0.25, kind="encoder" if head == "auto" else head)

    monkeypatch.setattr(DifficultyClassifier, "default", staticmethod(default))
    return seen


async def test_a_difficulty_route_warms_the_classifier_off_the_event_loop(
    loads: list[tuple[str, str]],
) -> None:
    router = Router(ModelTable(parse_config(CONFIG, {})), [DIFFICULTY])
    assert loads == []  # constructed outside a running loop: nothing to schedule on yet
    transport = Transport()
    await router.start(transport)
    try:
        assert router._warming is not None
        await router._warming
        assert len(loads) == 1 and loads[0][0] != threading.main_thread().name
        assert loads[0][1] == "auto"  # the default: the encoder if it fits the budget here
        router.set_routes([DIFFICULTY])  # already warm: not loaded again
        assert len(loads) == 1
    finally:
        await router.stop()
        await transport.close()


async def test_no_difficulty_route_or_a_set_scorer_loads_nothing(loads: list[tuple[str, str]]) -> None:
    router = Router(
        ModelTable(parse_config(CONFIG, {})), [Route(name="plain", candidates=DIFFICULTY.candidates)]
    )
    transport = Transport()
    await router.start(transport)
    try:
        assert router._warming is None
        router.context.scorer = lambda prompt: 0.5
        router.set_routes([DIFFICULTY])
        assert router._warming is None and loads == []
        router.context.scorer = None
        router.set_routes([DIFFICULTY])  # a difficulty route added through the admin API
        assert router._warming is not None
        await router._warming
        assert len(loads) == 1
    finally:
        await router.stop()
        await transport.close()


async def test_the_configured_head_is_the_one_loaded(loads: list[tuple[str, str]]) -> None:
    config = parse_config(CONFIG + "difficulty_head: static\n", {})
    registry = CollectorRegistry()
    router = Router(
        ModelTable(config), [DIFFICULTY], registry=registry, difficulty_head=config.difficulty_head
    )
    assert registry.get_sample_value("weir_difficulty_head", {"head": "static"}) is None  # not loaded yet
    transport = Transport()
    await router.start(transport)
    try:
        assert router._warming is not None
        await router._warming
        assert [head for _, head in loads] == ["static"]
        # Each replica says which head it serves (with "auto" replicas on different CPUs can differ).
        assert registry.get_sample_value("weir_difficulty_head", {"head": "static"}) == 1
        assert router.context.score_difficulty("hello") == 0.25  # scoring asks for the same head
        assert [head for _, head in loads] == ["static", "static"]
    finally:
        await router.stop()
        await transport.close()


def test_an_unknown_head_in_the_config_is_rejected() -> None:
    with pytest.raises(ConfigError, match="difficulty_head"):
        parse_config(CONFIG + "difficulty_head: fastest\n", {})


async def test_the_gateway_is_not_ready_until_the_startup_classifier_has_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()

    def default(head: str = "auto") -> object:
        release.wait(10)
        return SimpleNamespace(score=lambda prompt: 0.25, kind="static")

    monkeypatch.setattr(DifficultyClassifier, "default", staticmethod(default))
    routes = (
        "routes:\n  - {name: auto, policy: difficulty, candidates: [{model: gpt-4o-mini}, {model: gpt-4o}]}\n"
    )
    gateway = Gateway(parse_config(CONFIG + routes, {}))
    await gateway.start()
    try:
        assert (
            gateway.router.scorer_loading and gateway.readiness == "starting"
        )  # a load balancer holds traffic back
        release.set()
        assert gateway.router._warming is not None
        await gateway.router._warming
        assert not gateway.router.scorer_loading and gateway.readiness == "ready"
    finally:
        release.set()
        await gateway.stop()


async def test_a_route_added_later_loads_without_leaving_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def default(head: str = "auto") -> object:
        release.wait(10)
        return SimpleNamespace(score=lambda prompt: 0.25, kind="encoder")

    monkeypatch.setattr(DifficultyClassifier, "default", staticmethod(default))
    gateway = Gateway(parse_config(CONFIG, {}))
    await gateway.start()
    try:
        assert gateway.readiness == "ready"
        gateway.router.set_routes([DIFFICULTY])  # through the admin API, on every replica at once
        assert gateway.router._warming is not None and not gateway.router._warming.done()
        assert gateway.readiness == "ready" and not gateway.router.scorer_loading
        release.set()
        await gateway.router._warming
    finally:
        release.set()
        await gateway.stop()
