"""Config prices seeding the admin DB's price catalog (SQLite and PostgreSQL) when two public names
serve one upstream model on one backend: a second name for it (another max_output_tokens, another
tenant group) at the same price starts and bills both names alike; at another price the config is
refused at load, naming both entries, where the gateway crashed at start on the catalog's unique key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.config import ConfigError, parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.db import sync_exec
from tests.fixtures.gateway import CONFIG, PRICE, Weir
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

SHORT = "  - {name: mini-short, backend: openai, model: gpt-4o-mini, max_output_tokens: 64, price: %s}\n"
SAME_PRICE = CONFIG.replace(
    "models:\n", "models:\n" + SHORT % "{input: 0.150, cached_input: 0.075, output: 0.6}", 1
)
OTHER_PRICE = CONFIG.replace("models:\n", "models:\n" + SHORT % "{input: 0.30, output: 1.20}", 1)


@pytest.mark.parametrize("weir_config", [SAME_PRICE])
def test_two_names_for_one_upstream_model_at_one_price_start_and_bill_alike(weir: Weir) -> None:
    tenant_id, _, key = weir.tenant_with_key("acme")
    client = weir.client(key)
    for name in ("gpt-4o-mini", "mini-short"):
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello"}])
    rows = weir.ledger(tenant_id, expect=2)
    assert len(rows) == 2 and rows[0][:4] == rows[1][:4] and rows[0][3] > 0

    # One price per token class for the upstream model, as both entries set it.
    catalog = sync_exec(
        weir.db_url, "SELECT token_class, micro_usd_per_mtok FROM prices WHERE model = 'gpt-4o-mini'"
    )
    micro = {c: int(usd * 10**6) for c, usd in PRICE.items()}
    assert sorted(catalog) == sorted(micro.items())


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_names_for_one_upstream_model_at_different_prices_are_refused_at_load(
    db: str,
    request: pytest.FixtureRequest,
    fake_openai: FakeOpenAI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    db_url = request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url")
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": db_url}
    with (
        pytest.raises(ConfigError) as refused,
        serve(create_app(parse_config(OTHER_PRICE, env)), free_port()),
    ):
        pass
    assert str(refused.value).startswith(
        "models[1].price: 'gpt-4o-mini' and models[0] 'mini-short' both serve 'gpt-4o-mini' on "
        "backend 'openai' at different prices"
    )
