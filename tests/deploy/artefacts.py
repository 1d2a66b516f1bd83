"""Where the deployment artefacts are and how the deployment tests read them: `ROOT`, `DEPLOY`,
`load_yaml`, and `SECRET_NAME` (the environment variable names that carry secrets)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Environment variable names that carry secrets: their values must come from outside the artefacts.
SECRET_NAME = re.compile(r"(PASSWORD|TOKEN|SECRET|API_KEY|_KEY$|DATABASE_URL|REDIS_URL)", re.IGNORECASE)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
