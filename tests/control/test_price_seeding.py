"""Config prices seeding the admin DB's price catalog (SQLite and PostgreSQL) when two public names
serve one upstream model on one backend: a second name for it (another max_output_tokens, another
tenant group) at the same price starts and bills both names alike; at another price the config is
refused at load, naming both entries, where the gateway crashed at start on the catalog's unique key."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.accounting.catalog import load_catalog, seed_prices
from gateway.accounting.pricing import PriceCatalog, TokenClass, price_usage
from gateway.admin.control_plane import config_prices
from gateway.app import create_app
from gateway.config import ConfigError, parse_config
from gateway.db import migrate
from gateway.db.session import create_engine, sessionmaker
from gateway.usage import Usage
from tests.fakes import FakeOpenAI
from tests.fixtures.db import premigrated, sync_exec
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


# A model's price as the config first says it (Claude-like: cache reads at 0.1x input, 5-minute writes
# at 1.25x, 1-hour writes at 2x, searches at $10 per 1,000), then with the cache prices, the search
# price, flex's cache-read price and the whole priority tier taken out.
SEEDED_ONCE = """\
backends: [{name: b, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}]
models:
  - name: m
    backend: b
    price: {input: 3, cached_input: 0.30, cache_write_5m: 3.75, cache_write_1h: 6, output: 15,
            web_search_per_1k: 10,
            tiers: {flex: {input: 1.5, cached_input: 0.15, output: 7.5}, priority: {input: 6, output: 30}}}
"""
TAKEN_OUT = """\
backends: [{name: b, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}]
models:
  - name: m
    backend: b
    price: {input: 3, output: 15, tiers: {flex: {input: 1.5, output: 7.5}}}
"""
USAGE = Usage(
    input_tokens=1000,
    cached_input_tokens=10_000,
    cache_write_5m_tokens=2000,
    cache_write_1h_tokens=3000,
    output_tokens=100,
    web_search_requests=2,
)


def pico(prices_usd: dict[str, str]) -> int:
    """USAGE's cost at these USD prices (per 1M tokens; per 1,000 for searches), in pico-USD."""
    amounts = {
        "input": USAGE.input_tokens,
        "cached_input": USAGE.cached_input_tokens,
        "cache_write_5m": USAGE.cache_write_5m_tokens,
        "cache_write_1h": USAGE.cache_write_1h_tokens,
        "output": USAGE.output_tokens,
    }
    cost = sum(Decimal(prices_usd[c]) * n for c, n in amounts.items()) * 10**6
    return int(
        cost + Decimal(prices_usd.get("web_search_per_1k", "0")) * 1000 * USAGE.web_search_requests * 10**6
    )


async def test_a_price_taken_out_of_the_config_bills_as_the_config_now_says(
    db_url: str, tmp_path: Path
) -> None:
    """Seeding added rows only for the prices the config sets, and catalog rows are never removed: a
    cache price, the search price or a service tier taken out of the config billed on at the price
    last seeded, for ever (cache reads at 0.30 where the config now bills them at the input price,
    searches at $10 per 1,000 where it bills none). Each now gets a row at the price its class falls
    back to, as the config alone would bill it; history keeps the old rows."""
    await migrate.upgrade_async(premigrated(db_url))
    engine = create_engine(db_url)
    sessions = sessionmaker(engine)
    first, then = dt.datetime(2026, 11, 1, tzinfo=dt.UTC), dt.datetime(2026, 11, 15, tzinfo=dt.UTC)
    env = {"DB_URL": db_url}
    try:
        for config, at in ((SEEDED_ONCE, first), (TAKEN_OUT, then)):
            rows = config_prices(parse_config(config, env).models, at)
            async with sessions() as session, session.begin():
                await seed_prices(session, rows, at)
        async with sessions() as session, session.begin():
            assert await seed_prices(session, rows, then + dt.timedelta(days=1)) == 0  # unchanged: nothing
            catalog = await load_catalog(session)
    finally:
        await engine.dispose()

    def billed(at: dt.datetime, tier: str | None) -> int:
        return price_usage(USAGE, catalog.prices_at("b", "m", at, tier)).cost_pico_usd

    before = {
        "input": "3",
        "cached_input": "0.30",
        "cache_write_5m": "3.75",
        "cache_write_1h": "6",
        "output": "15",
    }
    searches = {"web_search_per_1k": "10"}
    assert billed(first, None) == pico(before | searches)
    assert billed(first, "flex") == pico(
        before | searches | {"input": "1.5", "cached_input": "0.15", "output": "7.5"}
    )
    assert billed(first, "priority") == pico(before | searches | {"input": "6", "output": "30"})
    # Every class at the input price (the base's, or flex's own), searches free, priority at the base.
    base = dict.fromkeys(("input", "cached_input", "cache_write_5m", "cache_write_1h"), "3") | {
        "output": "15"
    }
    flex = dict.fromkeys(base, "1.5") | {"output": "7.5"}
    later = then + dt.timedelta(hours=1)
    assert billed(later, None) == pico(base)
    assert billed(later, "flex") == pico(flex)
    assert billed(later, "priority") == pico(base)


FIRST, THEN = dt.datetime(2026, 11, 1, tzinfo=dt.UTC), dt.datetime(2026, 11, 15, tzinfo=dt.UTC)


async def _seeded_for_anthropic(db_url: str, seeded_once: str) -> PriceCatalog:
    """The catalog after `seeded_once` is seeded at FIRST and TAKEN_OUT at THEN, both with the backend
    made an Anthropic one."""
    await migrate.upgrade_async(premigrated(db_url))
    engine = create_engine(db_url)
    sessions = sessionmaker(engine)
    try:
        for config, at in ((seeded_once, FIRST), (TAKEN_OUT, THEN)):
            config = config.replace("type: openai", "type: anthropic")
            rows = config_prices(parse_config(config, {"DB_URL": db_url}).models, at)
            async with sessions() as session, session.begin():
                await seed_prices(session, rows, at, {"b": "anthropic"})
        async with sessions() as session:
            return await load_catalog(session)
    finally:
        await engine.dispose()


async def test_a_cache_write_price_taken_out_for_an_anthropic_model_seeds_anthropic_s_rule(
    db_url: str, tmp_path: Path
) -> None:
    """A cache-write price taken out of an Anthropic model's config seeded a row at the generic
    fallback (the input price), which then billed 1-hour writes at half what Anthropic bills, where
    the config alone bills them at 2x the input price: the row is seeded at Anthropic's rule (5-minute
    writes at 1.25x, 1-hour at 2x the input price; the tier's own input price for a tier)."""
    catalog = await _seeded_for_anthropic(db_url, SEEDED_ONCE)
    later = THEN + dt.timedelta(hours=1)
    writes = (TokenClass.CACHE_WRITE_5M, TokenClass.CACHE_WRITE_1H)
    assert [catalog.prices_at("b", "m", later, None)[c] for c in writes] == [3_750_000, 6_000_000]
    assert [catalog.prices_at("b", "m", later, "flex")[c] for c in writes] == [1_875_000, 3_000_000]


async def test_a_cache_read_price_taken_out_for_an_anthropic_model_seeds_a_tenth_of_input(
    db_url: str, tmp_path: Path
) -> None:
    """A cache-read price taken out of an Anthropic model's config seeded a row at the generic
    fallback (the input price), which then billed every cache read at 10x what Anthropic bills, where
    the config alone bills them at 0.1x the input price: the row is seeded at that rule (the tier's
    own input price for a tier)."""
    seeded_once = SEEDED_ONCE.replace("cached_input: 0.30", "cached_input: 0.9").replace(
        "cached_input: 0.15", "cached_input: 0.6"
    )
    catalog = await _seeded_for_anthropic(db_url, seeded_once)
    later = THEN + dt.timedelta(hours=1)
    assert catalog.prices_at("b", "m", FIRST, None)[TokenClass.CACHED_INPUT] == 900_000
    assert catalog.prices_at("b", "m", later, None)[TokenClass.CACHED_INPUT] == 300_000
    assert catalog.prices_at("b", "m", later, "flex")[TokenClass.CACHED_INPUT] == 150_000
