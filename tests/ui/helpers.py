"""What the UI tests share besides their fixtures: the gateway they drive (`Weir`, `serve_ui` and its
configs) and the helpers that open, sign in and read the admin pages."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from routing.router import Router
from tests.fakes import FakeOpenAI
from tests.fixtures.db import migrated_sqlite
from tests.fixtures.gateway import CONFIG as CONFIG  # the control tests' one-backend config
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

ADMIN = "admin-token-for-ui-tests"


@dataclass
class Weir:
    url: str
    db_url: str
    router: Router  # the gateway's, in this process: for states no request can bring about

    @property
    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})


# Two models and a tenant key, for the pages that route requests (routes, difficulty heads).
ROUTED_CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
  - {name: gpt-4o, backend: openai, price: {input: 2.50, output: 10.00}}
tenants:
  - {name: team, api_keys: ["sk-team-key"]}
database_url: "${DB_URL}"
"""


def serve_ui(
    config: str, fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Weir]:
    """The gateway on `config`: its admin DB a migrated SQLite file in `tmp_path`, its backend the fake
    OpenAI, no shared database or Redis from the environment."""
    db_url = migrated_sqlite(f"sqlite+aiosqlite:///{tmp_path}/weir.db")
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.delenv("WEIR_DATABASE_URL", raising=False)
    monkeypatch.delenv("WEIR_REDIS_URL", raising=False)
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": db_url}
    app = create_app(parse_config(config, env))
    with serve(app, free_port()) as url:
        yield Weir(url, db_url, app.state.gateway.router)


# The routed models with output limits (`models[].max_output_tokens`): two different ones, so the route
# form's hint shows which model each limit is inherited from (gpt-4o's documented limit is 16,384).
LIMITED_CONFIG = ROUTED_CONFIG.replace(
    "{name: gpt-4o-mini, backend: openai,", "{name: gpt-4o-mini, backend: openai, max_output_tokens: 16384,"
).replace("{name: gpt-4o, backend: openai,", "{name: gpt-4o, backend: openai, max_output_tokens: 8192,")


def usd(exact: str) -> str:
    """How the pages show one of the API's exact decimal costs: "$" and every digit ("1010.5" ->
    "$1,010.50")."""
    whole, _, fraction = exact.partition(".")
    return f"${int(whole):,}.{fraction.ljust(2, '0')}"


# --- pages -------------------------------------------------------------------------------------------

# A failing assertion should fail in seconds, not after Playwright's default 30 s wait.
WAIT_MS = 5000

# An init script that lists each answer the page has read (`window.__answersRead`): a test waits for
# the page to have read every answer it asked for before it looks at what the page shows.
ANSWERS_READ = """
window.__answersRead = [];
const json = Response.prototype.json;
Response.prototype.json = function () {
  const url = this.url;
  return json.call(this).finally(() => window.__answersRead.push(url));
};
"""


def new_page(browser: Any, accept_dialogs: bool = True) -> Any:
    """A page that fails fast; it accepts each confirmation dialog unless `accept_dialogs` is False
    (the test then answers them itself)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(WAIT_MS)
    if accept_dialogs:
        page.on("dialog", lambda dialog: dialog.accept())
    return page


def sign_in(page: Any, weir: Weir, where: str) -> None:
    page.goto(f"{weir.url}/admin/{where}")
    page.get_by_label("Admin token", exact=True).fill(ADMIN)
    page.get_by_role("button", name="Sign in with token").click()


def signed_in(weir: Weir, browser: Any, where: str, accept_dialogs: bool = True) -> Any:
    page = new_page(browser, accept_dialogs)
    sign_in(page, weir, where)
    # The page signing in renders `where` once its requests are answered: a test that went on to
    # another page at once (a route's edit form) had two renders under way, and the later one could rebuild a form
    # it had already begun to fill.
    page.get_by_role("button", name="Sign in with token").wait_for(state="detached")
    page.wait_for_load_state("networkidle")
    return page
