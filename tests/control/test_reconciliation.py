"""Reconciliation: a few hundred requests with known usage through the fake vendors (streaming and
not, with prompt-cache reads and writes), then the usage report must equal an independent
computation from what the vendors reported, to the micro-dollar and beyond."""

from __future__ import annotations

import datetime as dt
import random
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

ADMIN = "reconcile-admin-token"
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
  - {name: anthropic, type: anthropic, base_url: "${ANTHROPIC_BASE_URL}", api_key: "${ANTHROPIC_API_KEY}"}
  - {name: gemini, type: gemini, base_url: "${GEMINI_BASE_URL}", api_key: "${GEMINI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, cached_input: 0.075, output: 0.60}}
  - {name: claude-sonnet, backend: anthropic, model: claude-sonnet-4-5, price: {input: 3.0, cached_input: 0.30, cache_write_5m: 3.75, cache_write_1h: 6.0, output: 15.0}}
  - {name: gemini-flash, backend: gemini, model: gemini-2.5-flash, price: {input: 0.30, cached_input: 0.03, output: 2.50}}
database_url: "${DB_URL}"
"""
# The same prices, typed again for the independent computation (USD per 1M tokens).
PRICES = {
    "gpt-4o-mini": {"input": "0.15", "cached_input": "0.075", "output": "0.60"},
    "claude-sonnet-4-5": {
        "input": "3.0",
        "cached_input": "0.30",
        "cache_write_5m": "3.75",
        "cache_write_1h": "6.0",
        "output": "15.0",
    },
    "gemini-2.5-flash": {"input": "0.30", "cached_input": "0.03", "output": "2.50"},
}


@pytest.fixture
def weir_url(
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    sqlite_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[str]:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    env = {
        "OPENAI_BASE_URL": fake_openai.base_url,
        "OPENAI_API_KEY": fake_openai.api_key,
        "ANTHROPIC_BASE_URL": fake_anthropic.base_url,
        "ANTHROPIC_API_KEY": fake_anthropic.api_key,
        "GEMINI_BASE_URL": fake_gemini.base_url,
        "GEMINI_API_KEY": fake_gemini.api_key,
        "DB_URL": sqlite_url,
    }
    with serve(create_app(parse_config(CONFIG, env)), free_port()) as url:
        yield url


def cost_of(model: str, usage: object) -> tuple[Decimal, Decimal]:
    p = {k: Decimal(v) for k, v in PRICES[model].items()}
    cached = p.get("cached_input", p["input"])
    write_5m = p.get("cache_write_5m", p["input"])
    write_1h = p.get("cache_write_1h", write_5m)
    cost = (
        usage.input_tokens * p["input"]
        + usage.cached_input_tokens * cached
        + usage.cache_write_5m_tokens * write_5m
        + usage.cache_write_1h_tokens * write_1h
        + usage.output_tokens * p["output"]
    ) / 1_000_000
    return cost, usage.cached_input_tokens * (p["input"] - cached) / 1_000_000


@pytest.mark.slow
def test_report_totals_equal_what_the_vendors_reported(
    weir_url: str, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    admin = httpx.Client(base_url=f"{weir_url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
    tenant = admin.post("/tenants", json={"name": "finance"}).json()
    key = admin.post(f"/tenants/{tenant['id']}/keys", json={}).json()["key"]
    client = openai.OpenAI(base_url=f"{weir_url}/v1", api_key=key, max_retries=0, timeout=20)
    vendors = {"gpt-4o-mini": fake_openai, "claude-sonnet": fake_anthropic, "gemini-flash": fake_gemini}
    rng = random.Random(2026)
    n = 240
    for i in range(n):
        model = list(vendors)[i % 3]
        fields = {
            "input_tokens": rng.randint(1, 4000),
            "cached_input_tokens": rng.choice([0, rng.randint(1, 30000)]),
            "output_tokens": rng.randint(1, 900),
        }
        if model == "claude-sonnet":
            fields["cache_write_5m_tokens"] = rng.choice([0, rng.randint(1, 5000)])
            fields["cache_write_1h_tokens"] = rng.choice([0, 0, rng.randint(1, 5000)])
        vendors[model].set_next_usage(**fields)
        messages = [{"role": "user", "content": f"question {i}"}]
        if i % 2:
            stream = client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=1000,
                stream=True,
                stream_options={"include_usage": True},
            )
            assert any(chunk.usage for chunk in stream)
        else:
            assert client.chat.completions.create(model=model, messages=messages, max_tokens=1000).usage

    expected: dict[str, list[Decimal]] = {}
    for fake in vendors.values():
        # the gateway's health prober also GETs each vendor's model list: no usage, not a completion
        completions = [r for r in fake.requests if r.method == "POST"]
        for request, usage in zip(completions, fake.usages, strict=True):
            model = request.json.get("model") or request.path.split("/models/")[1].split(":")[0]
            cost, savings = cost_of(model, usage)
            row = expected.setdefault(model, [Decimal(0), Decimal(0), Decimal(0)])
            row[0] += cost
            row[1] += savings
            row[2] += usage.cached_input_tokens
    assert sum(len(f.usages) for f in vendors.values()) == n

    today = dt.datetime.now(dt.UTC).date()
    params = {
        "start": today.isoformat(),
        "end": (today + dt.timedelta(days=1)).isoformat(),
        "group_by": "model",
    }
    deadline = time.monotonic() + 20
    while True:  # the batch writer lands the events shortly after the responses
        report = admin.get("/reports/usage", params=params).json()
        if report["totals"]["requests"] == n or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report["totals"]["requests"] == n
    got = {row["model"]: row for row in report["rows"]}
    assert set(got) == set(expected)
    for model, (cost, savings, cached) in expected.items():
        assert Decimal(got[model]["cost_usd"]) == cost, model
        assert Decimal(got[model]["cache_savings_usd"]) == savings, model
        assert got[model]["cached_input_tokens"] == cached, model
    assert Decimal(report["totals"]["cost_usd"]) == sum(v[0] for v in expected.values())
