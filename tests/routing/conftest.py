"""Fixtures for the routing tests: the shipped classifier (loaded once), the tiny MMLU slice, and a
routed gateway in front of the fake vendors (one per module; a module names its routes by overriding
`gateway_routes`, adds a raw backend of its own by overriding `raw_script`, or changes more of the
config by overriding `gateway_config` and `gateway_env`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from routing.difficulty import DifficultyClassifier
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway, fakes_env, gateway_on_fakes
from tests.reliability.raw_backend import RawBackend
from tests.routing.routed import ROUTES, RawScript, fresh, raw_config_text, routed_config_text

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def classifier() -> DifficultyClassifier:
    # The encoder head, named: "auto" would pick by this machine's speed, and the tests pin v4.
    return DifficultyClassifier.default("encoder")


@pytest.fixture(scope="module")
def vendor_env(fake_vendors: FakeVendors) -> dict[str, str]:
    """The fake vendors' URLs and keys, as the variables a config of the gateway tests reads."""
    return fakes_env(*fake_vendors)


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    """The `routes:` section of `_routed`: the shared ones (tests.routing.routed.ROUTES) unless the
    module overrides this fixture with its own."""
    return ROUTES


@pytest.fixture(scope="module")
def raw_script() -> RawScript | None:
    """What the module's raw backend (tests.reliability.raw_backend, the model `raw-model` of
    tests.routing.routed.raw_config_text) answers: no such backend unless the module overrides this
    fixture with a script of its own."""
    return None


@pytest.fixture(scope="module")
def _raw_backend(raw_script: RawScript | None) -> Iterator[RawBackend | None]:
    """The module's raw backend, running `raw_script` (none without it)."""
    if raw_script is None:
        yield None
        return
    with RawBackend(raw_script) as backend:
        yield backend


@pytest.fixture(scope="module")
def gateway_config(gateway_routes: str, raw_script: RawScript | None) -> str:
    """The config of `_routed`: the gateway tests' config with `gateway_routes` (and the raw backend
    where the module has a `raw_script`), unless the module overrides this fixture (with backends,
    models or tenants of its own)."""
    return routed_config_text(gateway_routes) if raw_script is None else raw_config_text(gateway_routes)


@pytest.fixture(scope="module")
def gateway_env(_raw_backend: RawBackend | None) -> dict[str, str]:
    """What `_routed`'s config reads besides the fakes' URLs and keys (`fakes_env`): the raw backend's
    URL where there is one, else nothing, unless the module overrides this fixture."""
    return {} if _raw_backend is None else {"RAW_URL": _raw_backend.url}


@pytest.fixture(scope="module")
def _routed(
    gateway_config: str, gateway_env: dict[str, str], fake_vendors: FakeVendors
) -> Iterator[RunningGateway]:
    """The module's routed gateway: started once, it outlives the per-test resets of the fakes."""
    with gateway_on_fakes(gateway_config, fake_vendors, gateway_env) as gateway:
        yield gateway


@pytest.fixture
def raw(raw_script: RawScript | None) -> RawScript | None:
    """The module's `raw_script`, put back as the test starts (`reset`)."""
    if raw_script is not None:
        raw_script.reset()
    return raw_script


@pytest.fixture
def gateway(_routed: RunningGateway, raw: RawScript | None, fresh_fakes: None) -> RunningGateway:
    """The routed gateway with fresh fakes (and raw script), closed breakers and an empty ledger."""
    return fresh(_routed)
