"""What `weir serve` checks before it starts a server, so that the failures an operator commonly meets
at start are each one line naming what failed and what to check (`PreflightError`), not a server's
"Application startup failed" after a traceback: the admin DB (reachable, the right credentials, the
database there, migrated where the gateway will not migrate it) and the address to listen on."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url


class PreflightError(Exception):
    """Why the gateway cannot start, in one line for the operator."""


def check_listen(host: str, port: int) -> None:
    """Whether `host:port` can be listened on (as the server will bind it: SO_REUSEADDR, every address
    the host resolves to). Port 0 asks the system for a free one: nothing to check."""
    if port == 0:
        return
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PreflightError(
            f"cannot listen on {where}: {exc.strerror} (check --host or server.host)"
        ) from None
    for family, kind, proto, _, address in addresses:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # a family this machine lacks: asyncio's create_server skips it too
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as create_server binds it
            try:
                sock.bind(address)
            except OSError as exc:
                raise PreflightError(f"cannot listen on {where}: {exc.strerror}{_listen_hint(exc)}") from None


def _listen_hint(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return " (another process listens there: stop it, or choose another port with --port or server.port)"
    if exc.errno == errno.EACCES:
        return " (ports below 1024 need privileges: choose another with --port or server.port)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return " (no interface of this machine has that address: check --host or server.host)"
    return ""


def check_admin_db(url: str, auto_migrate: bool) -> None:
    """Whether the admin DB at `url` answers, and, without `auto_migrate`, has the schema this version
    of Weir needs (the gateway upgrades it itself otherwise)."""
    shown = shown_url(url)
    try:
        at = asyncio.run(_schema_revision(url))
    except Exception as exc:
        raise PreflightError(admin_db_failure(url, exc)) from None
    if auto_migrate:
        return
    head = _head_revision()
    if at != head:
        state = "has no schema" if at is None else f"is at revision {at}, not {head}"
        raise PreflightError(
            f"admin DB {shown} {state} and auto_migrate is false: run `weir db upgrade` with the same "
            "database URL (--database-url or WEIR_DATABASE_URL), or set auto_migrate: true"
        )


def shown_url(url: str) -> str:
    """`url` with its password masked, as every line about the admin DB shows it."""
    return make_url(url).render_as_string(hide_password=True)


def admin_db_failure(url: str, exc: BaseException) -> str:
    """The one line for `exc` met at the admin DB at `url`: the driver's own words and what to check
    (also for a failure once the checks have passed: a migration, the DB gone since; gateway.app)."""
    return f"admin DB {shown_url(url)}: {_reason(exc)}{_db_hint(exc)}"


async def _schema_revision(url: str) -> str | None:
    """The DB's Alembic revision, None for a DB with no schema; connecting is the check."""
    from gateway.db.session import create_engine

    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            try:
                row = (await connection.execute(text("SELECT version_num FROM alembic_version"))).first()
            except Exception:  # no such table: never migrated
                return None
            return None if row is None else str(row[0])
    finally:
        await engine.dispose()


def _head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    from gateway.db.migrate import alembic_config

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _root(exc: BaseException) -> BaseException:
    """The innermost cause: the driver's or the system's own words, not SQLAlchemy's wrapping."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner: Any = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__
        if inner is None:
            break
        exc = inner
    return exc


def _reason(exc: BaseException) -> str:
    root = _root(exc)
    words = str(root).strip().splitlines()
    return words[0] if words else type(root).__name__


def _db_hint(exc: BaseException) -> str:
    root = _root(exc)
    name, words = type(root).__name__, str(root).lower()
    if name == "ResolutionError":  # Alembic's: the DB is at a revision this version does not know
        return " (a newer version of Weir migrated this database: run that version, or restore a backup)"
    if name == "InvalidPasswordError" or "password authentication failed" in words:
        return " (check the user and password in database_url or WEIR_DATABASE_URL)"
    if name == "InvalidAuthorizationSpecificationError" or ("role" in words and "does not exist" in words):
        return " (check the user in database_url or WEIR_DATABASE_URL)"
    if name == "InvalidCatalogNameError" or ("database" in words and "does not exist" in words):
        return " (create the database, or fix its name in database_url or WEIR_DATABASE_URL)"
    if isinstance(root, (ConnectionError, TimeoutError, socket.gaierror)) or "connect" in words:
        return " (is the database server up, and are the host and port in database_url or WEIR_DATABASE_URL right?)"
    if isinstance(root, OSError) or "unable to open" in words:
        return " (check that the SQLite file's directory exists and is writable)"
    return ""
