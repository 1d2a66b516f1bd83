"""Docker Compose's variable interpolation, as the compose specification defines it, so the tests
can see the file exactly as `docker compose` will with a given environment (such as deploy/.env.example
filled in: `example_env`), and compose's secrets as deploy/new-secrets.sh makes them (`new_secrets`),
seen from a local process instead of a container (`at_secrets`)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.deploy.artefacts import DEPLOY
from tests.deploy.kustomize import parse_env_file

_VAR = re.compile(
    r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(KeyError):
    pass


def interpolate_str(value: str, env: Mapping[str, str]) -> str:
    def substitute(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg") or ""
        present = name in env
        empty = present and env[name] == ""
        if op in (":-", "-"):
            return arg if (not present or (op == ":-" and empty)) else env[name]
        if op in (":?", "?"):
            if not present or (op == ":?" and empty):
                raise MissingVariable(f"{name}: {arg}")
            return env[name]
        return env.get(name, "")

    return _VAR.sub(substitute, value)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return interpolate_str(value, env)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def variables(value: Any) -> dict[str, str | None]:
    """{name: operator} of every variable a tree references (None: plain `${NAME}`)."""
    found: dict[str, str | None] = {}
    if isinstance(value, str):
        for m in _VAR.finditer(value):
            name = m.group("name") or m.group("bare")
            if name:
                found.setdefault(name, m.group("op"))
    elif isinstance(value, list):
        for v in value:
            found.update({k: o for k, o in variables(v).items() if k not in found})
    elif isinstance(value, dict):
        for v in value.values():
            found.update({k: o for k, o in variables(v).items() if k not in found})
    return found


def example_env() -> dict[str, str]:
    """deploy/.env.example with every empty value filled in, as a user would."""
    env = parse_env_file((DEPLOY / ".env.example").read_text())
    return {k: v or f"test-{k.lower()}" for k, v in env.items()}


SECRETS_MOUNT = "/run/secrets/"  # where compose mounts a service's secrets in its container


def new_secrets(directory: Path) -> Path:
    """The secret files deploy/new-secrets.sh makes, made in `directory`."""
    subprocess.run(["sh", str(DEPLOY / "new-secrets.sh"), str(directory)], check=True, capture_output=True)
    return directory


def at_secrets(value: Any, directory: Path) -> Any:
    """`value` (a string, or a tree of them) with /run/secrets/NAME read as DIRECTORY/NAME."""
    if isinstance(value, str):
        return value.replace(SECRETS_MOUNT, f"{directory}/")
    if isinstance(value, list):
        return [at_secrets(v, directory) for v in value]
    if isinstance(value, dict):
        return {k: at_secrets(v, directory) for k, v in value.items()}
    return value
