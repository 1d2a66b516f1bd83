"""Docker Compose's variable interpolation, as the compose specification defines it, so the tests
can see the file exactly as `docker compose` will with a given environment (such as deploy/.env.example
filled in: `example_env`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
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
