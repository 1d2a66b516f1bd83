"""Sign-in, sessions and their protections, as a browser (or an attacker's page) would meet them."""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from gateway.admin import ui
from tests.ui.helpers import ADMIN, Weir
from weir.cli import main as weir_cli


def browser_client(weir: Weir) -> httpx.Client:
    return httpx.Client(base_url=weir.url, headers={"origin": weir.url})


def sign_in(client: httpx.Client, **body: str) -> httpx.Response:
    return client.post("/admin/session", json=body)


def test_pages_carry_security_headers(weir: Weir) -> None:
    with browser_client(weir) as client:
        for path in ("/admin/", "/admin/assets/app.js", "/admin/assets/vendor/uPlot.esm.js"):
            response = client.get(path)
            assert response.status_code == 200, path
            csp = response.headers["content-security-policy"]
            assert "frame-ancestors 'none'" in csp and "script-src 'self';" in csp
            assert "unsafe-inline" not in csp
            assert response.headers["x-content-type-options"] == "nosniff"
        assert client.get("/admin").text == client.get("/admin/").text


def test_session_api_needs_a_session_and_csrf(weir: Weir) -> None:
    with browser_client(weir) as client:
        refused = client.get("/admin/session/api/v1/tenants")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_session"

        signed = sign_in(client, token=ADMIN)
        assert signed.status_code == 200
        cookie = signed.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/admin" in cookie
        csrf = signed.json()["csrf"]
        assert client.get("/admin/session/api/v1/tenants").json() == {"data": []}

        # A forged cross-site POST carries the cookie but not the CSRF token: refused, nothing made.
        forged = client.post("/admin/session/api/v1/tenants", json={"name": "evil"})
        assert forged.status_code == 403
        assert forged.json()["error"]["code"] == "csrf_failed"
        wrong = client.post(
            "/admin/session/api/v1/tenants", json={"name": "evil"}, headers={"x-weir-csrf": "guess"}
        )
        assert wrong.status_code == 403
        assert weir.admin.get("/tenants").json()["data"] == []

        made = client.post(
            "/admin/session/api/v1/tenants", json={"name": "acme"}, headers={"x-weir-csrf": csrf}
        )
        assert made.status_code == 201
        assert weir.admin.get("/audit").json()["data"][0]["actor"] == "ui:admin-token"

        # Signing out ends the session on the server, not just in the browser.
        old_cookie = client.cookies.get(ui.COOKIE)
        assert client.delete("/admin/session", headers={"x-weir-csrf": csrf}).status_code == 204
        replay = httpx.get(f"{weir.url}/admin/session/api/v1/tenants", cookies={ui.COOKIE: old_cookie})
        assert replay.status_code == 401


def test_sign_in_from_another_site_is_refused(weir: Weir) -> None:
    with httpx.Client(base_url=weir.url, headers={"origin": "https://evil.example"}) as client:
        response = sign_in(client, token=ADMIN)
        assert response.status_code == 403
        assert ui.COOKIE not in response.cookies


def test_repeated_failures_lock_sign_in_out(weir: Weir) -> None:
    with browser_client(weir) as client:
        for _ in range(ui.MAX_FAILURES):
            wrong = sign_in(client, token="not-the-token")
            assert wrong.status_code == 401
            assert wrong.json()["error"]["code"] == "invalid_credentials"
        locked = sign_in(client, token=ADMIN)  # even the right token waits out the lockout
        assert locked.status_code == 429
        assert "locked" in locked.json()["error"]["message"]
        assert ui.COOKIE not in locked.cookies


def test_sessions_expire_when_idle(weir: Weir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ui, "IDLE_S", 1)
    with browser_client(weir) as client:
        assert sign_in(client, token=ADMIN).status_code == 200
        assert client.get("/admin/session").status_code == 200
        import time

        time.sleep(1.2)
        expired = client.get("/admin/session/api/v1/tenants")
        assert expired.status_code == 401
        assert "expired" in expired.json()["error"]["message"]


def test_accounts_created_with_the_cli_sign_in(weir: Weir) -> None:
    runner = CliRunner()
    args = ["admin", "create-user", "ana", "--database-url", weir.db_url, "--password-stdin"]
    created = runner.invoke(weir_cli, args, input="correct horse battery\n")
    assert created.exit_code == 0, created.output
    again = runner.invoke(weir_cli, args, input="another password 123\n")
    assert again.exit_code != 0 and "--update" in again.output
    short = runner.invoke(weir_cli, [*args[:2], "bob", *args[3:]], input="short\n")
    assert short.exit_code != 0 and "12 characters" in short.output

    with browser_client(weir) as client:
        wrong = sign_in(client, username="ana", password="wrong password!!")
        assert wrong.status_code == 401
        nobody = sign_in(client, username="nobody", password="correct horse battery")
        assert nobody.status_code == 401
        assert nobody.json()["error"]["message"] == wrong.json()["error"]["message"]
        signed = sign_in(client, username="ana", password="correct horse battery")
        assert signed.status_code == 200
        assert signed.json()["user"] == "ana"
        csrf = signed.json()["csrf"]
        made = client.post(
            "/admin/session/api/v1/tenants", json={"name": "team"}, headers={"x-weir-csrf": csrf}
        )
        assert made.status_code == 201
    assert weir.admin.get("/audit").json()["data"][0]["actor"] == "ui:ana"
