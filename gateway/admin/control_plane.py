"""The control plane, assembled: admin DB, shared state, usage queue and batch writer, price catalog,
DB-backed keys, admission (limits and budgets) and the admin router. The gateway app builds one when
a database is configured and plugs it into its seams (authenticator, usage sink, admission hook)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from litestar import Router
from sqlalchemy import null, or_, select, union_all
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from gateway.accounting.admission import Admission, Quotas
from gateway.accounting.catalog import load_catalog, seed_prices
from gateway.accounting.money import usd_per_mtok_to_micro
from gateway.accounting.pricing import BASE_TIER, LongContextSheet, PriceCatalog, PriceRow, TokenClass
from gateway.accounting.queue import RedisStreamQueue, SpoolQueue, UsageQueue
from gateway.accounting.reports import joined_sum, split_sum
from gateway.accounting.sink import AccountingSink
from gateway.accounting.uptime import ProbeRecorder
from gateway.accounting.writer import BatchWriter
from gateway.admin.keys import DbAuthenticator
from gateway.admin.router import AdminContext, admin_router, db_tenants_named_as_config
from gateway.admin.token import ensure_admin_token
from gateway.aio import stop_if_cancelled
from gateway.auth import Authenticator, Principal, authenticate_known
from gateway.config import Model
from gateway.config import Tenant as ConfigTenant
from gateway.db import migrate
from gateway.db.models import UsageEventRow, UsageRollup
from gateway.db.session import create_engine, normalise_url, sessionmaker
from gateway.estimate import asked_tier, output_estimate, prompt_tokens, web_search_estimate
from gateway.state import open_state
from gateway.state.degradable import DegradableState
from gateway.state.redis import RedisState

log = logging.getLogger(__name__)

# The pipeline's endpoints of Anthropic's Messages API (gateway.api.anthropic), whose clients read
# Anthropic's rate-limit headers.
ANTHROPIC_ENDPOINTS = frozenset({"messages", "count_tokens"})


@dataclass
class ControlPlaneSettings:
    database_url: str
    redis_url: str | None = None
    auto_migrate: bool = True
    spool_dir: str = "./var/usage-spool"
    redis_prefix: str = "weir:"
    replicas: int | None = None  # the config's hint: replicas sharing Redis, until counted there
    admin_token: str | None = None  # None: WEIR_ADMIN_TOKEN, else generated once and printed
    key_cache_ttl_s: float = 30.0
    catalog_refresh_s: float = 10.0
    prices: Sequence[PriceRow] = field(default_factory=list)  # from the config; seed the catalog
    # The config's backends' types by name: whose rule prices a cache read or write taken out of a price.
    backend_types: Mapping[str, str] = field(default_factory=dict)
    tenants: Sequence[ConfigTenant] = ()  # the config's `tenants:`, listed read-only by the admin API


class FirstMatch:
    """Try several authenticators in order (config-file keys, then admin-DB keys)."""

    def __init__(self, authenticators: Sequence[Authenticator]) -> None:
        self.authenticators = list(authenticators)

    async def authenticate(self, api_key: str) -> Principal | None:
        for authenticator in self.authenticators:
            principal = await authenticator.authenticate(api_key)
            if principal is not None:
                return principal
        return None

    async def authenticate_known(self, api_key: str) -> Principal | None:
        for authenticator in self.authenticators:
            principal = await authenticate_known(authenticator, api_key)
            if principal is not None:
                return principal
        return None


class ControlPlane:
    def __init__(self, settings: ControlPlaneSettings) -> None:
        self.settings = settings
        self.database_url = normalise_url(settings.database_url)
        self.engine = create_engine(self.database_url)
        self.sessions = sessionmaker(self.engine)
        self.state = open_state(settings.redis_url, prefix=settings.redis_prefix, replicas=settings.replicas)
        self.catalog = PriceCatalog()
        # Public model name -> its config's long-context tier (`Pipeline.long_context`, set by the app):
        # it prices a long prompt's budget estimate as the attempt will be billed.
        self.long_context: dict[str, LongContextSheet] = {}
        # The spool is the queue without Redis, and where events wait while Redis is unreachable.
        spool = SpoolQueue.claim(Path(settings.spool_dir))
        self.queue: UsageQueue = (
            RedisStreamQueue.from_url(settings.redis_url, prefix=settings.redis_prefix, spool=spool)
            if settings.redis_url
            else spool
        )
        primary = getattr(self.state, "primary", None)
        if isinstance(self.queue, RedisStreamQueue) and isinstance(primary, RedisState):
            # Usage events ride in the limit and budget scripts' pipelines (no XADD of their own).
            primary.rider = self.queue
            if isinstance(self.state, DegradableState):  # an outage either meets is the other's too
                self.queue.outage = self.state
        self.writer = BatchWriter(self.queue, self.engine)
        self.uptime = ProbeRecorder(self.engine)  # fed by the routing prober (see gateway.app)
        self.authenticator = DbAuthenticator(self.sessions, self.state, ttl_s=settings.key_cache_ttl_s)
        # Leases only pay with a shared state: in process every admission is already local.
        self.admission = Admission(
            self.state, lambda: self.catalog, spend=self._spend_this_month, leasing=bool(settings.redis_url)
        )
        self.sink = AccountingSink(self.queue, self.admission)
        if isinstance(self.queue, RedisStreamQueue) and isinstance(primary, RedisState):
            # Every event of a DB key comes with a settlement: while one is under way, the window's
            # events wait for it (at most one more window) instead of an XADD of their own.
            self.queue.rider_busy = self.admission.settling
        self.admin = AdminContext(
            self.sessions,
            self.state,
            token_digest="",
            on_prices_changed=self.reload_catalog,
            config_tenants=settings.tenants,
        )
        self._refresher: asyncio.Task[None] | None = None

    def router(self) -> Router:
        return admin_router(self.admin)

    async def start(self) -> None:
        if self.settings.auto_migrate:
            await migrate.upgrade_async(self.database_url)
        digest, generated = await ensure_admin_token(self.sessions, self.settings.admin_token)
        self.admin.token_digest = digest
        if generated:
            # Shown this once; only its hash is stored. Set WEIR_ADMIN_TOKEN to choose your own.
            print(f"weir: generated admin token (shown once): {generated}", file=sys.stderr, flush=True)
        for attempt in range(3):
            try:
                async with self.sessions() as session, session.begin():
                    added = await seed_prices(
                        session, self.settings.prices, dt.datetime.now(dt.UTC), self.settings.backend_types
                    )
                break
            except IntegrityError:  # another replica seeded the same prices at the same moment
                if attempt == 2:
                    raise
        if added:
            log.info("price catalog: %d prices from the config", added)
        await self.reload_catalog()
        await self.warn_of_tenant_name_clashes()
        await self.authenticator.start()
        if isinstance(self.state, DegradableState):  # counts the replicas it shares limits among
            self.state.start()
        if isinstance(self.queue, RedisStreamQueue):
            self.queue.start()
        self.writer.start()
        self.uptime.start()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_catalog())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        self.admission.release_leases()
        await self.admission.drain()
        await self.uptime.stop()
        await self.writer.stop()
        await self.queue.close()
        await self.state.close()
        await self.engine.dispose()

    async def warn_of_tenant_name_clashes(self) -> None:
        """A warning, not a refused start: the clash comes from a config edit (a tenant added under a
        name the admin DB already has), and refusing to start would take every replica down at its
        next restart for what a rename mends. Both tenants' keys keep working meanwhile; only what
        knows tenants by name takes them for one."""
        for tenant_id, name in await db_tenants_named_as_config(self.sessions, self.settings.tenants):
            log.warning(
                "tenant name %r is both a config file tenant (tenants:, id %r) and an admin-DB tenant "
                "(id %r): routes' when.tenants, route previews and the admin pages take them for one "
                "tenant while their keys, limits, budgets and ledger rows differ; rename one (the "
                "admin-DB one with PATCH /admin/api/v1/tenants/%s)",
                name,
                name,
                tenant_id,
                tenant_id,
            )

    async def reload_catalog(self) -> None:
        async with self.sessions() as session:
            self.catalog = await load_catalog(session)

    async def _refresh_catalog(self) -> None:
        # Other replicas' price changes arrive within one period; an effective_from in the future
        # makes a change exact on every replica.
        while True:
            await asyncio.sleep(self.settings.catalog_refresh_s)
            stop_if_cancelled()  # a cancel that library code swallowed last round
            try:
                await self.reload_catalog()
            except Exception:
                log.warning("price catalog refresh failed; keeping the last one", exc_info=True)

    async def _spend_this_month(
        self,
        scope: str,
        owner: str,
        month_start: dt.date,
        event_ids: Sequence[str] = (),
        recent_from: str = "",
    ) -> tuple[int, list[str]]:
        """The month's spend, and which of `event_ids` and of the owner's events with an id from
        `recent_from` on (created since then: ids begin with their time) it holds: one statement, so
        all are read at one moment of the ledger (the writer adds an event's row and its rollup in
        one transaction)."""
        column = UsageRollup.tenant_id if scope == "tenant" else UsageRollup.key_id
        # Summed in parts as the usage report does: SQLite's sum() fails past 2^63 (~$9.2M a month).
        query: Any = select(*split_sum(UsageRollup.cost_pico_usd), null()).where(
            column == owner, UsageRollup.day >= month_start
        )
        held: list[ColumnElement[bool]] = [UsageEventRow.event_id.in_(event_ids)] if event_ids else []
        if recent_from:
            held.append(UsageEventRow.event_id >= recent_from)
        if held:
            owned = UsageEventRow.tenant_id if scope == "tenant" else UsageEventRow.key_id
            query = union_all(
                query,
                select(null(), null(), UsageEventRow.event_id).where(
                    or_(*held), owned == owner, UsageEventRow.day >= month_start
                ),
            )
        async with self.sessions() as session:
            rows = (await session.execute(query)).all()
        high, low = next((high, low) for high, low, event_id in rows if event_id is None)
        return joined_sum(high, low), [event_id for _, _, event_id in rows if event_id is not None]

    def quotas(self, principal: Principal) -> Quotas | None:
        record = self.authenticator.record_for(principal)
        # None: a config-file key, with no limits or budgets kept for it.
        return None if record is None else record.quotas

    async def admit(self, call: Any, target: Any, upstream: Any) -> None:
        """The pipeline's admission hook, before a request's first attempt goes upstream: 429 when a
        rate limit or budget says no. `call`, `target`, `upstream` are gateway.pipeline's Call,
        gateway.router_basic's Target and the translated UpstreamRequest."""
        quotas = self.quotas(call.principal)
        if quotas is None:
            return
        # OpenAI's x-ratelimit-* headers, which the request middleware puts on the response; on the
        # Messages API Anthropic's anthropic-ratelimit-* too, which its clients read.
        call.info.rate_limits = await self.admission.admit(
            call.info.request_id,
            quotas,
            target.backend.name,
            target.upstream_model,
            prompt_tokens=prompt_tokens(upstream.body),
            max_output_tokens=output_estimate(upstream.body),
            long_context=self.long_context.get(target.model.name),
            service_tier=asked_tier(upstream.body),
            anthropic=call.endpoint in ANTHROPIC_ENDPOINTS,
            web_searches=web_search_estimate(upstream.body),
            counting=call.endpoint == "count_tokens",
        )


def configured_database_url(config: Any) -> str | None:
    """The admin DB a gateway on `config` uses: `WEIR_DATABASE_URL` wins over `database_url`."""
    return os.environ.get("WEIR_DATABASE_URL") or getattr(config, "database_url", None)


def config_prices(models: Sequence[Model], now: dt.datetime) -> list[PriceRow]:
    """The catalog rows the config's `models[].price` seed (`catalog.seed_prices`), effective `now`."""
    prices = []
    for model in models:
        # The base price, then each service tier's (`price.tiers`): their rows bill that tier.
        for tier, price in ((BASE_TIER, model.price), *model.price.tiers.items()):
            for token_class in TokenClass:
                value = getattr(price, str(token_class), None)
                if value is not None:
                    micro = usd_per_mtok_to_micro(value)
                    prices.append(
                        PriceRow(model.backend, model.upstream_model, token_class, micro, now, tier)
                    )
    return prices


def from_config(config: Any) -> ControlPlane | None:
    """A control plane for a gateway `Config`, or None when no database is configured.

    `WEIR_DATABASE_URL` / `WEIR_REDIS_URL` win over the config's `database_url` / `redis_url`.
    """
    database_url = configured_database_url(config)
    redis_url = os.environ.get("WEIR_REDIS_URL") or getattr(config, "redis_url", None)
    if not database_url:
        if redis_url:
            # Redis is the control plane's shared state: without a database nothing uses it, and
            # every replica keeps its own breakers, hedge cap, limits and stream slots. Said once at
            # start, or a fleet configured for Redis alone never learns its replicas share nothing.
            log.warning(
                "redis_url is set but no database_url: the control plane is off, so Redis is not used "
                "and circuit breakers, hedge caps, rate limits and stream slots are per replica"
            )
        return None
    prices = config_prices(config.models, dt.datetime.now(dt.UTC))
    return ControlPlane(
        ControlPlaneSettings(
            database_url=database_url,
            redis_url=redis_url,
            replicas=getattr(config, "replicas", None),
            auto_migrate=getattr(config, "auto_migrate", True),
            prices=prices,
            backend_types={backend.name: backend.type for backend in getattr(config, "backends", ())},
            tenants=getattr(config, "tenants", None) or (),
            # One spool per process (without Redis); one key namespace per deployment (with Redis).
            spool_dir=os.environ.get("WEIR_USAGE_SPOOL", "./var/usage-spool"),
            redis_prefix=os.environ.get("WEIR_REDIS_PREFIX", "weir:"),
        )
    )
