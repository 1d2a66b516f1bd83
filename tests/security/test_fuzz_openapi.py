"""schemathesis over every public (/v1/...) and admin API (/admin/api/v1/...) operation of a real
gateway: control plane on (SQLite ledger and admin DB), the fake vendors behind it, a tenant key for
/v1 and the admin token for the admin API.

For each operation schemathesis generates valid and invalid requests (bodies, path and query
parameters) from the schema (tests/security/openapi_schema.py) and checks: no 5xx, every 4xx in the
client's error shape (OpenAI's; Anthropic's on /v1/messages), status codes and content types as
declared, bodies conforming where a schema is declared, and invalid input refused with a 4xx.

Bounded and reproducible: `derandomize=True` (the examples follow from the test's code), a few
examples per operation (47 s measured on 2 cores shared at load 15). `WEIR_FUZZ_DEEP=1` runs a deeper pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.api.anthropic import PATHS as ANTHROPIC_PATHS
from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.security.openapi_schema import ADMIN_PREFIX, gateway_schema

ADMIN = "admin-token-for-the-fuzzer"
TENANT_KEY = "sk-weir-fuzz-0123456789abcdef"
# WEIR_FUZZ_DEEP=1: also schemathesis's coverage phase (every boundary and type the schema allows,
# about 3,000 requests) and 100 examples per operation: a few minutes.
DEEP = os.environ.get("WEIR_FUZZ_DEEP") == "1"
EXAMPLES = 100 if DEEP else 8
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}",
     timeouts: {first_byte: 5, read: 5}}
  - {name: anthropic, type: anthropic, base_url: "${ANTHROPIC_BASE_URL}", api_key: "${ANTHROPIC_API_KEY}",
     timeouts: {first_byte: 5, read: 5}}
  - {name: gemini, type: gemini, base_url: "${GEMINI_BASE_URL}", api_key: "${GEMINI_API_KEY}",
     timeouts: {first_byte: 5, read: 5}}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, cached_input: 0.075, output: 0.60}}
  - {name: claude-sonnet, backend: anthropic, model: claude-sonnet-4-5, price: {input: 3.0, output: 15.0}}
  - {name: gemini-flash, backend: gemini, model: gemini-2.5-flash, price: {input: 0.30, output: 2.50}}
  - {name: text-embedding-3-small, backend: openai}
tenants:
  - {name: fuzz, api_keys: ["${FUZZ_KEY}"]}
database_url: "${DB_URL}"
"""
MODELS = ["gpt-4o-mini", "claude-sonnet", "gemini-flash", "text-embedding-3-small"]


def _env(vendors: dict[str, tuple[str, str]], db_url: str) -> dict[str, str]:
    """The config's variables: each vendor's (base URL, API key), the tenant key, the database."""
    env = {"FUZZ_KEY": TENANT_KEY, "DB_URL": db_url}
    for vendor, (url, key) in vendors.items():
        env[f"{vendor}_BASE_URL"], env[f"{vendor}_API_KEY"] = url, key
    return env


def _schema() -> dict[str, Any]:
    # At import: schemathesis makes one test per operation from it (its lazy, fixture-built schemas
    # do not run under pytest 9). Building the app touches no server, database or file.
    unused = {vendor: ("http://127.0.0.1:9", "unused") for vendor in ("OPENAI", "ANTHROPIC", "GEMINI")}
    config = parse_config(CONFIG, _env(unused, "sqlite+aiosqlite:///:memory:"))
    with mock.patch.dict(os.environ, {"WEIR_ADMIN_TOKEN": ADMIN}):
        return gateway_schema(lambda: create_app(config), MODELS)


schema = schemathesis.openapi.from_dict(_schema())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
schema.config.phases.update(phases=["examples", "coverage", "fuzzing"] if DEEP else ["examples", "fuzzing"])


@pytest.fixture(scope="module")
def gateway_url(
    _fake_openai_server: FakeOpenAI,
    _fake_anthropic_server: FakeAnthropic,
    _fake_gemini_server: FakeGemini,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    fakes = {
        "OPENAI": _fake_openai_server,
        "ANTHROPIC": _fake_anthropic_server,
        "GEMINI": _fake_gemini_server,
    }
    env = _env({k: (f.base_url, f.api_key) for k, f in fakes.items()}, f"sqlite+aiosqlite:///{tmp}/weir.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEIR_ADMIN_TOKEN", ADMIN)
        mp.setenv("WEIR_USAGE_SPOOL", str(tmp / "spool"))
        with serve(create_app(parse_config(CONFIG, env)), free_port()) as url:
            yield url


def _headers(path: str) -> dict[str, str]:
    token = ADMIN if path.startswith(ADMIN_PREFIX) else TENANT_KEY
    return {"authorization": f"Bearer {token}"}


def error_shape(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """Every refusal, declared or not, in the client's error shape with a message that says why."""
    if response.status_code < 400:
        return
    body = response.json()
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    if case.path in ANTHROPIC_PATHS:
        assert body["type"] == "error" and isinstance(error["type"], str), body
    else:
        assert {"message", "type", "param", "code"} <= set(error), body


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation(case: schemathesis.Case, gateway_url: str) -> None:
    response = case.call(base_url=gateway_url, headers=_headers(case.path), timeout=30)
    case.validate_response(response, checks=CHECKS)
    error_shape(None, response, case)
