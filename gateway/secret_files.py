"""Secrets from files: `NAME_FILE=/run/secrets/name` stands for `NAME` set to that file's text.

Docker and Compose secrets, and Kubernetes Secret volumes, hand a secret over as a file instead of
an environment variable (which `docker inspect`, `/proc/PID/environ` and crash reports show). The
`weir` command reads every `WEIR_*_FILE` at start (`export_secret_files`), before anything reads
`WEIR_*`, and the config's `${NAME}` falls back to `NAME_FILE` (`secret_from_env`). The file's text
is the value, without its trailing newline (`echo secret > file` writes one).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path

SUFFIX = "_FILE"
PREFIX = "WEIR_"  # the variables `weir` exports from their files at start


class SecretFileError(ValueError):
    """A `NAME_FILE` that cannot be read, or is set together with `NAME`."""


def read_secret_file(name: str, path: str) -> str:
    """The secret `name` held in the file `path`: its text, without trailing newlines."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SecretFileError(f"{name}{SUFFIX}: the file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise SecretFileError(f"{name}{SUFFIX}: cannot read {path}: {reason}") from None
    return text.rstrip("\r\n")


def secret_from_env(name: str, env: Mapping[str, str]) -> str | None:
    """`env[name]`, else the text of the file `env[name_FILE]` names, else None."""
    path = env.get(name + SUFFIX)
    if not path:
        return env.get(name)
    if name in env:
        raise SecretFileError(f"both {name} and {name}{SUFFIX} are set: set one of them")
    return read_secret_file(name, path)


def export_secret_files(env: MutableMapping[str, str]) -> list[str]:
    """Set every `WEIR_X` that `env` gives as `WEIR_X_FILE` from its file, and drop `WEIR_X_FILE`, so
    every reader of `WEIR_X` and every child process (the supervised engine, a server's workers) sees
    the value alone; the names set, in order."""
    names = sorted(
        key.removesuffix(SUFFIX)
        for key, path in env.items()
        if key.startswith(PREFIX) and key.endswith(SUFFIX) and len(key) > len(PREFIX + SUFFIX) and path
    )
    values = {name: secret_from_env(name, env) for name in names}  # every file read before any is set
    for name, value in values.items():
        assert value is not None
        env[name] = value
        del env[name + SUFFIX]
    return names
