"""The price catalog in the DB: loading it, and seeding it from the config file's prices."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.accounting.pricing import PriceCatalog, PriceRow, TokenClass
from gateway.db.models import Price, Setting

log = logging.getLogger(__name__)

# The unknown token classes already warned about in this process: the catalog reloads every 10 s, and
# one line per class says as much as one per reload.
_skipped_classes: set[str] = set()


async def load_catalog(session: AsyncSession) -> PriceCatalog:
    """Every price row this code can bill. A row of a token class it does not know (one that a newer
    replica's release added, during a rolling upgrade) is skipped, with a warning once per class: this
    replica records no usage of that class, so the row would bill nothing here, and refusing the
    whole catalog would stop every price change from reaching it (and a restart from starting)."""
    rows = (await session.scalars(select(Price))).all()
    known: list[PriceRow] = []
    for r in rows:
        try:
            token_class = TokenClass(r.token_class)
        except ValueError:
            if r.token_class not in _skipped_classes:
                _skipped_classes.add(r.token_class)
                log.warning(
                    "price rows of token class %r skipped: this version does not know it (a newer "
                    "release added it); they bill nothing here until this replica is upgraded",
                    r.token_class,
                )
            continue
        known.append(
            PriceRow(r.backend, r.model, token_class, r.micro_usd_per_mtok, r.effective_from, r.service_tier)
        )
    return PriceCatalog(known)


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
