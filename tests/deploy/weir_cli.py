"""Whether a command line written in a deployment artefact or a doc is one the real `weir` CLI accepts."""

from __future__ import annotations

import click


def assert_cli_accepts(argv: list[str]) -> None:
    """`argv` names a real `weir` subcommand, only options it declares and no more positional
    arguments than it takes. Values are not checked: docs write placeholders (`NAME`, `Q`)."""
    from weir.cli import main

    assert argv[0] == "weir"
    command: click.Command = main
    rest = argv[1:]
    while isinstance(command, click.Group):
        if not rest:
            return  # `weir router heads ...`: the group, named as a whole
        sub = command.get_command(click.Context(command), rest[0])
        assert sub is not None, f"`weir` has no subcommand path {argv[1 : len(argv) - len(rest) + 1]}"
        command, rest = sub, rest[1:]
    options = {
        opt: param
        for param in command.get_params(click.Context(command))
        if isinstance(param, click.Option)
        for opt in param.opts
    }
    arguments = [param for param in command.params if isinstance(param, click.Argument)]
    positional: list[str] = []
    words = iter(rest)
    for word in words:
        if not word.startswith("-") or word == "-":
            positional.append(word)
            continue
        name, has_value = word.split("=", 1)[0], "=" in word
        assert name in options, f"{' '.join(argv)}: unknown option {name}"
        if not options[name].is_flag and not has_value:
            next(words, None)  # the option's value, whatever the doc writes for it
    takes = float("inf") if any(a.nargs == -1 for a in arguments) else sum(a.nargs for a in arguments)
    assert len(positional) <= takes, (
        f"{' '.join(argv)}: {positional} are more arguments than `{command.name}` takes ({int(takes)})"
    )
