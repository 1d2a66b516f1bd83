"""`weir db` and `weir admin create-user` as an operator meets them: the database named with
`--database-url` is the one written to, whatever WEIR_DATABASE_URL the shell exports, and a database
that cannot be reached, parsed or migrated is one line saying why, not a traceback."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gateway.vault import generate_key
from tests.conftest import free_port
from weir.cli import main

PASSWORD = "correct horse battery\n"


def weir(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=input)


def test_an_explicit_database_url_wins_over_weir_database_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shell exports one database (production, say) and the command names another: each command
    writes to the one it names. create-user, purge-prompts and rotate-master-key wrote to the exported
    one instead."""
    named, exported = tmp_path / "named.db", tmp_path / "exported.db"
    monkeypatch.setenv("WEIR_DATABASE_URL", f"sqlite:///{exported}")
    monkeypatch.setenv("WEIR_MASTER_KEY", generate_key())
    url = ["--database-url", f"sqlite:///{named}"]
    created = weir("admin", "create-user", "ana", "--password-stdin", *url, input=PASSWORD)
    assert created.exit_code == 0, created.output
    for command in (["db", "purge-prompts"], ["db", "rotate-master-key"]):
        ran = weir(*command, *url)
        assert ran.exit_code == 0, ran.output
    assert not exported.exists()
    with sqlite3.connect(named) as db:
        assert db.execute("SELECT count(*) FROM settings WHERE key LIKE '%ana'").fetchone() == (1,)
    # Without the option, the exported database is the one used.
    assert weir("db", "upgrade").exit_code == 0 and exported.exists()


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # reported, not raised
    assert "Traceback" not in result.output
    assert result.output.count("\n") == 1, result.output
    assert result.output.startswith("Error: admin DB: "), result.output
    return result.output


@pytest.mark.parametrize(
    "command",
    [
        ["db", "upgrade"],
        ["db", "downgrade"],
        ["db", "current"],
        ["db", "purge-prompts"],
        ["admin", "create-user", "ana", "--password-stdin"],
    ],
)
def test_a_database_that_does_not_answer_is_one_line(command: list[str]) -> None:
    unreachable = f"postgresql://weir@127.0.0.1:{free_port()}/weir"
    result = weir(*command, "--database-url", unreachable, input=PASSWORD)
    assert "Connect call failed" in one_line_error(result) or "refused" in result.output


def test_a_bad_url_or_revision_is_one_line(tmp_path: Path) -> None:
    assert "Could not parse" in one_line_error(weir("db", "current", "--database-url", "weir.db"))
    sqlite = f"sqlite:///{tmp_path / 'weir.db'}"
    assert "'nonsense'" in one_line_error(weir("db", "upgrade", "nonsense", "--database-url", sqlite))
