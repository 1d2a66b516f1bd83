"""The price catalog in the DB: loading it, and seeding it from the config file's prices."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.db.models import Price


async def load_catalog(session: AsyncSession) -> PriceCatalog:
    rows = (await session.scalars(select(Price))).all()
    return PriceCatalog(
        [
            PriceRow(r.backend, r.model, TokenClass(r.token_class), r.micro_usd_per_mtok, r.effective_from)
            for r in rows
        ]
    )


async def seed_prices(session: AsyncSession, rows: Iterable[PriceRow], now: dt.datetime) -> int:
    """Add config prices that differ from what the catalog says now, effective from `now`.

    Restarting with an unchanged config adds nothing; editing a price in the config adds a row, so
    history keeps the old one.
    """
    catalog = await load_catalog(session)
    added = 0
    for row in rows:
        own = catalog.scoped_prices(row.backend, row.model, now).get(row.token_class)
        if own != row.micro_usd_per_mtok:
            session.add(
                Price(
                    backend=row.backend,
                    model=row.model,
                    token_class=str(row.token_class),
                    micro_usd_per_mtok=row.micro_usd_per_mtok,
                    effective_from=now,
                )
            )
            added += 1
    return added
