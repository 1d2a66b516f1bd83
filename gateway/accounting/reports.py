"""Report queries: usage and cost per tenant/model/backend/day/key, and uptime.

Usage reports read the daily rollups when the range is whole UTC days, and the raw ledger otherwise;
both have the same columns, so it is one query either way.
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import io
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Integer,
    Select,
    and_,
    bindparam,
    case,
    func,
    select,
    text,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from gateway.accounting.events import (
    ANSWERED_RETRY_SQL,
    CANCELLED,
    STARTS_CLIENT_REQUEST_SQL,
    UNANSWERED_START_SQL,
)
from gateway.accounting.money import format_usd, pico_to_usd
from gateway.db.models import ApiKey, Tenant, UptimeSample, UsageEventRow, UsageRollup, UsageRouteRollup
from gateway.usage import TOKEN_FIELDS as TOKEN_COLUMNS

GROUPS = {
    "tenant": "tenant_id",
    "key": "key_id",
    "model": "model",
    "backend": "backend",
    "day": "day",
    "service_tier": "service_tier",  # the tier each attempt was served and priced at
    "route": "route",  # the public name the request asked for (a route, or a model by its name)
}
# Groups the daily rollups do not keep: a report grouped by one reads the ledger, whatever its range.
LEDGER_ONLY_GROUPS = frozenset({"service_tier"})
# Groups that only the route rollups keep (usage_route_rollups): a whole-day report grouped by one
# reads them instead of usage_rollups.
ROUTE_ROLLUP_GROUPS = frozenset({"route"})
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
# The ledger's columns that tell a request's attempts from another's (the admin request log; the
# uptime report's look-up of an unanswered request's later attempts): a client's x-request-id may name
# many requests, of many tenants, each told apart by the gateway's own id of its exchange
# (`exchange_id`, set only for a client's id).
REQUEST_KEY = (UsageEventRow.tenant_id, UsageEventRow.request_id, UsageEventRow.exchange_id)
# Client requests (each once, in the group of its first attempt), then attempts: all, failed,
# cancelled (499: no error).
COUNT_COLUMNS = ("requests", "attempts", "errors", "cancelled")
_Query = Select[*tuple[Any, ...]]  # a report's query, whatever its columns
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
        table: Any = UsageRouteRollup if ROUTE_ROLLUP_GROUPS.intersection(group_by) else UsageRollup
        where = and_(table.day >= start.date(), table.day < end.date())
        requests, attempts = func.sum(table.client_requests), func.sum(table.requests)
        errors, cancelled = func.sum(table.errors), func.sum(table.cancelled)
    else:
        table = UsageEventRow
        where = and_(UsageEventRow.ts >= start, UsageEventRow.ts < end)
        # As the writer counts them into the rollups: a client request is its first attempt (one
        # per request, so no DISTINCT over the range; Weir's own calls are none:
        # `events.starts_client_request`), and a 499 is cancelled, no error (`events.is_error`).
        requests = func.sum(case((text(STARTS_CLIENT_REQUEST_SQL), 1), else_=0))
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
        # A missing tenant or key is "" in the rollups, NULL in the ledger: NULLs first, as "" sorts
        # (PostgreSQL sorts them last), so both paths list the rows in one order on either database.
        query = query.group_by(*dims).order_by(*(d.nulls_first() for d in dims))
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
        "source": "events" if table is UsageEventRow else "rollups",
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


# The CSV's text cells: names typed by whoever creates tenants and keys, and model ids. A spreadsheet
# runs a cell that starts with one of FORMULA_STARTS as a formula (CSV injection: `=HYPERLINK(...)`,
# `=cmd|...`); such a cell is written with a leading `'`, which spreadsheets show as text. Numbers
# (a negative saving) are never text cells, so they stay numbers.
TEXT_COLUMNS = frozenset(
    {"tenant", "key", "model", "backend", "service_tier", "route", "tenant_name", *KEY_LABELS}
)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(column: str, value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        # Plain decimal, as written: Python prints 0.000001 as `1e-06`, which finance tools and some
        # spreadsheets read as text or mis-parse. The shortest repr's digits, never an exponent.
        return format(Decimal(repr(value)), "f")
    if column in TEXT_COLUMNS and isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def usage_csv(report: dict[str, Any]) -> str:
    columns = [c for c in CSV_COLUMNS if c not in GROUPS or c in report["group_by"]]
    if "tenant" not in report["group_by"]:
        columns.remove("tenant_name")
    if "key" not in report["group_by"]:
        columns = [c for c in columns if c not in KEY_LABELS]
    out = io.StringIO()
    # Plain RFC 4180 with CRLF line ends: what spreadsheets expect. Empty cells for missing values;
    # no text cell a spreadsheet would run as a formula (`_csv_cell`).
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\r\n")
    writer.writeheader()
    for row in report["rows"]:
        writer.writerow({k: _csv_cell(k, v) for k, v in row.items()})
    return out.getvalue()


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 6) if whole else None


async def uptime_report(session: AsyncSession, start: dt.datetime, end: dt.datetime) -> dict[str, Any]:
    """Per backend, probe and attempt outcomes (every call it answered, Weir's own included); per
    tenant, its own requests (as the usage report counts them: the client requests that started in
    the range) and how many any attempt answered. The counts come from the rollups for the whole days
    in the range and from the ledger for the hours at its edges; of the rest of the ledger only the
    indexed few rows of the requests whose first attempt did not answer: never a month's ledger
    grouped by request."""
    probes = {
        backend: (int(total), int(ok or 0))
        for backend, total, ok in await session.execute(
            select(UptimeSample.backend, func.count(), func.sum(UptimeSample.ok.cast(Integer)))
            .where(UptimeSample.ts >= start, UptimeSample.ts < end)
            .group_by(UptimeSample.backend)
        )
    }
    # (attempts, answered, cancelled) per backend; client requests started per tenant. The rollups
    # keep a missing tenant as "", the ledger as NULL: both are the report's None.
    attempts: dict[str, list[int]] = {}
    started: dict[str | None, int] = {}
    for query in _attempt_counts(start, end):
        for backend, tenant, *counts in await session.execute(query):
            total, answered, cancelled, requests = (int(n or 0) for n in counts)
            into = attempts.setdefault(backend, [0, 0, 0])
            into[0], into[1], into[2] = into[0] + total, into[1] + answered, into[2] + cancelled
            started[tenant or None] = started.get(tenant or None, 0) + requests
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
    in_range = {"start": start, "end": end}
    unanswered = {
        tenant or None: int(n) for tenant, n in await session.execute(_requests_unanswered(), in_range)
    }
    tenants = []
    for tenant in sorted(started, key=lambda t: (t is not None, t or "")):
        if requests := started[tenant]:  # a tenant with only Weir's own calls in the range has none
            succeeded = requests - unanswered.get(tenant, 0)
            tenants.append(
                {
                    "tenant": tenant,
                    "requests": requests,
                    "succeeded": succeeded,
                    "success_ratio": _ratio(succeeded, requests),
                }
            )
    return {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "backends": backends,
        "tenants": tenants,
    }


def _attempt_counts(start: dt.datetime, end: dt.datetime) -> list[_Query]:
    """Per backend and tenant: attempts (Weir's own calls too: its backend answered them), those that
    answered (2xx/3xx), those cancelled, and the client requests they started; from the rollups for
    the range's whole UTC days (the writer counts them as this counts the ledger) and from the ledger
    for the hours before and after them. Cancelled (499: a hedge race's loser the gateway stopped, or
    a client that left) says nothing of a backend's availability, as the breakers take no verdict
    from it; counted as a failure, a backend a little slower than its hedge partner read as down
    whenever it lost the race."""
    first = dt.datetime.combine(start.date(), dt.time(0), start.tzinfo)
    first += dt.timedelta(days=0 if first == start else 1)
    last = dt.datetime.combine(end.date(), dt.time(0), end.tzinfo)
    if first >= last:  # no whole day in the range
        return [_ledger_counts(start, end)]
    # A rollup's `requests` are its attempts, `errors` those neither answered nor cancelled.
    r = UsageRollup
    rollups = (
        select(
            r.backend,
            r.tenant_id,
            func.sum(r.requests),
            func.sum(r.requests - r.errors - r.cancelled),
            func.sum(r.cancelled),
            func.sum(r.client_requests),
        )
        .where(r.day >= first.date(), r.day < last.date())
        .group_by(r.backend, r.tenant_id)
    )
    edges = [_ledger_counts(lo, hi) for lo, hi in ((start, first), (last, end)) if lo < hi]
    return [rollups, *edges]


def _ledger_counts(start: dt.datetime, end: dt.datetime) -> _Query:
    """`_attempt_counts` of the ledger's attempts in a range."""
    e = UsageEventRow
    return (
        select(
            e.backend,
            e.tenant_id,
            func.count(),
            func.sum(case((and_(e.status >= 200, e.status < 400), 1), else_=0)),
            func.sum(case((e.status == CANCELLED, 1), else_=0)),
            func.sum(case((text(STARTS_CLIENT_REQUEST_SQL), 1), else_=0)),
        )
        .where(e.ts >= start, e.ts < end)
        .group_by(e.backend, e.tenant_id)
    )


@functools.cache
def _requests_unanswered() -> _Query:
    """Per tenant: its client requests started in the range (`:start`, `:end`) that no attempt
    answered, after retries, failovers and hedges: its first attempts that did not answer, less those
    a later attempt did answer (never before the range: it follows its first). Both are read from
    their partial indexes (`events.UNANSWERED_START_SQL`, `events.ANSWERED_RETRY_SQL`, said word for
    word so that either database uses them): a few rows, where grouping the range by request sorted
    all of it. Built once: an ORM alias costs milliseconds, the whole of a short range's report."""
    e, later = UsageEventRow, aliased(UsageEventRow)
    start: BindParameter[dt.datetime] = bindparam("start")
    end: BindParameter[dt.datetime] = bindparam("end")
    answered_later = (
        select(later.event_id)
        .where(
            later.request_id == e.request_id,
            # A client's x-request-id may name many requests: the tenant and exchange tell them apart.
            later.tenant_id.is_not_distinct_from(e.tenant_id),
            later.exchange_id.is_not_distinct_from(e.exchange_id),
            later.ts >= start,
            # Unqualified, its columns are the subquery's own table's (`later`), the nearest in scope.
            text(ANSWERED_RETRY_SQL),
        )
        .exists()
    )
    return (
        select(e.tenant_id, func.count())
        .where(e.ts >= start, e.ts < end, text(UNANSWERED_START_SQL), ~answered_later)
        .group_by(e.tenant_id)
    )
