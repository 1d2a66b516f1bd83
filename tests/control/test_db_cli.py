"""`weir db`, `weir admin create-user` and `weir router` as an operator meets them: the database named
with `--database-url` is the one written to, whatever WEIR_DATABASE_URL the shell exports, a database
that cannot be reached, parsed or migrated is one line saying why, not a traceback, and only `weir db
upgrade` creates one."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from gateway.vault import generate_key
from routing.difficulty import STATIC_HEAD_DIR
from tests.fixtures.net import free_port
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
    assert weir("db", "upgrade", *url).exit_code == 0
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


def test_router_commands_take_the_named_database_over_weir_database_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`weir router train --tenant` and `weir router heads` resolve the database as `weir db` does:
    the exported one here is not there, so a command that read it would fail saying so."""
    named, exported = tmp_path / "named.db", tmp_path / "exported.db"
    monkeypatch.setenv("WEIR_DATABASE_URL", f"sqlite:///{exported}")
    url = ["--database-url", f"sqlite:///{named}"]
    assert weir("db", "upgrade", *url).exit_code == 0
    installed = weir("router", "heads", "install", "static", str(STATIC_HEAD_DIR), *url)
    assert installed.exit_code == 0, installed.output
    listed = weir("router", "heads", "list", *url)
    assert listed.exit_code == 0 and '"name": "static"' in listed.output, listed.output
    exported_head = weir("router", "heads", "export", "static", "--out", str(tmp_path / "static.bin"), *url)
    assert exported_head.exit_code == 0 and (tmp_path / "static.bin").stat().st_size > 0
    deleted = weir("router", "heads", "delete", "static", *url)
    assert deleted.exit_code == 0, deleted.output
    trained = weir("router", "train", "--tenant", "acme", "--route", "auto", *url)
    assert "no tenant named 'acme'" in trained.output, trained.output  # looked up in the named one
    assert not exported.exists()
    # Without the option, the exported database is the one used.
    listed = weir("router", "heads", "list")
    assert listed.exit_code == 1 and f"admin DB: {exported} does not exist" in listed.output


def _commands(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            assert sub is not None, f"{path} {name}"
            yield from _commands(sub, f"{path} {name}")


def test_every_database_url_option_is_the_shared_one() -> None:
    """One option for every command that opens the admin DB, so that each resolves it alike and says
    so alike in its --help (`weir router` had copies of its own, without the environment variable)."""
    options = {
        path: param.to_info_dict()
        for path, command in _commands(main, "weir")
        for param in command.params
        if "--database-url" in param.opts
    }
    assert {"weir router train", "weir router heads list", "weir admin create-user"} <= set(options)
    for path, option in options.items():
        assert option == options["weir db upgrade"], path


DB_COMMANDS = [
    ["db", "purge-prompts"],
    ["db", "rotate-master-key"],
    ["admin", "create-user", "ana", "--password-stdin"],
]


@pytest.mark.parametrize("command", [*DB_COMMANDS, ["db", "current"], ["db", "downgrade"]])
def test_a_database_that_is_not_there_is_refused_and_not_made(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only `weir db upgrade` makes a database. These opened a mistyped SQLite path as a new empty
    file and then failed on "no such table" (create-user migrated it and stored the account there,
    where no gateway reads it; `db current` reported it as an "(empty database)")."""
    monkeypatch.setenv("WEIR_MASTER_KEY", generate_key())
    # In a directory that is there (SQLite would make the file) and in one that is not (made for it).
    for missing in (tmp_path / "typo.db", tmp_path / "typo" / "weir.db"):
        result = weir(*command, "--database-url", f"sqlite:///{missing}", input=PASSWORD)
        error = one_line_error(result)
        assert f"admin DB: {missing} does not exist; `weir db upgrade` creates its tables" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", DB_COMMANDS)
def test_a_database_never_migrated_is_refused(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_MASTER_KEY", generate_key())
    empty = tmp_path / "empty.db"
    empty.touch()
    result = weir(*command, "--database-url", f"sqlite:///{empty}", input=PASSWORD)
    assert "has no tables (not migrated); `weir db upgrade` creates its tables" in one_line_error(result)
    with sqlite3.connect(empty) as db:
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == []


def test_create_user_asks_for_the_password_only_once_the_database_is_there(tmp_path: Path) -> None:
    """Not a password typed twice, then refused for a mistyped --database-url."""
    result = weir("admin", "create-user", "ana", "--database-url", f"sqlite:///{tmp_path / 'typo.db'}")
    assert "Password" not in one_line_error(result)


def test_upgrade_into_a_directory_not_there_makes_it(tmp_path: Path) -> None:
    """SQLite cannot open a file in a missing directory: upgrade failed ("unable to open database
    file"), and aiosqlite's failed open raced the closing event loop, an "Event loop is closed"
    traceback from its worker thread before the error. The gateway's own engine makes the directory;
    upgrade, the one command that creates a database, does too, and the others still refuse it."""
    missing = tmp_path / "var" / "weir.db"
    url = ["--database-url", f"sqlite:///{missing}"]
    upgraded = weir("db", "upgrade", *url)
    assert upgraded.exit_code == 0, upgraded.output
    assert missing.exists()
    current = weir("db", "current", *url)
    assert current.exit_code == 0 and "(head)" in current.output, current.output


def test_upgrade_to_a_revision_the_database_is_past_says_so(tmp_path: Path) -> None:
    """alembic's upgrade to an older revision does nothing and says nothing: the operator who meant to
    go back to it is told that `downgrade` does."""
    url = ["--database-url", f"sqlite:///{tmp_path / 'weir.db'}"]
    assert weir("db", "upgrade", *url).exit_code == 0
    head = weir("db", "current", *url).output.split()[0]
    older = weir("db", "upgrade", "0003", *url)
    assert older.exit_code == 0, older.output
    assert older.output == (
        f"admin DB: already at {head}, past 0003: nothing to upgrade (`weir db downgrade 0003` goes back to it)\n"
    )
    assert weir("db", "current", *url).output.split()[0] == head
    again = weir("db", "upgrade", "head", *url)  # at it already: nothing to say
    assert again.exit_code == 0 and again.output == ""


def test_downgrade_of_a_database_with_no_schema_says_there_is_nothing_to_downgrade(tmp_path: Path) -> None:
    """It was alembic's "Relative revision -1 didn't produce 1 migrations"."""
    path = tmp_path / "weir.db"
    sqlite3.connect(path).close()
    result = weir("db", "downgrade", "--database-url", f"sqlite:///{path}")
    assert result.exit_code == 0, result.output
    assert (
        result.output
        == "admin DB: nothing to downgrade: it has no schema yet; `weir db upgrade` creates its tables\n"
    )


# aiosqlite's worker thread made slow, as on a loaded machine, and the process slow to exit: the
# thread then reports a failed open after `asyncio.run` has closed the command's event loop, and
# before the process ends, every time rather than now and then.
SLOW_AIOSQLITE_WEIR = """
import atexit, sys, time
import aiosqlite.core as core
worker = core._connection_worker_thread

class Slow:
    def __init__(self, tx):
        self.tx = tx
    def get(self):
        item = self.tx.get()
        time.sleep(0.3)
        return item

core._connection_worker_thread = lambda tx: worker(Slow(tx))
atexit.register(time.sleep, 1.5)
from weir.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("command", [*DB_COMMANDS, ["db", "current"], ["db", "upgrade"]])
def test_a_sqlite_file_that_cannot_be_opened_is_one_line(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path SQLite cannot open (a directory here; a path under a file, or one without permission,
    alike) printed aiosqlite's "Event loop is closed" traceback from its worker thread before the
    one-line error: only the error now, naming the path, with exit status 1."""
    monkeypatch.setenv("WEIR_MASTER_KEY", generate_key())
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    ran = subprocess.run(
        [sys.executable, "-c", SLOW_AIOSQLITE_WEIR, *command, "--database-url", f"sqlite:///{tmp_path}"],
        input=PASSWORD,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 1, ran.stderr
    assert "Event loop is closed" not in ran.stderr, ran.stderr
    assert ran.stderr == f"Error: admin DB: cannot open {tmp_path}: unable to open database file\n"


def test_upgrade_under_a_file_names_the_database(tmp_path: Path) -> None:
    """Its directory cannot be made: the error named only the file in the way ("File exists: ...")."""
    (tmp_path / "file").touch()
    under = tmp_path / "file" / "weir.db"
    error = one_line_error(weir("db", "upgrade", "--database-url", f"sqlite:///{under}"))
    assert error.startswith(f"Error: admin DB: cannot open {under}: "), error


def admin_users(db_file: Path) -> list[str]:
    with sqlite3.connect(db_file) as db:
        rows = db.execute("SELECT key FROM settings WHERE key LIKE 'admin_user:%' ORDER BY key").fetchall()
    return [key.removeprefix("admin_user:") for (key,) in rows]


def test_update_of_a_user_not_there_creates_nothing(tmp_path: Path) -> None:
    """`--update` changes an existing account's password. For a mistyped name it made a second
    account and said "updated", while the account meant (its password perhaps leaked) kept the old
    password and still signed in."""
    db_file = tmp_path / "weir.db"
    url = ["--database-url", f"sqlite:///{db_file}"]
    assert weir("db", "upgrade", *url).exit_code == 0
    assert weir("admin", "create-user", "ana", "--password-stdin", *url, input=PASSWORD).exit_code == 0
    typo = weir("admin", "create-user", "anna", "--update", "--password-stdin", *url, input=PASSWORD)
    assert typo.exit_code == 1, typo.output
    assert typo.output == "Error: no admin user 'anna' to update (leave out --update to create it)\n"
    assert admin_users(db_file) == ["ana"]
    updated = weir("admin", "create-user", "ana", "--update", "--password-stdin", *url, input=PASSWORD)
    assert updated.exit_code == 0 and updated.output == "admin user 'ana' updated\n", updated.output


def test_a_password_that_is_not_utf8_is_refused_and_nothing_stored(tmp_path: Path) -> None:
    """A non-UTF-8 line on stdin was a UnicodeEncodeError traceback from the password hasher."""
    db_file = tmp_path / "weir.db"
    url = ["--database-url", f"sqlite:///{db_file}"]
    assert weir("db", "upgrade", *url).exit_code == 0
    result = CliRunner().invoke(
        main,
        ["admin", "create-user", "ana", "--password-stdin", *url],
        input=b"\xff\xfecorrect horse battery\n",
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "password is not UTF-8" in result.output, result.output
    assert admin_users(db_file) == []


def test_export_to_a_path_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """`--out` under a file (or in a directory not there): a FileNotFoundError or NotADirectoryError
    traceback from the write."""
    url = ["--database-url", f"sqlite:///{tmp_path / 'weir.db'}"]
    assert weir("db", "upgrade", *url).exit_code == 0
    assert weir("router", "heads", "install", "static", str(STATIC_HEAD_DIR), *url).exit_code == 0
    (tmp_path / "file").touch()
    for out in (tmp_path / "file" / "static.bin", tmp_path / "nowhere" / "static.bin"):
        result = weir("router", "heads", "export", "static", "--out", str(out), *url)
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit), result.exception  # reported, not raised
        assert result.output.startswith(f"Error: cannot write {out}: "), result.output
        assert result.output.count("\n") == 1, result.output
        assert not out.exists()
