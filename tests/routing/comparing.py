"""A gateway whose difficulty routes compare their candidates (routing.compare), for the tests of
comparisons and of training on their grades: OpenAI candidates and an Anthropic judge on the fakes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from gateway.usage_sink import ListSink
from tests.fakes import FakeAnthropic, FakeOpenAI

ADMIN = "admin-token-for-tests"


def comparing_app(
    config: str,
    db_url: str,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    usage_sink: ListSink | None = None,
    **env: str,
) -> Any:
    """The app (not started) of a gateway on `config`, its OpenAI candidates and Anthropic judge on
    the fakes, its admin DB at `db_url`; `env` sets the config's other variables."""
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    values = {
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "ANTHROPIC_BASE_URL": fake_anthropic.base_url,
        "ANTHROPIC_API_KEY": fake_anthropic.api_key,
        "DB_URL": db_url,
        **env,
    }
    return create_app(parse_config(config, values), usage_sink=usage_sink)


def prompt_keeper(url: str) -> tuple[httpx.Client, dict[str, Any], openai.OpenAI]:
    """An admin client of the gateway at `url`, and the tenant `keeps` made with it (it stores its
    prompts) with an SDK client of its own."""
    admin = httpx.Client(base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
    tenant = admin.post("/tenants", json={"name": "keeps", "store_prompts": True}).json()
    key = admin.post(f"/tenants/{tenant['id']}/keys", json={}).json()["key"]
    return admin, tenant, openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
