"""Report queries: usage and cost per tenant/model/backend/day/key, and uptime.

Usage reports read the daily rollups when the range is whole UTC days, and the raw ledger otherwise;
both have the same columns, so it is one query either way.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from sqlalchemy import ColumnElement, Integer, and_, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.accounting.events import CANCELLED, FIRST_ATTEMPT
from gateway.accounting.money import format_usd, pico_to_usd
from gateway.db.models import ApiKey, Tenant, UptimeSample, UsageEventRow, UsageRollup
from gateway.usage import TOKEN_FIELDS as TOKEN_COLUMNS

GROUPS = {
    "tenant": "tenant_id",
    "key": "key_id",
    "model": "model",
    "backend": "backend",
    "day": "day",
    "service_tier": "service_tier",  # the tier each attempt was served and priced at
}
# Groups the daily rollups do not keep: a report grouped by one reads the ledger, whatever its range.
LEDGER_ONLY_GROUPS = frozenset({"service_tier"})
# A key's row also says which key it is as the keys list shows it (its id is shown nowhere else):
# its name and prefix, null for a config file's key.
KEY_LABELS = ("key_name", "key_prefix")
CSV_COLUMNS = (
    *GROUPS,
    "tenant_name",
    *KEY_LABELS,
    "requests",
    "attempts",
    "errors",
    "cancelled",
    "input_tokens",
    "cached_input_tokens",
    "cache_write_tokens",
    "cache_write_5m_tokens",
    "cache_write_1h_tokens",
    "output_tokens",
    "reasoning_tokens",
    "total_tokens",
    "web_search_requests",
    "cost_usd",
    "cost_per_1m_tokens",
    "cache_hit_ratio",
    "cache_savings_usd",
)
SIX_PLACES = Decimal("0.000001")
MONEY_COLUMNS = ("cost_pico_usd", "savings_pico_usd")
# The ledger's columns that tell a request's attempts from another's (the uptime report's requests,
# the admin request log): a client's x-request-id may name many requests, of many tenants, each told
# apart by the gateway's own id of its exchange (`exchange_id`, set only for a client's id).
REQUEST_KEY = (UsageEventRow.tenant_id, UsageEventRow.request_id, UsageEventRow.exchange_id)
# Client requests (each once, in the group of its first attempt), then attempts: all, failed,
# cancelled (499: no error).
COUNT_COLUMNS = ("requests", "attempts", "errors", "cancelled")
# SQLite's sum() of integers fails past 2^63 ("integer overflow": $9.2M in pico-dollars, in reach of
# a long range's report) where PostgreSQL's sums as a numeric. Money is summed as two parts, the
# quotient and the remainder by 2^32, each under 2^32 in size (so their sums stay exact up to 2^31
# rows a group), and joined exactly in Python.
_SPLIT = 2**32


def split_sum(column: Any) -> tuple[ColumnElement[Any], ColumnElement[Any]]:
    """The sum of an integer money column as two sums, to be joined by `joined_sum`."""
    # Integer division and remainder truncate alike in both databases: quotient x 2^32 + remainder
    # is the value, negative ones (savings, where cache reads cost more) too.
    return func.sum(column // _SPLIT), func.sum(column % _SPLIT)


def joined_sum(high: int | Decimal | None, low: int | Decimal | None) -> int:
    """The exact sum `split_sum` read in two parts (None: no rows)."""
    return int(high or 0) * _SPLIT + int(low or 0)


def _whole_days(start: dt.datetime, end: dt.datetime) -> bool:
    return all(t.time() == dt.time(0) for t in (start, end))


def parse_group_by(text: str | None) -> list[str]:
    names = [n.strip() for n in (text or "tenant").split(",") if n.strip()]
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise ValueError(f"cannot group by {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    return list(dict.fromkeys(names))


async def usage_report(
    session: AsyncSession, start: dt.datetime, end: dt.datetime, group_by: list[str]
) -> dict[str, Any]:
    # Sums of the rollups' counts, or counts of ledger rows.
    requests: ColumnElement[int]
    attempts: ColumnElement[int]
    if _whole_days(start, end) and not LEDGER_ONLY_GROUPS.intersection(group_by):
        table: Any = UsageRollup
        where = and_(UsageRollup.day >= start.date(), UsageRollup.day < end.date())
        requests, attempts = func.sum(UsageRollup.client_requests), func.sum(UsageRollup.requests)
        errors, cancelled = func.sum(UsageRollup.errors), func.sum(UsageRollup.cancelled)
    else:
        table = UsageEventRow
        where = and_(UsageEventRow.ts >= start, UsageEventRow.ts < end)
        # As the writer counts them into the rollups: a client request is its first attempt (one
        # per request, so no DISTINCT over the range; Weir's own calls are none:
        # `events.starts_client_request`), and a 499 is cancelled, no error (`events.is_error`).
        starts_request = and_(UsageEventRow.attempt == FIRST_ATTEMPT, UsageEventRow.purpose.is_(None))
        requests = func.sum(case((starts_request, 1), else_=0))
        attempts = func.count()
        status = UsageEventRow.status
        errors = func.sum(case((and_(status >= 200, status < 400), 0), (status == CANCELLED, 0), else_=1))
        cancelled = func.sum(case((status == CANCELLED, 1), else_=0))
    dims = [getattr(table, GROUPS[name]).label(name) for name in group_by]
    sums = [func.sum(getattr(table, c)).label(c) for c in TOKEN_COLUMNS]
    for c in MONEY_COLUMNS:
        high, low = split_sum(getattr(table, c))
        sums += [high.label(f"{c}_high"), low.label(f"{c}_low")]
    counts = [
        requests.label("requests"),
        attempts.label("attempts"),
        errors.label("errors"),
        cancelled.label("cancelled"),
    ]
    query = select(*dims, *counts, *sums).where(where)
    if dims:
        query = query.group_by(*dims).order_by(*dims)
    raw = [dict(r._mapping) for r in await session.execute(query)]
    raw = [r for r in raw if r["attempts"]]  # an empty range sums to one row of NULLs
    for r in raw:
        for c in MONEY_COLUMNS:
            r[c] = joined_sum(r.pop(f"{c}_high"), r.pop(f"{c}_low"))
    names: dict[str, str] = {}
    if "tenant" in group_by:
        names = dict((await session.execute(select(Tenant.id, Tenant.name))).tuples().all())
    rows = [_finish(r, group_by, names) for r in raw]
    if "key" in group_by:
        await _label_keys(session, rows)
    # Each request is in one row (its first attempt's), so the rows add up to the totals.
    summed = {k: sum(int(r[k] or 0) for r in raw) for k in (*COUNT_COLUMNS, *TOKEN_COLUMNS, *MONEY_COLUMNS)}
    totals = _finish(summed, [], {})
    return {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "group_by": group_by,
        "source": "rollups" if table is UsageRollup else "events",
        "rows": rows,
        "totals": totals,
    }


def _finish(raw: dict[str, Any], group_by: list[str], names: dict[str, str]) -> dict[str, Any]:
    n = {k: int(raw.get(k) or 0) for k in (*COUNT_COLUMNS, *TOKEN_COLUMNS, *MONEY_COLUMNS)}
    row: dict[str, Any] = {}
    for name in group_by:
        value = raw[name]
        row[name] = value.isoformat() if isinstance(value, dt.date) else (value or None)
    if "tenant" in group_by:
        row["tenant_name"] = names.get(row["tenant"] or "")
    cache_writes = n["cache_write_5m_tokens"] + n["cache_write_1h_tokens"]
    prompt = n["input_tokens"] + n["cached_input_tokens"] + cache_writes
    total = prompt + n["output_tokens"]
    cost = pico_to_usd(n["cost_pico_usd"])
    row.update(
        requests=n["requests"],
        attempts=n["attempts"],
        errors=n["errors"],
        cancelled=n["cancelled"],
        input_tokens=n["input_tokens"],
        cached_input_tokens=n["cached_input_tokens"],
        cache_write_tokens=cache_writes,
        cache_write_5m_tokens=n["cache_write_5m_tokens"],
        cache_write_1h_tokens=n["cache_write_1h_tokens"],
        output_tokens=n["output_tokens"],
        reasoning_tokens=n["reasoning_tokens"],
        total_tokens=total,
        # Anthropic web searches, billed per search: in `cost_usd`, which is not all tokens' then.
        web_search_requests=n["web_search_requests"],
        # USD amounts are strings: exact decimals that no JSON parser turns into floats.
        cost_usd=format_usd(cost),
        cost_per_1m_tokens=format_usd((cost * 1_000_000 / total).quantize(SIX_PLACES, ROUND_HALF_EVEN))
        if total
        else None,
        cache_hit_ratio=float((Decimal(n["cached_input_tokens"]) / prompt).quantize(SIX_PLACES))
        if prompt
        else None,
        cache_savings_usd=format_usd(pico_to_usd(n["savings_pico_usd"])),
    )
    return row


async def _label_keys(session: AsyncSession, rows: list[dict[str, Any]]) -> None:
    """Each row's `key_name` and `key_prefix` (KEY_LABELS), from the admin DB's keys."""
    ids = {row["key"] for row in rows if row["key"]}
    found = await session.execute(
        select(ApiKey.id, ApiKey.name, ApiKey.prefix).where(ApiKey.id.in_(sorted(ids)))
    )
    labels = {key_id: (name, prefix) for key_id, name, prefix in found}
    for row in rows:
        row["key_name"], row["key_prefix"] = labels.get(row["key"] or "", (None, None))


def usage_csv(report: dict[str, Any]) -> str:
    columns = [c for c in CSV_COLUMNS if c not in GROUPS or c in report["group_by"]]
    if "tenant" not in report["group_by"]:
        columns.remove("tenant_name")
    if "key" not in report["group_by"]:
        columns = [c for c in columns if c not in KEY_LABELS]
    out = io.StringIO()
    # Plain RFC 4180 with CRLF line ends: what spreadsheets expect. Empty cells for missing values.
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\r\n")
    writer.writeheader()
    for row in report["rows"]:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return out.getvalue()


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 6) if whole else None


async def uptime_report(session: AsyncSession, start: dt.datetime, end: dt.datetime) -> dict[str, Any]:
    ok_attempt = case((and_(UsageEventRow.status >= 200, UsageEventRow.status < 400), 1), else_=0)
    # Cancelled (499: a hedge race's loser the gateway stopped, or a client that left): it says nothing
    # of its backend's availability, as the breakers take no verdict from it. Counted as a failure, a
    # backend a little slower than its hedge partner read as down whenever it lost the race.
    cancelled = case((UsageEventRow.status == CANCELLED, 1), else_=0)
    in_range = and_(UsageEventRow.ts >= start, UsageEventRow.ts < end)
    probes = {
        backend: (int(total), int(ok or 0))
        for backend, total, ok in await session.execute(
            select(UptimeSample.backend, func.count(), func.sum(UptimeSample.ok.cast(Integer)))
            .where(UptimeSample.ts >= start, UptimeSample.ts < end)
            .group_by(UptimeSample.backend)
        )
    }
    attempts = {
        backend: (int(total), int(ok or 0), int(stopped or 0))
        for backend, total, ok, stopped in await session.execute(
            select(UsageEventRow.backend, func.count(), func.sum(ok_attempt), func.sum(cancelled))
            .where(in_range)
            .group_by(UsageEventRow.backend)
        )
    }
    backends = []
    for backend in sorted(set(probes) | set(attempts)):
        p_total, p_ok = probes.get(backend, (0, 0))
        a_total, a_ok, a_cancelled = attempts.get(backend, (0, 0, 0))
        backends.append(
            {
                "backend": backend,
                "probes": p_total,
                "probes_ok": p_ok,
                "probe_availability": _ratio(p_ok, p_total),
                "attempts": a_total,
                "attempts_ok": a_ok,
                "attempts_cancelled": a_cancelled,
                "request_availability": _ratio(a_ok, a_total - a_cancelled),
            }
        )
    # A request succeeded if any of its attempts did (after retries and fallbacks).
    per_request = (
        select(*REQUEST_KEY, func.max(ok_attempt).label("ok"))
        .where(in_range)
        .group_by(*REQUEST_KEY)
        .subquery()
    )
    tenants = [
        {
            "tenant": tenant,
            "requests": int(total),
            "succeeded": int(ok or 0),
            "success_ratio": _ratio(int(ok or 0), int(total)),
        }
        for tenant, total, ok in await session.execute(
            select(per_request.c.tenant_id, func.count(), func.sum(per_request.c.ok))
            .group_by(per_request.c.tenant_id)
            .order_by(per_request.c.tenant_id)
        )
    ]
    return {"start": start.isoformat(), "end": end.isoformat(), "backends": backends, "tenants": tenants}
