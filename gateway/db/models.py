"""Tables of the admin DB.

Money never touches a float: prices are integer micro-dollars per million tokens (so any price with at
most six decimals per 1M tokens is exact) and costs are integer pico-dollars (micro-dollars per 1M
tokens times tokens), which sum exactly on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    literal_column,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from gateway.accounting.events import ANSWERED_RETRY_SQL, UNANSWERED_START_SQL


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_id() -> str:
    return uuid.uuid4().hex


def revision_column() -> Mapped[int]:
    """How many times a row was written, counted by the database in the UPDATE itself. Replicas
    mirroring a table poll its signature; one built from the latest `updated_at` missed an edit whose
    transaction committed after a later-stamped one (two admins saving at once): the latest stamp did
    not move. A sum of revisions moves with every committed write, in whatever order they commit."""
    return mapped_column(Integer, default=1, server_default="1", onupdate=literal_column("revision") + 1)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone on its own)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


# Stable constraint names, so Alembic migrations drop and recreate them identically on every backend.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    budget_micro_usd_monthly: Mapped[int | None] = mapped_column(BigInteger)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    # Request limits (None: the config's `limits:` apply); see gateway.limits.
    max_messages: Mapped[int | None] = mapped_column(Integer)
    max_concurrent_streams: Mapped[int | None] = mapped_column(Integer)
    # Prompt and completion bodies are kept only when the tenant opts in, and only this long.
    store_prompts: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    prompt_retention_days: Mapped[int | None] = mapped_column(Integer)  # None: the default (30)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(32))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    models: Mapped[list[str] | None] = mapped_column(JSON)  # None: every model the tenant may use
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    budget_micro_usd_monthly: Mapped[int | None] = mapped_column(BigInteger)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class Price(Base):
    """One row per (backend, model, service tier, token class, effective_from); rows are never updated."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("backend", "model", "service_tier", "token_class", "effective_from"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    backend: Mapped[str] = mapped_column(String(200))  # "*" applies to every backend serving `model`
    model: Mapped[str] = mapped_column(String(200))
    token_class: Mapped[str] = mapped_column(String(32))
    # "" for the base price; else the service tier whose attempts it bills (`flex`, `priority`).
    service_tier: Mapped[str] = mapped_column(String(32), default="", server_default="")
    micro_usd_per_mtok: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class UsageEventRow(Base):
    """The append-only ledger: one row per upstream attempt, written by the batch writer."""

    __tablename__ = "usage_events"
    __table_args__ = (
        Index("ix_usage_events_ts_tenant", "ts", "tenant_id"),
        # By time, the client requests whose first attempt did not answer and the later attempts
        # that answered: the few rows the uptime report reads to tell which requests no attempt
        # answered, instead of grouping a month's ledger by request. Partial, so the writer adds to
        # them for those rows only (migration 0016).
        Index(
            "ix_usage_events_unanswered_starts",
            "ts",
            sqlite_where=text(UNANSWERED_START_SQL),
            postgresql_where=text(UNANSWERED_START_SQL),
        ),
        Index(
            "ix_usage_events_answered_retries",
            "ts",
            sqlite_where=text(ANSWERED_RETRY_SQL),
            postgresql_where=text(ANSWERED_RETRY_SQL),
        ),
    )

    event_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), index=True)  # gateway.ids: up to 128
    # Set when request_id is a client's x-request-id: tells apart the requests that share it.
    exchange_id: Mapped[str | None] = mapped_column(String(32))
    attempt: Mapped[int] = mapped_column(Integer)
    ts: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    day: Mapped[dt.date] = mapped_column(Date)
    # An admin-DB tenant's id, or a config file's tenant's name (gateway.auth.tenant_principal)
    tenant_id: Mapped[str | None] = mapped_column(String(200))
    key_id: Mapped[str | None] = mapped_column(String(32))
    route: Mapped[str] = mapped_column(String(200))
    backend: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_write_5m_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_write_1h_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger)
    # Anthropic web searches the attempt made, priced as the `web_search` class (its `prices`).
    web_search_requests: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The service tier the vendor served the attempt at (its `prices` are that tier's); None: unsaid.
    service_tier: Mapped[str | None] = mapped_column(String(32))
    prices: Mapped[dict[str, int]] = mapped_column(JSON)  # token class -> micro-USD per 1M tokens/searches
    cost_pico_usd: Mapped[int] = mapped_column(BigInteger)
    savings_pico_usd: Mapped[int] = mapped_column(BigInteger)
    latency_ms: Mapped[float] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    status: Mapped[int] = mapped_column(Integer)  # HTTP status of the attempt; 0 when no response
    fallback: Mapped[bool] = mapped_column(Boolean)
    # True when the gateway estimated the usage (a stream cut before the vendor reported it)
    estimated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    routing: Mapped[str | None] = mapped_column(String(1000), nullable=True)  # the x-weir-route decision
    # Why Weir itself made the call (`compare`, `judge`: routing/compare.py); None for a client's
    # request. Only a client request's first attempt counts in the usage report's `requests`.
    purpose: Mapped[str | None] = mapped_column(String(16))


def upserted_id_column() -> Mapped[int]:
    """The id of a table the writer upserts: PostgreSQL's upsert takes a sequence number for every row
    it proposes, updates too, so an `integer` ran out (migration 0019). SQLite's INTEGER PRIMARY KEY
    (a 64-bit rowid) must stay INTEGER to be the rowid."""
    return mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)


class UsageRollup(Base):
    """Daily totals the reports read; the writer adds to them in the transaction that inserts events."""

    __tablename__ = "usage_rollups"
    __table_args__ = (UniqueConstraint("day", "tenant_id", "key_id", "backend", "model"),)

    id: Mapped[int] = upserted_id_column()
    day: Mapped[dt.date] = mapped_column(Date)
    # "" rather than NULL, so the unique constraint (and the upsert on it) holds for anonymous traffic.
    tenant_id: Mapped[str] = mapped_column(String(200))  # as usage_events.tenant_id
    key_id: Mapped[str] = mapped_column(String(32))
    backend: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    requests: Mapped[int] = mapped_column(BigInteger)  # attempts (the usage report's `attempts`)
    errors: Mapped[int] = mapped_column(BigInteger)  # failed attempts; cancelled ones (499) are apart
    cancelled: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Client requests whose first attempt (`events.starts_client_request`) is in this group: each is
    # counted once, where it started, whichever groups its retries and failovers went to; Weir's own
    # calls (a comparison's, its judge's) are attempts, not client requests.
    client_requests: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_write_5m_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_write_1h_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger)
    web_search_requests: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cost_pico_usd: Mapped[int] = mapped_column(BigInteger)
    savings_pico_usd: Mapped[int] = mapped_column(BigInteger)


class UsageRouteRollup(Base):
    """Daily totals by route as well: usage_rollups' sums per (day, tenant, key, backend, model,
    route), which the usage report reads when it groups by route over whole days. A table of its own
    (migration 0018, filled from the ledger), so that replicas of the release before, which upsert
    usage_rollups on its unique key, run on beside it; the writer adds to both in one transaction."""

    __tablename__ = "usage_route_rollups"
    __table_args__ = (UniqueConstraint("day", "tenant_id", "key_id", "backend", "model", "route"),)

    id: Mapped[int] = upserted_id_column()
    day: Mapped[dt.date] = mapped_column(Date)
    tenant_id: Mapped[str] = mapped_column(String(200))  # "" for none, as usage_rollups
    key_id: Mapped[str] = mapped_column(String(32))
    backend: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    route: Mapped[str] = mapped_column(String(200))  # as usage_events.route: the public name asked for
    requests: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    cancelled: Mapped[int] = mapped_column(BigInteger)
    client_requests: Mapped[int] = mapped_column(BigInteger)
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_write_5m_tokens: Mapped[int] = mapped_column(BigInteger)
    cache_write_1h_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger)
    web_search_requests: Mapped[int] = mapped_column(BigInteger)
    cost_pico_usd: Mapped[int] = mapped_column(BigInteger)
    savings_pico_usd: Mapped[int] = mapped_column(BigInteger)


class UptimeSample(Base):
    """One active health probe result (source "probe"); request outcomes come from usage_events."""

    __tablename__ = "uptime_samples"
    __table_args__ = (Index("ix_uptime_samples_backend_ts", "backend", "ts"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    backend: Mapped[str] = mapped_column(String(200))
    ts: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    ok: Mapped[bool] = mapped_column(Boolean)
    latency_ms: Mapped[float | None] = mapped_column(Float)


class AuditLog(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(100))
    entity: Mapped[str] = mapped_column(String(100))
    entity_id: Mapped[str | None] = mapped_column(String(200))
    before: Mapped[dict | None] = mapped_column(JSON)
    after: Mapped[dict | None] = mapped_column(JSON)


class Setting(Base):
    """Small control-plane facts that must survive restarts (e.g. the admin token's hash)."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class RouteRow(Base):
    """One route (a routing.routes.Route as JSON); routes sharing a name are tried by `position`."""

    __tablename__ = "routes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    position: Mapped[int] = mapped_column(Integer, default=0)
    spec: Mapped[dict] = mapped_column(JSON)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    revision: Mapped[int] = revision_column()


class DifficultyHeadRow(Base):
    """A difficulty head trained on a tenant's own outcomes (`weir router train`), stored whole so that
    every replica loads the same bytes; difficulty routes name it in `head` (routing.heads)."""

    __tablename__ = "difficulty_heads"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))  # sha256 of `bundle`, hex
    embedder: Mapped[str] = mapped_column(String(100))  # the recipe it reads (routing.embed)
    size: Mapped[int] = mapped_column(Integer)
    meta: Mapped[dict] = mapped_column(JSON)  # training metadata: source, rows, config
    # safetensors with the metadata in its header; deferred: only loading a head reads its megabytes
    bundle: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    revision: Mapped[int] = revision_column()


class Feedback(Base):
    """Outcome feedback on one request (`POST /v1/feedback`), visible only to the tenant that sent it."""

    __tablename__ = "feedback"
    __table_args__ = (UniqueConstraint("tenant_id", "request_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(200))
    request_id: Mapped[str] = mapped_column(String(128))
    score: Mapped[float] = mapped_column(Float)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    # When the score last changed (a re-sent equal score leaves it): `weir router train --install`
    # ranks only rows whose label is newer than the head in use, which was trained on the older label.
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class Comparison(Base):
    """A judge's grades of both candidates' answers to one request of a `difficulty` route with
    `compare` (routing.compare): training labels for both outcomes, read with the stored prompt."""

    __tablename__ = "comparisons"
    __table_args__ = (UniqueConstraint("tenant_id", "request_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(200))
    request_id: Mapped[str] = mapped_column(String(128))  # the client's request (its stored prompt)
    route: Mapped[str] = mapped_column(String(200))
    weak_model: Mapped[str] = mapped_column(String(200))  # public model names of the candidates
    strong_model: Mapped[str] = mapped_column(String(200))
    served: Mapped[str] = mapped_column(String(8))  # "weak" or "strong": which answered the client
    weak_score: Mapped[float] = mapped_column(Float)  # the judge's grade, 1..10 scaled to 0..1
    strong_score: Mapped[float] = mapped_column(Float)
    judge: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    # When the grades last changed (a request graded again): as `Feedback.updated_at`.
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    # What the route's head said about the request when it was routed, and which head said it (the
    # x-weir-route `head=`): with the grades, how well that head ranks this tenant's traffic. Null in
    # rows from before migration 0007.
    p_strong: Mapped[float | None] = mapped_column(Float, nullable=True)
    head: Mapped[str | None] = mapped_column(String(256), nullable=True)


class BackendCredential(Base):
    """A vendor API key for one backend, encrypted with the master key (gateway.secrets); it wins
    over the config's `api_key` for that backend. Only `last4` and `fingerprint` are ever shown."""

    __tablename__ = "backend_credentials"

    backend: Mapped[str] = mapped_column(String(200), primary_key=True)
    ciphertext: Mapped[str] = mapped_column(Text)  # "v1:<key id>:<base64 nonce + AES-GCM output>"
    key_id: Mapped[str] = mapped_column(String(16))  # which master key encrypted it (rotation)
    fingerprint: Mapped[str] = mapped_column(String(16))  # first 16 hex of the secret's SHA-256
    last4: Mapped[str] = mapped_column(String(4))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    revision: Mapped[int] = revision_column()


class StoredPrompt(Base):
    """Request and response bodies of one request, for tenants with `store_prompts` on; deleted
    after the tenant's retention period. Bodies are encrypted when a master key is set (key_id)."""

    __tablename__ = "stored_prompts"
    __table_args__ = (Index("ix_stored_prompts_tenant_request", "tenant_id", "request_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128))
    tenant_id: Mapped[str] = mapped_column(String(32))
    ts: Mapped[dt.datetime] = mapped_column(UTCDateTime, index=True)
    endpoint: Mapped[str] = mapped_column(String(100))
    status: Mapped[int] = mapped_column(Integer)
    key_id: Mapped[str | None] = mapped_column(String(16))  # None: stored as plain text (no master key)
    request_body: Mapped[str] = mapped_column(Text)
    response_body: Mapped[str] = mapped_column(Text)
