"""Fixtures for the routing tests: the shipped classifier (loaded once), the tiny MMLU slice, and a
routed gateway in front of the fake vendors (one per module; a module names its routes by overriding
`gateway_routes`, or changes more of the config by overriding `gateway_config` and `gateway_env`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import parse_config
from routing.difficulty import DifficultyClassifier
from tests.control.conftest import redis_prefix  # noqa: F401  (a fixture shared with tests/control)
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.gateway.conftest import RunningGateway, fakes_env, running_gateway
from tests.routing.routed import ROUTES, fresh, routed_config_text

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def classifier() -> DifficultyClassifier:
    # The encoder head, named: "auto" would pick by this machine's speed, and the tests pin v4.
    return DifficultyClassifier.default("encoder")


@pytest.fixture
def fresh_fakes(
    fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini, fake_deepseek: FakeOpenAI
) -> None:
    """Every fake vendor reset for this test (their own fixtures do it)."""


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    """The `routes:` section of `_routed`: the shared ones (tests.routing.routed.ROUTES) unless the
    module overrides this fixture with its own."""
    return ROUTES


@pytest.fixture(scope="module")
def gateway_config(gateway_routes: str) -> str:
    """The config of `_routed`: the gateway tests' config with `gateway_routes`, unless the module
    overrides this fixture (with backends, models or tenants of its own)."""
    return routed_config_text(gateway_routes)


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    """What `_routed`'s config reads besides the fakes' URLs and keys (`fakes_env`): nothing, unless
    the module overrides this fixture."""
    return {}


@pytest.fixture(scope="module")
def _routed(
    gateway_config: str,
    gateway_env: dict[str, str],
    _fake_openai_server: FakeOpenAI,
    _fake_anthropic_server: FakeAnthropic,
    _fake_gemini_server: FakeGemini,
    _fake_deepseek_server: FakeOpenAI,
) -> Iterator[RunningGateway]:
    """The module's routed gateway: started once, it outlives the per-test resets of the fakes."""
    env = fakes_env(_fake_openai_server, _fake_anthropic_server, _fake_gemini_server, _fake_deepseek_server)
    with running_gateway(parse_config(gateway_config, env | gateway_env)) as gateway:
        yield gateway


@pytest.fixture
def gateway(_routed: RunningGateway, fresh_fakes: None) -> RunningGateway:
    """The routed gateway with fresh fakes, closed breakers and an empty ledger."""
    return fresh(_routed)
