"""A gateway with the control plane on an admin DB of the test's choosing (no Redis), and its admin
(`Weir`): for the tests of the routes admin API, their validation and their races."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from routing.router import Router
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.vendor_gateway import full_config_text

ADMIN = "admin-token-for-the-routes-audit"
# The routes the gateway starts with, and a route body the admin API accepts.
ROUTES = """\
routes:
  - {name: auto, candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}], probe_interval: null}
  - {name: vis, when: {images: true}, candidates: [{model: claude-sonnet}], probe_interval: null}
  - {name: vis, candidates: [{model: gpt-4o-mini}], probe_interval: null}
  - {name: down, candidates: [{model: dead-model}], retry: {attempts: 1}, probe_interval: null}
"""
GOOD = {"name": "audit", "candidates": [{"model": "gpt-4o-mini"}], "probe_interval": None}


class Weir:
    """A gateway at `url` as its admin sees it: the admin API, new tenants' keys, its router."""

    def __init__(self, url: str, router: Router) -> None:
        self.url, self.router = url, router
        self.admin = httpx.Client(
            base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"}, timeout=20
        )

    def key(self, name: str) -> str:
        tenant = self.admin.post("/tenants", json={"name": f"{name}-{uuid.uuid4().hex[:6]}"})
        assert tenant.status_code == 201, tenant.text
        key = self.admin.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "app"})
        assert key.status_code == 201, key.text
        return str(key.json()["key"])

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=20)


@contextmanager
def serving(env: dict[str, str], database_url: str, spool: Path, routes: str = "") -> Iterator[Weir]:
    """A gateway with the control plane on `database_url` (no Redis: memory state)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
        patch.setenv("WEIR_USAGE_SPOOL", str(spool))
        for var in ("WEIR_REDIS_URL", "WEIR_DATABASE_URL"):
            patch.delenv(var, raising=False)
        app = create_app(parse_config(full_config_text() + f'database_url: "{database_url}"\n' + routes, env))
        with serve(app, free_port()) as base:
            yield Weir(base, app.state.gateway.router)
