"""The admin web UI at `/admin`: static pages from `admin-ui/`, sign-in, server-side sessions, and the
admin API again under `/admin/session/api/v1` for signed-in browsers.

Sign-in takes an admin account (`weir admin create-user`, argon2 hashes kept in the settings table) or
the admin token. Sessions live in the shared state (Redis when configured, so every replica knows
them), expire after 30 idle minutes or 12 hours, and carry a CSRF token that every mutating call must
echo in `x-weir-csrf`. Repeated failures lock an account (or the token) out for 15 minutes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import hmac
import json
import re
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from litestar import Request, Response, Router, delete, get, post
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.handlers import BaseRouteHandler
from litestar.static_files import create_static_files_router

from gateway.admin.router import AdminContext, AdminError, admin_router
from gateway.admin.token import token_matches
from gateway.db.cli import database_url_option, run_on_admin_db

if TYPE_CHECKING:
    from gateway.admin.control_plane import ControlPlane

UI_DIR = Path(__file__).resolve().parents[2] / "admin-ui"
COOKIE = "weir_admin_session"
CSRF_HEADER = "x-weir-csrf"
IDLE_S = 30 * 60
ABSOLUTE_S = 12 * 3600
MAX_FAILURES = 5
LOCKOUT_S = 15 * 60
USER_SETTING = "admin_user:"
USERNAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
}


def _hasher() -> Any:
    from argon2 import PasswordHasher

    return PasswordHasher()


@functools.cache
def _dummy_hash() -> str:
    # Checked when the account does not exist, so a wrong name costs as long as a wrong password.
    return _hasher().hash(secrets.token_hex(16))


def _error(status: int, message: str, code: str, param: str | None = None) -> Response[dict[str, Any]]:
    return Response(
        {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
        status_code=status,
        headers={"cache-control": "no-store"},
    )


def _on_admin_error(_: Request, exc: AdminError) -> Response[dict[str, Any]]:
    return _error(exc.status, exc.message, exc.code, exc.param)


async def _security_headers(response: Response[Any]) -> Response[Any]:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


class AdminUI:
    """Sessions, sign-in checks and lockouts on top of the control plane's DB and shared state."""

    def __init__(self, control: ControlPlane) -> None:
        self.control = control

    @property
    def state(self) -> Any:
        return self.control.state

    # --- sessions ------------------------------------------------------------------------------

    @staticmethod
    def _session_key(session_id: str) -> str:
        # Only a hash of the cookie is stored: a leaked state dump cannot be replayed as a session.
        return "admin-session:" + hashlib.sha256(session_id.encode()).hexdigest()

    async def open_session(self, user: str) -> tuple[str, dict[str, Any]]:
        session_id = secrets.token_urlsafe(32)
        now = time.time()
        record = {"user": user, "csrf": secrets.token_urlsafe(32), "created": now, "seen": now}
        await self.state.kv_set(self._session_key(session_id), json.dumps(record).encode(), IDLE_S)
        return session_id, record

    async def session(self, connection: ASGIConnection) -> dict[str, Any] | None:
        """The live session of this request's cookie (its idle timer restarted), or None."""
        session_id = connection.cookies.get(COOKIE)
        if not session_id:
            return None
        key = self._session_key(session_id)
        raw = await self.state.kv_get(key)
        if raw is None:
            return None
        record = json.loads(raw)
        if not record:  # signed out or expired, waiting for the state to drop it
            return None
        now = time.time()
        left = record["created"] + ABSOLUTE_S - now
        if left <= 0:
            await self.state.kv_set(key, b"{}", 1)
            return None
        record["seen"] = now
        await self.state.kv_set(key, json.dumps(record).encode(), min(IDLE_S, left))
        return record

    async def close_session(self, connection: ASGIConnection) -> None:
        session_id = connection.cookies.get(COOKIE)
        if session_id:
            # kv has no delete: an unparseable value that expires at once ends the session.
            await self.state.kv_set(self._session_key(session_id), b"{}", 1)

    # --- lockout -------------------------------------------------------------------------------

    @staticmethod
    def _failure_key(account: str) -> str:
        return "admin-signin-failures:" + hashlib.sha256(account.encode()).hexdigest()

    async def locked_out(self, account: str) -> bool:
        raw = await self.state.kv_get(self._failure_key(account))
        return raw is not None and int(raw) >= MAX_FAILURES

    async def record_failure(self, account: str) -> None:
        key = self._failure_key(account)
        for _ in range(10):  # compare-and-set: concurrent failures on other replicas all count
            raw = await self.state.kv_get(key)
            count = int(raw) + 1 if raw is not None else 1
            if await self.state.kv_compare_and_set(key, raw, str(count).encode(), LOCKOUT_S):
                return

    async def clear_failures(self, account: str) -> None:
        await self.state.kv_set(self._failure_key(account), b"0", 1)

    # --- credentials ---------------------------------------------------------------------------

    async def password_ok(self, username: str, password: str) -> bool:
        from gateway.db.models import Setting

        async with self.control.sessions() as db:
            stored = await db.get(Setting, USER_SETTING + username)
        digest = stored.value if stored is not None else _dummy_hash()

        def verify() -> bool:
            from argon2.exceptions import VerificationError

            try:
                return _hasher().verify(digest, password)
            except VerificationError:
                return False

        # argon2 is deliberately slow: keep it off the event loop.
        return await asyncio.to_thread(verify) and stored is not None

    def token_ok(self, token: str) -> bool:
        return token_matches(token, self.control.admin.token_digest)


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return origin.split("://", 1)[-1] == request.headers.get("host", "")


def _cookie_secure(request: Request) -> bool:
    proto = request.headers.get("x-forwarded-proto", request.url.scheme)
    return proto.split(",")[0].strip() == "https"


def _session_router(ui: AdminUI) -> Router:
    @get("/session")
    async def current(request: Request) -> Response[Any]:
        record = await ui.session(request)
        if record is None:
            return _error(401, "not signed in, or the session expired: sign in again", "invalid_session")
        return Response(
            {"user": record["user"], "csrf": record["csrf"]}, headers={"cache-control": "no-store"}
        )

    @post("/session", status_code=200)
    async def sign_in(request: Request) -> Response[Any]:
        if not _same_origin(request):
            return _error(403, "sign-in must come from this site's own page", "csrf_failed")
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return _error(415, "send the sign-in form as application/json", "invalid_request")
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            return _error(400, "the sign-in body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the sign-in body must be a JSON object", "invalid_json")
        token, username, password = body.get("token"), body.get("username"), body.get("password")
        if isinstance(token, str) and token:
            account, secret = "#admin-token", token
        elif isinstance(username, str) and isinstance(password, str) and username and password:
            if not USERNAME.match(username):
                return _error(400, "user names are 1-64 letters, digits or ._@-", "invalid_value", "username")
            account, secret = username, password
        else:
            return _error(400, "enter a user name and password, or the admin token", "invalid_value")
        if await ui.locked_out(account):
            return _error(
                429,
                f"too many failed sign-ins: locked for up to {LOCKOUT_S // 60} minutes",
                "locked_out",
            )
        ok = ui.token_ok(secret) if account == "#admin-token" else await ui.password_ok(account, secret)
        if not ok:
            await ui.record_failure(account)
            what = "admin token" if account == "#admin-token" else "user name or password"
            return _error(401, f"wrong {what}", "invalid_credentials")
        await ui.clear_failures(account)
        user = "admin-token" if account == "#admin-token" else account
        session_id, record = await ui.open_session(user)
        response: Response[Any] = Response(
            {"user": user, "csrf": record["csrf"]}, headers={"cache-control": "no-store"}
        )
        response.set_cookie(
            COOKIE,
            session_id,
            path="/admin",
            httponly=True,
            samesite="strict",
            secure=_cookie_secure(request),
            max_age=ABSOLUTE_S,
        )
        return response

    @delete("/session", status_code=204)
    async def sign_out(request: Request) -> Response[None]:
        record = await ui.session(request)
        if record is not None:
            if not hmac.compare_digest(request.headers.get(CSRF_HEADER, ""), record["csrf"]):
                raise AdminError(403, "missing or wrong CSRF token: reload the page", "csrf_failed")
            await ui.close_session(request)
        response: Response[None] = Response(None, status_code=204)
        response.delete_cookie(COOKIE, path="/admin")
        return response

    @get("/", sync_to_thread=False)
    def index() -> Response[bytes]:
        return Response(
            (UI_DIR / "index.html").read_bytes(),
            media_type="text/html; charset=utf-8",
            headers={"cache-control": "no-store"},
        )

    return Router(
        path="/admin",
        route_handlers=[current, sign_in, sign_out, index],
        after_request=_security_headers,
        exception_handlers={AdminError: _on_admin_error},
    )


def _api_router(ui: AdminUI) -> Router:
    """The admin API itself, guarded by the session instead of the bearer token, so the UI shows
    exactly what the API computes; the audit log names the signed-in user."""

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        record = await ui.session(connection)
        if record is None:
            raise AdminError(401, "not signed in, or the session expired: sign in again", "invalid_session")
        # Only HTTP routes sit behind this guard; litestar types scope["type"] as an enum, which
        # leaves mypy no way to narrow the scope to HTTPScope.
        method = connection.scope["method"]  # type: ignore[typeddict-item]
        if method not in SAFE_METHODS and not hmac.compare_digest(
            connection.headers.get(CSRF_HEADER, ""), record["csrf"]
        ):
            raise AdminError(403, "missing or wrong CSRF token: reload the page", "csrf_failed")
        connection.scope.setdefault("state", {})["weir_admin_user"] = record["user"]

    def context(request: Request) -> AdminContext:
        user = request.scope.get("state", {}).get("weir_admin_user", "ui")
        return dataclasses.replace(ui.control.admin, actor=f"ui:{user}")

    router = admin_router(ui.control.admin, path="/admin/session/api/v1")
    router.guards = [guard]
    router.dependencies = {"ctx": Provide(context, sync_to_thread=False)}
    router.after_request = _security_headers
    return router


def ui_routers(control: ControlPlane) -> list[Router]:
    """Everything under `/admin` except the bearer-token API; mount beside `control.router()`."""
    ui = AdminUI(control)
    assets = create_static_files_router(
        path="/admin/assets",
        directories=[UI_DIR],
        name="admin-ui-assets",
        after_request=_security_headers,
    )
    return [_session_router(ui), _api_router(ui), assets]


# --- `weir admin` ------------------------------------------------------------------------------


@click.group()
def admin() -> None:
    """Admin web UI accounts (sign in at /admin on the gateway)."""


@admin.command("create-user")
@click.argument("username")
@database_url_option
@click.option("--password-stdin", is_flag=True, help="Read the password from standard input.")
@click.option("--update", is_flag=True, help="Change the password of an existing user.")
def create_user(username: str, database_url: str | None, password_stdin: bool, update: bool) -> None:
    """Create an admin UI account (or change its password with --update)."""
    if not USERNAME.match(username):
        raise click.BadParameter("1-64 letters, digits or ._@-", param_hint="USERNAME")
    from gateway.db.models import Setting

    key = USER_SETTING + username
    exists = f"user {username!r} exists; pass --update to change its password"
    # A mistyped name with --update made a second account, and the one meant kept its old password.
    missing = f"no admin user {username!r} to update (leave out --update to create it)"

    async def store(sessions: Any) -> str | None:
        # Asked only once the DB is known to exist and have its tables (`run_on_admin_db`), and to
        # hold the account (or not) as --update says: not a password typed twice for a mistyped
        # --database-url or user name, and not an account stored in a database made on the spot,
        # which no gateway reads.
        async with sessions() as db:
            found = await db.get(Setting, key) is not None
        if found != update:
            return missing if update else exists
        digest = _hasher().hash(_new_password(password_stdin))
        async with sessions() as db, db.begin():
            existing = await db.get(Setting, key)
            if (existing is not None) != update:  # made or deleted meanwhile
                return missing if update else exists
            if existing is None:
                db.add(Setting(key=key, value=digest))
            else:
                existing.value = digest
            return None

    problem = run_on_admin_db(database_url, store)
    if problem is not None:
        raise click.ClickException(problem)
    click.echo(f"admin user {username!r} {'updated' if update else 'created'}")


def _new_password(from_stdin: bool) -> str:
    if from_stdin:
        # Bytes, decoded here: how sys.stdin decodes depends on the locale, and a line that is not
        # UTF-8 was a traceback from the hasher. (Not click.get_text_stream: deprecated in Click 8.5.)
        line = sys.stdin.buffer.readline()
        try:
            password = line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise click.BadParameter("the password is not UTF-8", param_hint="password") from None
    else:
        password = click.prompt("Password", hide_input=True, confirmation_prompt=True)
        try:
            password.encode("utf-8")
        except UnicodeEncodeError:  # a terminal that sent bytes its locale could not decode
            raise click.BadParameter("the password is not UTF-8", param_hint="password") from None
    if len(password) < 12:
        raise click.BadParameter("use at least 12 characters", param_hint="password")
    return password
