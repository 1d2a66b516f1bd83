"""Every migration runs up and down on SQLite and PostgreSQL, and the models agree with them."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.db import migrate
from gateway.db.models import Base
from tests.fixtures.db import sync_exec
from weir.cli import main

T = TypeVar("T")


def _tables(url: str) -> set[str]:
    if url.startswith("sqlite"):
        rows = sync_exec(url, "SELECT name FROM sqlite_master WHERE type='table'")
    else:
        rows = sync_exec(url, "SELECT tablename FROM pg_tables WHERE schemaname='public'")
    return {r[0] for r in rows}


def _on_connection(url: str, work: Callable[[Connection], T]) -> T:
    async def run() -> T:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(work)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _diff(url: str) -> list:
    """What autogenerate would write to bring the database to the models: types, and on PostgreSQL
    server defaults too (alembic's SQLite comparison takes the default '' for a change: it is not)."""
    opts = {"compare_type": True, "compare_server_default": url.startswith("postgresql")}
    return _on_connection(
        url, lambda conn: compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
    )


def _schema(url: str) -> dict[str, Any]:
    """Every table's columns (type, nullability, default), indexes (partial ones' conditions too),
    unique, foreign and primary keys, as the database reports them."""

    def read(conn: Connection) -> dict[str, Any]:
        found = inspect(conn)
        schema = {}
        for table in set(found.get_table_names()) - {"alembic_version"}:  # there once upgraded
            columns = [
                (c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                for c in found.get_columns(table)
            ]
            indexes = [
                (
                    i["name"],
                    i["column_names"],
                    i["unique"],
                    sorted((k, str(v)) for k, v in i.get("dialect_options", {}).items()),
                )
                for i in found.get_indexes(table)
            ]
            uniques = [(u["name"], u["column_names"]) for u in found.get_unique_constraints(table)]
            foreign = [
                (f["name"], f["constrained_columns"], f["referred_table"], f["options"])
                for f in found.get_foreign_keys(table)
            ]
            schema[table] = (
                columns,
                sorted(indexes),
                sorted(uniques),
                sorted(foreign),
                found.get_pk_constraint(table),
            )
        return schema

    return _on_connection(url, read)


def test_every_migration_up_and_down(db_url: str) -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config(db_url))
    revisions = [r.revision for r in reversed(list(script.walk_revisions()))]
    assert revisions, "no migrations found"
    before = _schema(db_url)
    for revision in revisions:  # one step at a time, so each upgrade() runs on its own
        migrate.upgrade(db_url, revision)
        assert migrate.current(db_url).startswith(revision)
        after = _schema(db_url)
        # Its downgrade puts back exactly the schema it started from, and it upgrades again.
        migrate.downgrade(db_url, "-1")
        assert _schema(db_url) == before, f"{revision}'s downgrade leaves another schema"
        migrate.upgrade(db_url, revision)
        assert _schema(db_url) == after, f"{revision} upgrades to another schema the second time"
        before = after
    assert set(Base.metadata.tables) <= _tables(db_url)
    assert _diff(db_url) == [], "models and migrations disagree: write a migration"
    for _ in revisions:
        migrate.downgrade(db_url, "-1")
    assert _tables(db_url) <= {"alembic_version"}
    assert migrate.current(db_url) == ""
    migrate.upgrade(db_url)  # and back up again from nothing
    assert set(Base.metadata.tables) <= _tables(db_url)


def test_cli_upgrade_current_downgrade(sqlite_url: str) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["db", "upgrade", "--database-url", sqlite_url])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["db", "current", "--database-url", sqlite_url])
    assert result.exit_code == 0 and "(head)" in result.output
    result = runner.invoke(main, ["db", "downgrade", "--database-url", sqlite_url, "base"])
    assert result.exit_code == 0, result.output
    assert "(empty database)" in runner.invoke(main, ["db", "current", "--database-url", sqlite_url]).output


@pytest.mark.postgres
def test_database_url_from_environment(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_DATABASE_URL", pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    result = CliRunner().invoke(main, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert "tenants" in _tables(pg_url)


_EVENT = (
    "INSERT INTO usage_events (event_id, request_id, attempt, ts, day, tenant_id, key_id, route, backend, "
    "model, input_tokens, cached_input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, output_tokens, "
    "reasoning_tokens, prices, cost_pico_usd, savings_pico_usd, latency_ms, status, fallback) VALUES "
)
_ROLLUP = (
    "INSERT INTO usage_rollups (day, tenant_id, key_id, backend, model, requests, errors, input_tokens, "
    "cached_input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, output_tokens, reasoning_tokens, "
    "cost_pico_usd, savings_pico_usd) VALUES "
)


def test_rollups_count_their_cancelled_attempts_apart_once_upgraded(db_url: str) -> None:
    """Before 0010 the rollups counted 499s (hedges that lost, clients that left) as errors; the
    upgrade moves each group's 499s, counted from the ledger, from `errors` to `cancelled` (a missing
    tenant or key is "" in the rollups, NULL in the ledger), and the downgrade puts them back."""
    migrate.upgrade(db_url, "0009")
    statuses = {  # (day, tenant, key) -> the statuses of its attempts
        ("2026-12-01", None, None): [499, 499, 502, 200],
        ("2026-12-01", "t1", "k1"): [499, 200],
        ("2026-12-02", "t1", "k1"): [502],
    }
    events, rollups = [], []
    for (day, tenant, key), tried in statuses.items():
        t, k = (f"'{v}'" if v else "NULL" for v in (tenant, key))
        for status in tried:
            events.append(
                f"('e{len(events)}', 'r{len(events)}', 1, '{day} 12:00:00', '{day}', {t}, {k}, 'm', 'b', "
                f"'m', 0, 0, 0, 0, 0, 0, '{{}}', 0, 0, 1.0, {status}, false)"
            )
        errors = sum(not 200 <= s < 400 for s in tried)  # as the writer counted them before 0010
        rollups.append(
            f"('{day}', '{tenant or ''}', '{key or ''}', 'b', 'm', {len(tried)}, {errors}, 0, 0, 0, 0, 0, 0, 0, 0)"
        )
    sync_exec(db_url, _EVENT + ", ".join(events))
    sync_exec(db_url, _ROLLUP + ", ".join(rollups))
    query = "SELECT day, tenant_id, requests, errors{} FROM usage_rollups ORDER BY day, tenant_id"

    migrate.upgrade(db_url, "0010")
    got = [(str(day), t, n, e, c) for day, t, n, e, c in sync_exec(db_url, query.format(", cancelled"))]
    assert got == [("2026-12-01", "", 4, 1, 2), ("2026-12-01", "t1", 2, 0, 1), ("2026-12-02", "t1", 1, 1, 0)]

    migrate.downgrade(db_url, "0009")
    got = [(str(day), t, n, e) for day, t, n, e in sync_exec(db_url, query.format(""))]
    assert got == [("2026-12-01", "", 4, 3), ("2026-12-01", "t1", 2, 1), ("2026-12-02", "t1", 1, 1)]


def test_web_searches_count_from_0013_and_their_prices_go_with_a_downgrade(db_url: str) -> None:
    """0013 gives the ledger and the rollups a count of web searches, 0 for what was there; the
    downgrade drops it and the `web_search` prices (and the config's seeding markers for them), which
    the older code's catalog cannot read, and keeps every other price."""
    migrate.upgrade(db_url, "0012")
    sync_exec(
        db_url,
        _EVENT + "('e0', 'r0', 1, '2026-12-01 12:00:00', '2026-12-01', NULL, NULL, 'm', 'b', 'm', "
        "1, 0, 0, 0, 1, 0, '{}', 5, 0, 1.0, 200, false)",
    )
    sync_exec(db_url, _ROLLUP + "('2026-12-01', '', '', 'b', 'm', 1, 0, 1, 0, 0, 0, 1, 0, 5, 0)")
    migrate.upgrade(db_url, "0013")
    for table in ("usage_events", "usage_rollups"):
        assert sync_exec(db_url, f"SELECT web_search_requests, cost_pico_usd FROM {table}") == [(0, 5)]

    prices = "INSERT INTO prices (backend, model, token_class, micro_usd_per_mtok, effective_from, created_at) VALUES "
    at = "'2026-12-01 00:00:00'"
    sync_exec(
        db_url,
        prices
        + f"('b', 'm', 'input', 3000000, {at}, {at}), ('b', 'm', 'web_search', 10000000000, {at}, {at})",
    )
    sync_exec(
        db_url,
        "INSERT INTO settings (key, value) VALUES ('config_price:b:m:input', '3000000'), "
        "('config_price:b:m:web_search', '10000000000'), ('config_price:b:web_search:output', '1')",
    )
    migrate.downgrade(db_url, "0012")
    assert sync_exec(db_url, "SELECT token_class FROM prices") == [("input",)]
    assert sorted(sync_exec(db_url, "SELECT key FROM settings")) == [
        ("config_price:b:m:input",),
        ("config_price:b:web_search:output",),  # a model named web_search keeps its prices
    ]
    with pytest.raises(Exception, match="web_search_requests"):
        sync_exec(db_url, "SELECT web_search_requests FROM usage_rollups")


def test_rollups_count_their_client_requests_once_upgraded(db_url: str) -> None:
    """0014 gives the rollups `client_requests`, the usage report's `requests` over whole days; the
    rows already there get theirs from the ledger: each group's first attempts (attempt 1: a retry,
    failover or hedge is a later one), a missing tenant or key "" in the rollups and NULL in the
    ledger, a group whose requests all started elsewhere 0. The downgrade drops it."""
    migrate.upgrade(db_url, "0013")
    attempts = {  # (day, tenant, key, backend) -> the attempt numbers of its events
        ("2026-12-01", None, None, "b"): [1, 2, 1, 1],
        ("2026-12-01", "t1", "k1", "b"): [1, 3],
        ("2026-12-01", "t1", "k1", "fallback"): [2, 2],  # failed over to: no request started here
        ("2026-12-02", "t1", "k1", "b"): [2, 1],  # a retry after midnight, and a request of the day
    }
    events, rollups = [], []
    for (day, tenant, key, backend), numbers in attempts.items():
        t, k = (f"'{v}'" if v else "NULL" for v in (tenant, key))
        for number in numbers:
            events.append(
                f"('e{len(events)}', 'r{len(events)}', {number}, '{day} 12:00:00', '{day}', {t}, {k}, 'm', "
                f"'{backend}', 'm', 0, 0, 0, 0, 0, 0, '{{}}', 0, 0, 1.0, 200, false)"
            )
        rollups.append(
            f"('{day}', '{tenant or ''}', '{key or ''}', '{backend}', 'm', {len(numbers)}, 0, 0, 0, 0, 0, 0, 0, 0, 0)"
        )
    sync_exec(db_url, _EVENT + ", ".join(events))
    sync_exec(db_url, _ROLLUP + ", ".join(rollups))

    migrate.upgrade(db_url, "0014")
    query = "SELECT day, tenant_id, backend, requests, client_requests FROM usage_rollups ORDER BY 1, 2, 3"
    got = [(str(day), *rest) for day, *rest in sync_exec(db_url, query)]
    assert got == [
        ("2026-12-01", "", "b", 4, 3),
        ("2026-12-01", "t1", "b", 2, 1),
        ("2026-12-01", "t1", "fallback", 2, 0),
        ("2026-12-02", "t1", "b", 2, 1),
    ]

    migrate.downgrade(db_url, "0013")
    with pytest.raises(Exception, match="client_requests"):
        sync_exec(db_url, "SELECT client_requests FROM usage_rollups")
    assert sync_exec(db_url, "SELECT sum(requests) FROM usage_rollups") == [(10,)]


def test_weirs_own_calls_are_no_client_requests_once_upgraded(db_url: str) -> None:
    """0015 gives the ledger `purpose`: a comparison's other answer and its judge (routing/compare.py)
    are first attempts of calls Weir made itself, which 0014 counted as client requests. The rows
    already there get theirs from their routing text (`purpose=compare; for=...`), and the rollup
    rows that held one count their client requests again; the downgrade counts them back in."""
    migrate.upgrade(db_url, "0014")
    client = "route=auto; policy=difficulty; candidate={}; p_strong=0.1"
    own = "route=auto; policy=difficulty; candidate={}; purpose={}; for=r0"
    attempts = {  # (backend, model) -> (attempt, routing) of its events, all of tenant t1's day
        ("openai", "gpt-4o-mini"): [(1, client.format("gpt-4o-mini"))],  # the compared request
        ("openai", "gpt-4o"): [
            (1, own.format("gpt-4o", "compare")),  # its other answer
            (1, client.format("gpt-4o")),  # a client's request that failed and was retried
            (2, client.format("gpt-4o")),
        ],
        ("anthropic", "claude"): [(1, own.format("claude", "judge"))] * 2,  # both orders
        ("openai", "o3"): [(1, None)],  # no routing: a client's
    }
    events, rollups = [], []
    for (backend, model), tried in attempts.items():
        for number, routing in tried:
            text = f"'{routing}'" if routing else "NULL"
            events.append(
                f"('e{len(events)}', 'r{len(events)}', {number}, '2026-12-01 12:00:00', '2026-12-01', 't1', "
                f"'k1', 'auto', '{backend}', '{model}', 0, 0, 0, 0, 0, 0, '{{}}', 5, 0, 1.0, 200, false, {text})"
            )
        first = sum(number == 1 for number, _ in tried)  # as 0014's code counted them
        rollups.append(
            f"('2026-12-01', 't1', 'k1', '{backend}', '{model}', {len(tried)}, 0, 0, 0, 0, 0, 0, 0, "
            f"{5 * len(tried)}, 0, {first})"
        )
    sync_exec(db_url, _EVENT.replace("fallback) VALUES", "fallback, routing) VALUES") + ", ".join(events))
    sync_exec(db_url, _ROLLUP.replace(") VALUES", ", client_requests) VALUES") + ", ".join(rollups))
    query = "SELECT backend, model, requests, client_requests, cost_pico_usd FROM usage_rollups ORDER BY 1, 2"
    before = [
        ("anthropic", "claude", 2, 2, 10),
        ("openai", "gpt-4o", 3, 2, 15),
        ("openai", "gpt-4o-mini", 1, 1, 5),
        ("openai", "o3", 1, 1, 5),
    ]
    assert sync_exec(db_url, query) == before

    migrate.upgrade(db_url, "0015")
    purposes = sync_exec(db_url, "SELECT event_id, purpose FROM usage_events WHERE purpose IS NOT NULL")
    assert sorted(purposes) == [("e1", "compare"), ("e4", "judge"), ("e5", "judge")]
    assert sync_exec(db_url, query) == [  # attempts and cost as they were
        ("anthropic", "claude", 2, 0, 10),
        ("openai", "gpt-4o", 3, 1, 15),
        ("openai", "gpt-4o-mini", 1, 1, 5),
        ("openai", "o3", 1, 1, 5),
    ]

    migrate.downgrade(db_url, "0014")
    with pytest.raises(Exception, match="purpose"):
        sync_exec(db_url, "SELECT purpose FROM usage_events")
    assert sync_exec(db_url, query) == before


def test_the_route_rollups_are_filled_from_the_ledger_once_upgraded(db_url: str) -> None:
    """0018 adds usage_route_rollups, the usage report's rollups for `group_by=route` over whole
    days, and fills them from the events already in the ledger, summed as the writer sums them:
    attempts, failed ones and 499s apart, client requests (first attempts of no call Weir made
    itself), amounts; a missing tenant or key as "". The downgrade drops the table."""
    migrate.upgrade(db_url, "0017")
    events = [  # (day, tenant, route, backend, attempt, status, purpose, cost)
        ("2026-12-01", "t1", "auto", "b", 1, 200, None, 5),
        ("2026-12-01", "t1", "auto", "b", 2, 502, None, 7),
        ("2026-12-01", "t1", "auto", "b", 1, 499, "compare", 11),
        ("2026-12-01", "t1", "m", "b", 1, 200, None, 13),
        ("2026-12-02", None, "auto", "c", 1, 200, None, 17),
    ]
    rows = []
    for i, (day, tenant, route, backend, attempt, status, purpose, cost) in enumerate(events):
        t, p = (f"'{v}'" if v else "NULL" for v in (tenant, purpose))
        rows.append(
            f"('e{i}', 'r{i}', {attempt}, '{day} 12:00:00', '{day}', {t}, NULL, '{route}', '{backend}', 'm', "
            f"{i}, 0, 0, 0, 1, 0, '{{}}', {cost}, 0, 1.0, {status}, false, {p})"
        )
    sync_exec(db_url, _EVENT.replace("fallback) VALUES", "fallback, purpose) VALUES") + ", ".join(rows))

    migrate.upgrade(db_url, "0018")
    query = (
        "SELECT day, tenant_id, key_id, route, backend, requests, errors, cancelled, client_requests, "
        "input_tokens, output_tokens, cost_pico_usd FROM usage_route_rollups ORDER BY 1, 2, 4, 5"
    )
    got = [(str(day), *rest) for day, *rest in sync_exec(db_url, query)]
    assert got == [
        ("2026-12-01", "t1", "", "auto", "b", 3, 1, 1, 1, 0 + 1 + 2, 3, 5 + 7 + 11),
        ("2026-12-01", "t1", "", "m", "b", 1, 0, 0, 1, 3, 1, 13),
        ("2026-12-02", "", "", "auto", "c", 1, 0, 0, 1, 4, 1, 17),
    ]

    migrate.downgrade(db_url, "0017")
    assert "usage_route_rollups" not in _tables(db_url)


@pytest.mark.postgres
def test_the_rollups_ids_are_bigint_from_0019_and_integer_again_below(pg_url: str) -> None:
    """The writer's upserts take a number from the rollups' id sequences per group and batch, updates
    too (test_usage_pipeline: `..._do_not_run_out_of_row_ids_...`): 0019 gives the columns and their
    sequences bigint, the downgrade integer again."""
    query = (
        "SELECT c.relname, format_type(a.atttypid, a.atttypmod), s.seqtypid::regtype::text "
        "FROM pg_sequence s JOIN pg_depend d ON d.objid = s.seqrelid "
        "JOIN pg_class c ON c.oid = d.refobjid JOIN pg_attribute a ON a.attrelid = c.oid "
        "AND a.attnum = d.refobjsubid WHERE c.relname LIKE 'usage%rollups' ORDER BY 1"
    )
    migrate.upgrade(pg_url, "0019")
    sync_exec(
        pg_url,
        "INSERT INTO usage_rollups (day, tenant_id, key_id, backend, model, requests, errors, "
        "input_tokens, cached_input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, output_tokens, "
        "reasoning_tokens, cost_pico_usd, savings_pico_usd) "
        "VALUES ('2026-12-01', '', '', 'b', 'm', 1, 0, 0, 0, 0, 0, 0, 0, 5, 0)",
    )
    tables = ("usage_rollups", "usage_route_rollups")
    assert sync_exec(pg_url, query) == [(t, "bigint", "bigint") for t in tables]
    migrate.downgrade(pg_url, "0018")
    assert sync_exec(pg_url, query) == [(t, "integer", "integer") for t in tables]
    assert sync_exec(pg_url, "SELECT id, cost_pico_usd FROM usage_rollups") == [(1, 5)]


def test_0019_writes_its_sql_offline_for_postgres() -> None:
    """`alembic upgrade --sql` (a DBA applying the SQL by hand) writes 0019 too: it names the sequences
    in SQL instead of asking the database, which there is none to ask."""
    out = io.StringIO()
    config = migrate.alembic_config("postgresql://weir@db.invalid/weir", stdout=out)
    config.output_buffer = out
    command.upgrade(config, "0018:0019", sql=True)
    assert "ALTER TABLE usage_route_rollups ALTER COLUMN id TYPE BIGINT" in out.getvalue()
    assert "pg_get_serial_sequence('usage_rollups', 'id')" in out.getvalue()
