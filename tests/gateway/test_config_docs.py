"""docs/configuration.md stays the reference of the config structs (gateway/config.py): every key of
every section is in its section's table, every default the tables state where the code has a value
of its own is the code's, and every YAML example loads with the real loader. A key added to the code
without a row, or a default changed on one side only, fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from gateway import config as C
from gateway.config import parse_config

DOC = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()

# Each section's table documents these structs' fields (a nested struct's as `parent.key`).
SECTIONS: dict[str, list[tuple[type[msgspec.Struct], str]]] = {
    "Top-level keys": [(C.Config, "")],
    "`backends[]`": [(C.Backend, ""), (C.Timeouts, "timeouts.")],
    "`models[]`": [(C.Model, "")],
    "`tenants[]`": [(C.Tenant, "")],
    "`limits`": [(C.Limits, "")],
    "`server`": [(C.Server, "")],
}


def table(section: str) -> dict[str, str]:
    """key -> its default cell, from the table under `## {section}`. A row may document two keys at
    once (`model`, `port` | none, 8000)."""
    body = DOC.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for keys, cell in re.findall(r"^\| ((?:`[^`]+`(?:, )?)+) \| ([^|]*) \|", body, re.M):
        names = re.findall(r"`([^`]+)`", keys)
        rows.update(zip(names, cell.strip().split(", ") if len(names) > 1 else [cell.strip()], strict=True))
    return rows


def default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    return field.default_factory() if field.default_factory is not msgspec.NODEFAULT else msgspec.NODEFAULT


def fields(section: str) -> dict[str, Any]:
    """key -> the code's default (msgspec.NODEFAULT: required)."""
    return {
        prefix + f.name: default(f)
        for struct, prefix in SECTIONS[section]
        for f in msgspec.structs.fields(struct)
        # A nested struct's own row is its keys' rows (`timeouts.connect`, ...).
        if not (prefix == "" and f.name == "timeouts" and struct is C.Backend)
    }


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_config_key_has_a_row_in_its_section(section: str) -> None:
    documented, code = table(section), fields(section)
    assert set(code) <= set(documented), f"{section}: no row for {sorted(set(code) - set(documented))}"
    assert set(documented) <= set(code), (
        f"{section}: rows for keys the code lacks: {set(documented) - set(code)}"
    )


def stated(cell: str) -> Any:
    """The value a default cell states, or ... when it describes one in words (`all 0`, `limits.x`)."""
    if cell == "none":
        return None
    if cell == "required":
        return msgspec.NODEFAULT
    if re.fullmatch(r"-?[\d.]+", cell):
        return float(cell)
    if mib := re.fullmatch(r"(\d+) MiB", cell):
        return int(mib.group(1)) * 1024 * 1024
    literal = re.fullmatch(r"`([^`]*)`", cell)
    if literal and not literal.group(1).startswith("limits."):
        return literal.group(1)  # as written: `2023-06-01` is a string, not YAML's date
    return ...


@pytest.mark.parametrize("section", list(SECTIONS))
def test_the_defaults_the_tables_state_are_the_codes(section: str) -> None:
    documented = table(section)
    for key, code in fields(section).items():
        value = stated(documented[key])
        if value is ... or isinstance(code, msgspec.Struct):
            continue  # said in words; a section of its own, documented key by key
        if code is None and value is not msgspec.NODEFAULT:
            continue  # None in the code: the row says what unset means (the limit's value, port 8000)
        if isinstance(value, str) and not isinstance(code, str):
            value = yaml.safe_load(value)  # `[]`, `{}`, `true`
        assert value == code, f"{section} `{key}`: the doc says {documented[key]}, the code {code!r}"


def yaml_examples() -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", DOC, re.M | re.S)


def test_every_yaml_example_loads_with_the_real_loader() -> None:
    """The full example, and the fragments as a user pastes them into one: a backend list item under
    `backends:`, a top-level key as it is."""
    examples = yaml_examples()
    assert len(examples) >= 4
    env = {name: "x" for text in examples for name in re.findall(r"\$\{(\w+)\}", text)}
    for text in examples:
        if text.startswith("  - "):  # a `backends[]` item
            text = "backends:\n" + text
        parse_config(text, env)
