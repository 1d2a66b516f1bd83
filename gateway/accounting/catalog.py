"""The price catalog in the DB: loading it, and seeding it from the config file's prices."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.accounting.pricing import (
    BASE_TIER,
    FALLBACK,
    PriceCatalog,
    PriceRow,
    TokenClass,
    resolve,
    vendor_prices,
)
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


async def seed_prices(
    session: AsyncSession,
    rows: Iterable[PriceRow],
    now: dt.datetime,
    vendors: Mapping[str, str] | None = None,
) -> int:
    """Add a catalog row, effective `now`, for each config price that changed since it was last seeded.

    Restarting with an unchanged config adds nothing, so a price set through the admin API stays in
    force; editing a price in the config adds a row (history keeps the old one), and so does taking
    one out (`_seed_unset`). `vendors`: each backend's type, whose rule prices a cache read or write
    taken out (`pricing.vendor_prices`: Anthropic's 0.1x, 1.25x and 2x the input price).
    """
    rows = list(rows)
    added = 0
    for row in rows:
        added += await _seed(
            session, row.backend, row.model, row.service_tier, row.token_class, row.micro_usd_per_mtok, now
        )
    return added + await _seed_unset(session, rows, now, vendors or {})


def _marker(backend: str, model: str, tier: str, token_class: TokenClass) -> str:
    marker = f"config_price:{backend}:{model}:{token_class}"
    return f"{marker}:{tier}" if tier else marker


async def _seed(
    session: AsyncSession,
    backend: str,
    model: str,
    tier: str,
    token_class: TokenClass,
    micro: int,
    now: dt.datetime,
) -> int:
    """A row of this price unless the config's last seeded one is the same: 1 if one was added."""
    marker = _marker(backend, model, tier, token_class)
    seeded = await session.get(Setting, marker)
    if seeded is not None and seeded.value == str(micro):
        return 0
    session.add(
        Price(
            backend=backend,
            model=model,
            token_class=str(token_class),
            service_tier=tier,
            micro_usd_per_mtok=micro,
            effective_from=now,
        )
    )
    if seeded is None:
        session.add(Setting(key=marker, value=str(micro)))
    else:
        seeded.value = str(micro)
    return 1


async def _seed_unset(
    session: AsyncSession, rows: list[PriceRow], now: dt.datetime, vendors: Mapping[str, str]
) -> int:
    """A price the config seeded once and sets no more (a `cached_input`, a `cache_write_*`, the
    `web_search_per_1k` or a whole service tier taken out of a model's `price`) bills as the config
    now says: at the price its class falls back to (cache reads at the input price, searches at 0, a
    tier's classes at the base prices; cache reads and writes by the backend's vendor's rule where it
    has one, Anthropic's 0.1x, 1.25x and 2x the input price), in a row of that price. Catalog rows are never removed, so
    the price last seeded billed on for ever. A class the config never set is left to the catalog's
    own fallbacks and the admin API's rows.

    A cache class the base price no longer sets falls back per tier, to the tier's own input price:
    each configured tier that does not set it gets a row of its own, or the base row now seeded would
    bill that tier's cache reads at the base input price."""
    sheets: dict[tuple[str, str], dict[str, dict[TokenClass, int]]] = {}
    for row in rows:
        tiers = sheets.setdefault((row.backend, row.model), {})
        tiers.setdefault(row.service_tier, {})[TokenClass(row.token_class)] = row.micro_usd_per_mtok
    added = 0
    for (backend, model), tiers in sheets.items():
        base = tiers.get(BASE_TIER, {})
        stored = await session.scalars(
            select(Price.service_tier).where(Price.backend == backend, Price.model == model).distinct()
        )
        # The base tier first: the tiers below follow what it does.
        unset_in_base: set[TokenClass] = set()
        for tier in sorted({BASE_TIER, *tiers, *stored}):
            own = tiers.get(tier, {})
            implied = resolve(vendor_prices(base | own, vendors.get(backend, "")))
            for token_class in TokenClass:
                if token_class in own:
                    continue
                seeded = await session.get(Setting, _marker(backend, model, tier, token_class))
                follows_base = tier in tiers and token_class in FALLBACK and token_class in unset_in_base
                if seeded is None and not follows_base:
                    continue
                if tier == BASE_TIER:
                    unset_in_base.add(token_class)
                price = implied.get(token_class, 0)
                added += await _seed(session, backend, model, tier, token_class, price, now)
    return added
