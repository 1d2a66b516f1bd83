"""API keys: generated here, shown once, stored only as a SHA-256 hash; and the DB-backed
`Authenticator` that turns a presented key into a Principal, with a small cache that every replica
empties the moment a key is revoked."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.accounting.admission import Quotas
from gateway.auth import Principal
from gateway.db.models import ApiKey, Tenant
from gateway.limits import NO_POLICY, TenantPolicy
from gateway.state import SharedState

KEY_PREFIX = "wk-"
STALE_RETRY_S = 5.0  # while the DB is unreachable, how often one key's expired entry is retried
# Unknown keys remembered (their misses cached), the least recently tried dropped beyond it: every
# anonymous caller can mint new ones, so unbounded, a flood of random keys grew the process for ever.
MAX_MISSES = 10_000

log = logging.getLogger(__name__)


def new_key() -> tuple[str, str, str]:
    """(key, prefix shown in listings, sha256 hex stored)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, key[:11], key_digest(key)


def key_digest(key: str) -> str:
    # Keys carry 256 random bits, so a fast unsalted hash is safe; lookups go by this digest, so
    # no comparison of secrets ever happens in Python.
    return hashlib.sha256(key.encode()).hexdigest()


def key_principal(key: ApiKey, tenant: Tenant) -> Principal:
    """An admin-DB key's caller, with the models the key may use: what the key authenticates as, and
    what a route preview for it plans with."""
    allowed = frozenset(key.models) if key.models is not None else None
    return Principal(tenant_id=tenant.id, tenant_name=tenant.name, key_id=key.id, allowed_models=allowed)


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What admission needs about a caller, beyond who they are."""

    principal: Principal
    key_hash: str
    # The tenant's and the key's limits and budgets, built once per load (not per request): the
    # admission plans are cached by them.
    quotas: Quotas
    expires_at: dt.datetime | None = None  # None: never
    policy: TenantPolicy = NO_POLICY  # the tenant's request limits and prompt storage


@dataclass(slots=True)
class _Load:
    """One key's DB read under way, shared by the lookups that need it."""

    future: asyncio.Future[KeyRecord | None]
    # The key was evicted while it ran: what it read may predate the revocation or limit change.
    evicted: bool = False


class DbAuthenticator:
    """Keys from the admin DB. Lookups are cached for `ttl_s` (positive and negative); a revocation
    published through the shared state evicts the key on every replica at once. While the DB is
    unreachable an expired entry keeps being served (retried every STALE_RETRY_S): a DB outage must not
    lock out every caller the gateway already knew, only keys it has never seen."""

    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], state: SharedState, ttl_s: float = 30.0
    ) -> None:
        self._sessions = sessions
        self._state = state
        self._ttl = ttl_s
        # Known keys (bounded by the keys the DB holds) and keys that matched none (`MAX_MISSES`).
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}
        self._misses: OrderedDict[str, float] = OrderedDict()  # digest -> until when it stays a miss
        self._records: dict[str, KeyRecord] = {}  # tenant/key id pair -> record, for admission
        self._loading: dict[str, _Load] = {}

    async def start(self) -> None:
        await self._state.subscribe_revocations(self.evict)

    def evict(self, key_hash: str) -> None:
        # A read under way may have seen the row before the change: it must not be cached, nor joined
        # by the lookups that come after the eviction (they read again).
        if key_hash == "*":  # a tenant's limits changed: reload everything on next use
            self._cache.clear()
            self._misses.clear()
            evicted = list(self._loading.values())
            self._loading.clear()
        else:
            self._cache.pop(key_hash, None)
            self._misses.pop(key_hash, None)
            evicted = [load] if (load := self._loading.pop(key_hash, None)) is not None else []
        for load in evicted:
            load.evicted = True

    def _remember(self, digest: str, until: float, record: KeyRecord | None) -> None:
        if record is not None:
            self._misses.pop(digest, None)
            self._cache[digest] = (until, record)
            return
        self._cache.pop(digest, None)
        self._misses[digest] = until
        self._misses.move_to_end(digest)
        while len(self._misses) > MAX_MISSES:
            self._misses.popitem(last=False)

    async def authenticate(self, api_key: str) -> Principal | None:
        record = await self.lookup(api_key)
        return record.principal if record else None

    async def authenticate_known(self, api_key: str) -> Principal | None:
        """`authenticate` for keys this replica has seen valid (a DB query only to refresh one of
        those), else None without a query: a throttled address's spray of random keys never reaches
        the DB, while its real key, already cached, keeps working."""
        cached = self._cache.get(key_digest(api_key))
        if cached is None or cached[1] is None:
            return None
        return await self.authenticate(api_key)

    async def lookup(self, api_key: str) -> KeyRecord | None:
        digest = key_digest(api_key)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is None and (missed := self._misses.get(digest)) is not None:
            cached = (missed, None)
        if cached is None or cached[0] <= now:
            load = self._loading.get(digest) or self._start_load(digest)
            try:
                record = await asyncio.shield(load.future)
            except (SQLAlchemyError, OSError, TimeoutError) as exc:
                if cached is None or load.evicted:  # evicted: the entry is no longer ours to vouch for
                    raise
                log.warning("admin DB unreachable (%s); serving the cached key record", type(exc).__name__)
                self._remember(digest, now + STALE_RETRY_S, cached[1])
                record = cached[1]
            else:
                # Evicted meanwhile: this request, under way before the change, gets what was read;
                # the cache does not, or the change would not apply here until the entry expired.
                if not load.evicted:
                    self._remember(digest, now + self._ttl, record)
            if record is not None:
                if load.evicted:  # never in place of a record read after the change
                    self._records.setdefault(record.principal.key_id or "", record)
                else:
                    self._records[record.principal.key_id or ""] = record
        else:
            record = cached[1]
        if (
            record is not None
            and record.expires_at is not None
            and record.expires_at <= dt.datetime.now(dt.UTC)
        ):
            return None
        return record

    def _start_load(self, digest: str) -> _Load:
        """Read the key from the DB, once for all the lookups that need it meanwhile."""
        load = self._loading[digest] = _Load(asyncio.ensure_future(self._load(digest)))

        def done(_: asyncio.Future[KeyRecord | None]) -> None:
            if self._loading.get(digest) is load:  # not a later read, begun after an eviction
                del self._loading[digest]

        load.future.add_done_callback(done)
        return load

    def record_for(self, principal: Principal) -> KeyRecord | None:
        return self._records.get(principal.key_id or "")

    async def _load(self, digest: str) -> KeyRecord | None:
        async with self._sessions() as session:
            row = (
                await session.execute(
                    select(ApiKey, Tenant)
                    .join(Tenant, ApiKey.tenant_id == Tenant.id)
                    .where(ApiKey.key_hash == digest)
                )
            ).first()
        if row is None:
            return None
        key, tenant = row
        if key.revoked_at is not None:
            return None
        return KeyRecord(
            principal=key_principal(key, tenant),
            key_hash=digest,
            quotas=Quotas(
                tenant_id=tenant.id,
                key_id=key.id,
                tenant_rpm=tenant.rpm,
                tenant_tpm=tenant.tpm,
                tenant_budget_micro_usd=tenant.budget_micro_usd_monthly,
                key_rpm=key.rpm,
                key_tpm=key.tpm,
                key_budget_micro_usd=key.budget_micro_usd_monthly,
            ),
            expires_at=key.expires_at,
            policy=TenantPolicy(tenant.max_messages, tenant.max_concurrent_streams, tenant.store_prompts),
        )
