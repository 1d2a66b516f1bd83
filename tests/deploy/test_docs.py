"""docs/deploy.md stays true to the repository: every file it names exists, every `weir` command it
shows is one the CLI accepts, and every alert it lists is defined."""

from __future__ import annotations

import re

from tests.deploy.artefacts import ROOT
from tests.deploy.metrics import rules
from tests.deploy.weir_cli import assert_cli_accepts

DOC = (ROOT / "docs" / "deploy.md").read_text()
USER_CREATED = {"deploy/.env", "deploy/k8s/secrets.env"}  # the user makes these from the examples


def test_every_file_the_doc_names_exists() -> None:
    paths = set(re.findall(r"(?<![\w/.-])((?:deploy|tests/deploy|docs|benchmarks)/[\w./-]*\w/?)", DOC))
    paths -= {p for p in paths if p.startswith("deploy/weir-")}  # `kubectl ... deploy/weir-gateway`
    assert {"deploy/compose.yaml", "deploy/k8s-examples/vllm/", "deploy/docker/engine.Dockerfile"} <= paths
    # deploy/secrets/ is made by deploy/new-secrets.sh
    for path in {p for p in paths - USER_CREATED if not p.startswith("deploy/secrets/")}:
        assert (ROOT / path).exists(), f"docs/deploy.md names {path}, which does not exist"


def test_every_weir_command_in_the_doc_is_accepted_by_the_cli() -> None:
    # `weir GROUP [SUBCOMMAND]`: the command path; the doc shows no options.
    commands = set(
        re.findall(r"(?:^|`|\s)(weir (?:serve|config|db|engine|models|router)(?: [a-z][a-z-]*)?)", DOC)
    )
    assert {
        "weir serve",
        "weir config check",
        "weir db upgrade",
        "weir db current",
        "weir db downgrade",
    } <= commands
    for command in commands:
        assert_cli_accepts(command.split())


def test_every_alert_in_the_doc_is_defined() -> None:
    defined = {rule["alert"] for rule in rules() if "alert" in rule}
    named = set(re.findall(r"`(Weir[A-Za-z]+)`", DOC))
    assert named and named <= defined, named - defined
    assert defined <= named, f"alerts missing from the doc's table: {defined - named}"
