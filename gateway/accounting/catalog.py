"""The price catalog in the DB: loading it, and seeding it from the config file's prices."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.db.models import Price, Setting


async def load_catalog(session: AsyncSession) -> PriceCatalog:
    rows = (await session.scalars(select(Price))).all()
    return PriceCatalog(
        [
            PriceRow(
                r.backend,
                r.model,
                TokenClass(r.token_class),
                r.micro_usd_per_mtok,
                r.effective_from,
                r.service_tier,
            )
            for r in rows
        ]
    )


async def seed_prices(session: AsyncSession, rows: Iterable[PriceRow], now: dt.datetime) -> int:
    """Add a catalog row, effective `now`, for each config price that changed since it was last seeded.

    Restarting with an unchanged config adds nothing, so a price set through the admin API stays in
    force; editing a price in the config adds a row (history keeps the old one).
    """
    added = 0
    for row in rows:
        marker = f"config_price:{row.backend}:{row.model}:{row.token_class}"
        if row.service_tier:
            marker += f":{row.service_tier}"
        seeded = await session.get(Setting, marker)
        if seeded is not None and seeded.value == str(row.micro_usd_per_mtok):
            continue
        session.add(
            Price(
                backend=row.backend,
                model=row.model,
                token_class=str(row.token_class),
                service_tier=row.service_tier,
                micro_usd_per_mtok=row.micro_usd_per_mtok,
                effective_from=now,
            )
        )
        if seeded is None:
            session.add(Setting(key=marker, value=str(row.micro_usd_per_mtok)))
        else:
            seeded.value = str(row.micro_usd_per_mtok)
        added += 1
    return added
