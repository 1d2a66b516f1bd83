"""An admin DB as `weir router train` reads and writes it, for the tests of training and installing
difficulty heads: ledger rows of route `auto`'s two models, the route table, the audit log."""

from __future__ import annotations

import asyncio
import datetime as dt

from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from gateway.db.models import AuditLog, RouteRow, UsageEventRow
from gateway.db.session import create_engine as create_async_engine
from gateway.db.session import normalise_url, sessionmaker
from routing.feedback import TenantRoute, tenant_route

# The difficulty route `auto`'s two models, and when their traffic happened.
WEAK, STRONG = "gpt-4o-mini", "claude-sonnet"
NOW = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
# The spec of a difficulty route between them (less its name).
DIFFICULTY = {"policy": "difficulty", "candidates": [{"model": WEAK}, {"model": STRONG}]}


def ledger_row(request_id: str, attempt: int, tenant: str, candidate: str, status: int) -> UsageEventRow:
    """The ledger's row of attempt `attempt` of `request_id`: route `auto`'s `candidate` answered
    the tenant with `status`, at NOW."""
    upstream = {"gpt-4o-mini": "gpt-4o-mini", "claude-sonnet": "claude-sonnet-4-5"}.get(candidate, candidate)
    return UsageEventRow(
        event_id=f"{request_id}-{attempt}",
        request_id=request_id,
        attempt=attempt,
        ts=NOW,
        day=NOW.date(),
        tenant_id=tenant,
        key_id=None,
        route="auto",
        backend="b",
        model=upstream,
        input_tokens=10,
        cached_input_tokens=0,
        cache_write_5m_tokens=0,
        cache_write_1h_tokens=0,
        output_tokens=5,
        reasoning_tokens=0,
        prices={},
        cost_pico_usd=0,
        savings_pico_usd=0,
        latency_ms=10.0,
        ttft_ms=None,
        status=status,
        fallback=attempt > 1,
        routing=f"route=auto; policy=difficulty; candidate={candidate}; score=0.2; attempts={attempt}",
    )


def set_routes(url: str, *specs: dict[str, object]) -> list[int]:
    """Replace the route table with these `auto` routes, in this order; their ids."""
    engine = create_engine(url)
    with Session(engine) as session:
        for row in session.scalars(select(RouteRow)):
            session.delete(row)
        rows = [
            RouteRow(name="auto", position=i, spec={"name": "auto", **spec}) for i, spec in enumerate(specs)
        ]
        session.add_all(rows)
        session.commit()
        ids = [row.id for row in rows]
    engine.dispose()
    return ids


def reached_route(url: str, tenant: str | None) -> TenantRoute:
    """The difficulty route `auto` that `tenant` reaches, as `weir router train` reads it."""

    async def go() -> TenantRoute:
        engine = create_async_engine(normalise_url(url))
        try:
            return await tenant_route(sessionmaker(engine), "auto", tenant)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def audit_rows(url: str) -> list[tuple[str, str, str | None]]:
    """The audit log's (action, entity, entity id), oldest first."""
    engine = create_engine(url)
    with Session(engine) as session:
        rows = [
            (a.action, a.entity, a.entity_id) for a in session.scalars(select(AuditLog).order_by(AuditLog.id))
        ]
    engine.dispose()
    return rows


def route_head(url: str, route_id: int) -> object:
    """The head the route names (None: the shipped one)."""
    engine = create_engine(url)
    with Session(engine) as session:
        spec = session.get(RouteRow, route_id).spec  # type: ignore[union-attr]
    engine.dispose()
    return spec.get("head")
