"""Shared fixtures for the deployment tests: nothing here builds an image or starts a container (no
Docker engine or cluster runs on the test machines); the artefacts are parsed, rendered and checked.
The loaders themselves are in tests/deploy/artefacts.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.artefacts import DEPLOY, load_yaml


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return load_yaml(DEPLOY / "compose.yaml")
