"""Shared loaders for the deployment tests: nothing here builds an image or starts a container (no
Docker engine or cluster runs on the test machines); the artefacts are parsed, rendered and checked."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Environment variable names that carry secrets: their values must come from outside the artefacts.
SECRET_NAME = re.compile(r"(PASSWORD|TOKEN|SECRET|API_KEY|_KEY$|DATABASE_URL|REDIS_URL)", re.IGNORECASE)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return load_yaml(DEPLOY / "compose.yaml")
