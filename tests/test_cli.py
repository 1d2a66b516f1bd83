import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tests.deploy.weir_cli import assert_cli_accepts
from weir import __version__
from weir.cli import main


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_help_lists_commands_without_error() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: main" in result.output or "Usage: weir" in result.output


ROOT = Path(__file__).resolve().parents[1]
# The pages a user follows; docs/benchmarks.md is a record of past runs, with the flags of their day.
DOCS = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks.md")]


def code(text: str) -> Iterator[str]:
    """What a reader runs or types: each code block's lines (continuations joined, a trailing comment
    left out but its `code spans` kept) and the prose's code spans (which may wrap a line)."""
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command, _, comment = line.partition(" #")
            yield command
            yield from re.findall(r"`([^`]+)`", comment)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    yield from (span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose))


def weir_commands(text: str) -> Iterator[list[str]]:
    """`weir GROUP ...` up to the end of the shell command; `pull/list/rm` stands for each of them."""
    groups = "|".join(main.list_commands(click.Context(main)))
    for snippet in code(text):
        # `-n weir`: kubectl's namespace, not the CLI
        for match in re.finditer(rf"(?:^|[\s($])(?<!-n )weir ((?:{groups})\b[^;|&)`]*)", snippet):
            words = [w.strip("[]") for w in shlex.split(match.group(1)) if w not in {"...", "$"}]
            yield from (["weir", *each] for each in alternatives(words))


def alternatives(words: list[str]) -> list[list[str]]:
    """`models pull/list/rm` -> `models pull`, `models list`, `models rm` (a subcommand word only)."""
    for at, word in enumerate(words[:3]):
        if re.fullmatch(r"[a-z-]+(/[a-z-]+)+", word):
            return [[*words[:at], each, *words[at + 1 :]] for each in word.split("/")]
    return [words]


def test_every_weir_command_in_the_docs_is_one_the_cli_accepts() -> None:
    """Each `weir ...` a doc shows names a real subcommand, real options and no more arguments than
    it takes (`weir engine serve smollm2-135m` once sat in docs/speculative.md; the model is
    `--model`)."""
    seen = 0
    for doc in DOCS:
        for argv in weir_commands(doc.read_text()):
            try:
                assert_cli_accepts(argv)
            except AssertionError as error:
                raise AssertionError(f"{doc.relative_to(ROOT)}: {error}") from None
            seen += 1
    assert seen >= 60


def leaf_commands(group: click.Group, path: str = "weir") -> Iterator[tuple[str, click.Command]]:
    context = click.Context(group)
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        if isinstance(command, click.Group):
            yield from leaf_commands(command, f"{path} {name}")
        elif command is not None:
            yield f"{path} {name}", command


def test_every_cli_option_is_named_in_the_docs() -> None:
    """An option added to a `weir` command gets a word in the README or docs/ (`weir demo --var-dir`,
    `weir router train --epochs` and `weir engine serve --seed` once had none)."""
    docs = "\n".join(doc.read_text() for doc in DOCS)
    missing = [
        f"{path} {option}"
        for path, command in leaf_commands(main)
        for param in command.params
        if isinstance(param, click.Option)
        for option in [max(param.opts + param.secondary_opts, key=len)]
        if not re.search(rf"`[^`]*{re.escape(option)}(?![\w-])", docs)
    ]
    assert not missing, f"options no doc names: {missing}"


@pytest.mark.parametrize("argv", [["serve"], ["engine", "serve"], ["demo"]])
def test_a_port_out_of_range_is_a_usage_error(argv: list[str]) -> None:
    """Not a traceback from bind() (the engine), nor port 70000 served as 4464 (uvicorn, modulo 2^16)."""
    result = CliRunner().invoke(main, [*argv, "--port", "70000"])
    assert result.exit_code == 2, result.output
    assert "70000 is not in the range" in result.output


def test_demo_refuses_a_var_dir_it_cannot_make_before_pulling_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--var-dir` under a file: a NotADirectoryError traceback, after the model's download."""
    import engine.registry

    pulled: list[str] = []
    monkeypatch.setattr(engine.registry, "pull", lambda name, **_: pulled.append(name))
    (tmp_path / "file").touch()
    var = tmp_path / "file" / "var"
    result = CliRunner().invoke(main, ["demo", "--var-dir", str(var)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # reported, not raised
    assert result.output == f"Error: --var-dir {var}: {tmp_path / 'file'} is a file, not a directory\n"
    assert pulled == []
