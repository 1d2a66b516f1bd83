"""Whether a command line written in a deployment artefact is one the real `weir` CLI accepts."""

from __future__ import annotations

import click


def assert_cli_accepts(argv: list[str]) -> None:
    """`argv` names a real `weir` subcommand and only options it declares."""
    from weir.cli import main

    assert argv[0] == "weir"
    command: click.Command = main
    rest = argv[1:]
    while isinstance(command, click.Group):
        sub = command.get_command(click.Context(command), rest[0])
        assert sub is not None, f"`weir` has no subcommand path {argv[1 : len(argv) - len(rest) + 1]}"
        command, rest = sub, rest[1:]
    declared = {opt for param in command.params for opt in param.opts}
    used = {arg for arg in rest if arg.startswith("--")}
    assert used <= declared, f"{' '.join(argv)}: unknown options {sorted(used - declared)}"
