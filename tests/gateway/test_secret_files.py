"""Secrets given as files (`NAME_FILE`, as Docker/Compose secrets mount them under /run/secrets): the
`weir` command reads `WEIR_*_FILE` at start, and the config's `${NAME}` falls back to `NAME_FILE`."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.config import ConfigError, interpolate, parse_config
from gateway.secret_files import export_secret_files
from gateway.vault import generate_key
from weir.cli import main

CONFIG = """
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: "${OPENAI_API_KEY:-}"}
models:
  - {name: gpt-4o-mini, backend: openai, model: gpt-4o-mini}
tenants:
  - {name: demo, api_keys: ["${WEIR_DEMO_KEY}"]}
"""


def secret(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_config_variable_comes_from_its_file_without_the_trailing_newline(tmp_path: Path) -> None:
    env = {
        "OPENAI_API_KEY_FILE": secret(tmp_path, "openai", "sk-vendor\n"),
        "WEIR_DEMO_KEY_FILE": secret(tmp_path, "demo", "sk-demo\r\n"),
    }
    config = parse_config(CONFIG, env)
    assert config.backend("openai").api_key == "sk-vendor"
    assert config.tenants is not None and config.tenants[0].api_keys == ["sk-demo"]


def test_an_empty_secret_file_takes_the_default_as_an_empty_variable_does(tmp_path: Path) -> None:
    env = {"V_FILE": secret(tmp_path, "v", "\n"), "W_FILE": secret(tmp_path, "w", "")}
    assert interpolate(["${V:-d}", "${W}"], env) == ["d", ""]


def test_a_missing_secret_file_names_the_key_the_variable_and_the_path(tmp_path: Path) -> None:
    env = {"WEIR_DEMO_KEY_FILE": str(tmp_path / "nonesuch")}
    with pytest.raises(ConfigError) as raised:
        parse_config(CONFIG, env)
    assert str(raised.value) == (
        f"tenants[0].api_keys[0]: WEIR_DEMO_KEY_FILE: the file {tmp_path / 'nonesuch'} does not exist"
    )


def test_a_variable_set_both_ways_is_refused(tmp_path: Path) -> None:
    env = {"WEIR_DEMO_KEY": "sk-a", "WEIR_DEMO_KEY_FILE": secret(tmp_path, "demo", "sk-b")}
    with pytest.raises(ConfigError, match="both WEIR_DEMO_KEY and WEIR_DEMO_KEY_FILE are set"):
        parse_config(CONFIG, env)


def test_export_sets_each_weir_variable_and_drops_its_file_variable(tmp_path: Path) -> None:
    env = {
        "WEIR_ADMIN_TOKEN_FILE": secret(tmp_path, "token", "wa-token\n"),
        "OPENAI_API_KEY_FILE": secret(tmp_path, "openai", "sk-vendor"),  # not Weir's: left to the config
        "PATH": "/bin",
    }
    assert export_secret_files(env) == ["WEIR_ADMIN_TOKEN"]
    assert env == {
        "WEIR_ADMIN_TOKEN": "wa-token",
        "OPENAI_API_KEY_FILE": env["OPENAI_API_KEY_FILE"],
        "PATH": "/bin",
    }
    # What a child process inherits exports nothing twice.
    assert export_secret_files(env) == []


def test_every_weir_command_reads_weir_file_variables_at_start(tmp_path: Path) -> None:
    config = secret(tmp_path, "weir.yaml", CONFIG)
    good = {
        "WEIR_DEMO_KEY_FILE": secret(tmp_path, "demo", "sk-demo\n"),
        "WEIR_MASTER_KEY_FILE": secret(tmp_path, "master", generate_key() + "\n"),
        "WEIR_DEMO_KEY": None,
        "WEIR_MASTER_KEY": None,
    }
    ok = CliRunner().invoke(main, ["config", "check", "--config", config], env=good)
    assert ok.exit_code == 0, ok.output
    assert "1 tenant" in ok.output
    # `config check` validates WEIR_MASTER_KEY as the gateway does: a malformed one in the file fails.
    bad_key = {**good, "WEIR_MASTER_KEY_FILE": secret(tmp_path, "bad", "not-a-key\n")}
    refused = CliRunner().invoke(main, ["config", "check", "--config", config], env=bad_key)
    assert refused.exit_code == 1 and "WEIR_MASTER_KEY" in refused.output
    # A file that is not there: one clear line, exit status 1, before the command runs.
    missing = {**good, "WEIR_ADMIN_TOKEN_FILE": str(tmp_path / "nonesuch"), "WEIR_ADMIN_TOKEN": None}
    failed = CliRunner().invoke(main, ["config", "check", "--config", config], env=missing)
    assert failed.exit_code == 1
    assert failed.output == f"Error: WEIR_ADMIN_TOKEN_FILE: the file {tmp_path / 'nonesuch'} does not exist\n"
