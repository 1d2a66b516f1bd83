"""The admin API, a Litestar Router mounted at `/admin/api/v1`.

Every write runs in one transaction with its audit row (who, what, when, before, after), so the
audit log can never miss a change that happened.
"""

from __future__ import annotations

import datetime as dt
import logging
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, Router, delete, get, patch, post, put
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.handlers import BaseRouteHandler
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.accounting import reports
from gateway.accounting.money import (
    MAX_BUDGET_MICRO,
    format_usd,
    micro_to_usd,
    micro_to_usd_per_1k_requests,
    usd_per_1k_requests_to_micro,
    usd_per_mtok_to_micro,
    usd_to_micro,
)
from gateway.accounting.pricing import PER_REQUEST
from gateway.admin.keys import new_key
from gateway.admin.requests import preview_route, recent_requests, routing_savings, spend_by_class
from gateway.admin.schemas import KeyCreate, PriceIn, PricesPut, TenantCreate, TenantPatch
from gateway.admin.token import token_matches
from gateway.config import Tenant as ConfigTenant
from gateway.db.models import ApiKey, AuditLog, Price, RouteRow, Tenant, utcnow
from gateway.state import SharedState
from gateway.throttle import FailureThrottle, client_address

T = TypeVar("T")
log = logging.getLogger(__name__)
# Published on the revocation channel to make every replica drop all cached keys (limits changed).
EVICT_ALL = "*"
BACKDATE_TOLERANCE = dt.timedelta(minutes=1)
BUDGET = "budget_usd_monthly"
MAX_AUDIT_ID = 2**31 - 1  # audit_log.id is a 32-bit integer
MAX_AUDIT_LIMIT = 1000  # entries in one page of GET /audit


class AdminError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type
        self.headers = headers


@dataclass
class AdminContext:
    sessions: async_sessionmaker[AsyncSession]
    state: SharedState
    token_digest: str
    on_prices_changed: Callable[[], Awaitable[None]] | None = None
    actor: str = "admin"
    # Wrong admin tokens per client address (`server.admin_auth_failures_per_minute`); None: none.
    throttle: FailureThrottle | None = None
    # The config file's `tenants:`, read at start: listed read-only beside the admin DB's, and their
    # names kept from admin-DB tenants (a config tenant's id is its name, in the ledger too).
    config_tenants: Sequence[ConfigTenant] = ()
    # Whether the gateway serves a requested model name now (a route or a model of the config; set by
    # the app to its router's `in_force`). None: the admin API mounted without a gateway, which has no
    # names to check a key's `models` against.
    serves_model: Callable[[str], bool] | None = None

    @asynccontextmanager
    async def write(self) -> AsyncIterator[tuple[AsyncSession, Callable[..., None]]]:
        """A transaction plus `audit(action, entity, entity_id, before, after)` inside it."""
        try:
            async with self.sessions() as session, session.begin():

                def audit(action: str, entity: str, entity_id: str | None, before: Any, after: Any) -> None:
                    session.add(
                        AuditLog(
                            actor=self.actor,
                            action=action,
                            entity=entity,
                            entity_id=entity_id,
                            before=before,
                            after=after,
                        )
                    )

                yield session, audit
        except IntegrityError as exc:
            raise AdminError(
                409, "conflicts with an existing record (a name or key already in use)", "conflict"
            ) from exc


def _error_response(
    status: int,
    message: str,
    code: str | None,
    param: str | None = None,
    type: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> Response[dict[str, Any]]:
    return Response(
        {"error": {"message": message, "type": type, "param": param, "code": code}},
        status_code=status,
        headers=headers,
    )


def _on_admin_error(_: Request, exc: AdminError) -> Response[dict[str, Any]]:
    return _error_response(exc.status, exc.message, exc.code, exc.param, exc.type, exc.headers)


def _on_http_error(_: Request, exc: HTTPException) -> Response[dict[str, Any]]:
    codes = {401: "invalid_admin_token", 404: "not_found", 405: "method_not_allowed"}
    return _error_response(
        exc.status_code, exc.detail, codes.get(exc.status_code, "invalid_request"), headers=exc.headers
    )


def _on_db_error(request: Request, exc: DBAPIError) -> Response[dict[str, Any]]:
    # PostgreSQL's character_not_in_repertoire: text with U+0000, which it neither stores nor compares
    # with (a name in a body, an id in a path); SQLite takes it. Bad input, not the server's fault.
    if getattr(exc.orig, "sqlstate", None) == "22021":
        return _error_response(400, "text must not contain a NUL character (U+0000)", "invalid_value")
    return _on_unexpected(request, exc)


def _on_unexpected(_: Request, exc: Exception) -> Response[dict[str, Any]]:
    log.error("admin API request failed", exc_info=exc)
    return _error_response(
        500, "internal error in the admin API; see the gateway log", "internal_error", type="api_error"
    )


def _admin_guard(ctx: AdminContext) -> Callable[[ASGIConnection, BaseRouteHandler], Awaitable[None]]:
    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        address = client_address(connection.scope)
        # Checked before the token, as the UI's sign-in lockout is: were the right token let through,
        # a throttled guesser would still learn which of its guesses was right.
        wait = await ctx.throttle.retry_after(address) if ctx.throttle is not None else None
        if wait is not None:
            raise AdminError(
                429,
                f"too many wrong admin tokens from this address: retry in {wait} seconds",
                "too_many_failed_authentications",
                type="requests",
                headers={"retry-after": str(wait)},
            )
        scheme, _sep, token = connection.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token_matches(token.strip(), ctx.token_digest):
            if ctx.throttle is not None:
                await ctx.throttle.failed(address)
            raise AdminError(
                401, "a valid admin token is required (Authorization: Bearer <token>)", "invalid_admin_token"
            )

    return guard


# What each amount field takes, as a refusal of a value that is no number says (the Tenants and
# Backends pages show the refusal as it is).
_AMOUNTS = {
    "usd_per_1m_tokens": ("a price in USD per 1M tokens", 6),
    "usd_per_1k_requests": ("a price in USD per 1,000 requests", 9),
    "budget_usd_monthly": ("a monthly budget in USD", 6),
}


def decode(body: bytes, type_: type[T]) -> T:
    try:
        return msgspec.json.decode(body or b"{}", type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.split("at `$.", 1)[1].split("`", 1)[0] if "at `$." in text else None
        if text.startswith("Object contains unknown field `"):
            # msgspec names the object the field is in (nothing at the top level): name the field.
            field = text.split("`", 2)[1]
            param = f"{param}.{field}" if param else field
        amount = _AMOUNTS.get(param.rsplit(".", 1)[-1]) if param else None
        if amount is not None and "decimal" in text.split(" - at ", 1)[0]:
            # msgspec's "Invalid decimal string - at `$.prices[0].usd_per_1k_requests`" is the one
            # refusal an admin typing "$10" or "1,50" meets: say what the field takes instead.
            text = _enter_amount(*amount)
        raise AdminError(400, text, "invalid_value", param) from None
    except msgspec.DecodeError as exc:
        raise AdminError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None


def _enter_amount(what: str, decimals: int) -> str:
    return f"Enter {what} as a plain number with up to {decimals} decimals, such as 2.50 (no $ or commas)"


def admin_name(value: str, param: str) -> str:
    """A name an admin typed (a tenant's, a key's), trimmed as the UI trims it, or a 400: one empty once
    trimmed or holding a control character (a tab, a newline, U+0085) reads as another name, or as
    none, on every page and in every report that shows it."""
    name = value.strip()
    if not name:
        raise AdminError(400, f"{param} must not be empty or only spaces", "invalid_value", param)
    if any(unicodedata.category(c) == "Cc" for c in name):
        raise AdminError(
            400, f"{param} must not contain control characters, got {name!r}", "invalid_value", param
        )
    return name


def checked_limit(limit: int, most: int) -> int:
    """A list endpoint's `limit` query parameter, or a 400 naming its range: clamped silently, a
    client asking for more than the most got fewer rows and no word of it."""
    if not 1 <= limit <= most:
        raise AdminError(400, f"limit must be between 1 and {most}, got {limit}", "invalid_value", "limit")
    return limit


def _usd(micro: int | None) -> str | None:
    return None if micro is None else format_usd(micro_to_usd(micro))


def _budget_micro(value: Decimal | None) -> int | None:
    """A tenant's or key's `budget_usd_monthly` in micro-USD, refused in words: the money helpers'
    reasons speak of prices per 1M tokens."""
    if value is None:
        return None
    try:
        return usd_to_micro(value)
    except ValueError:
        pass
    if not value.is_finite() or value < 0:
        message = _enter_amount(*_AMOUNTS[BUDGET])
    elif value > (bound := micro_to_usd(MAX_BUDGET_MICRO)):  # compared unscaled: 1E+1000000 overflowed
        message = f"A monthly budget is at most {format_usd(bound)} USD, got {_as_entered(value)}"
    else:
        message = f"A monthly budget has at most 6 decimals (one micro-dollar), got {_as_entered(value)}"
    raise AdminError(400, message, "invalid_value", BUDGET)


def _as_entered(value: Decimal) -> str:
    """An amount refused, as a message repeats it: every digit (format_usd keeps 28), and a huge
    exponent as written rather than its million zeros."""
    return format(value, "f") if value.adjusted() < 30 else str(value)


def tenant_json(t: Tenant) -> dict[str, Any]:
    return {
        "id": t.id,
        "name": t.name,
        "source": "db",
        "budget_usd_monthly": _usd(t.budget_micro_usd_monthly),
        "rpm": t.rpm,
        "tpm": t.tpm,
        "max_messages": t.max_messages,
        "max_concurrent_streams": t.max_concurrent_streams,
        "store_prompts": t.store_prompts,
        "prompt_retention_days": t.prompt_retention_days,
        "created_at": t.created_at.isoformat(),
        "updated_at": t.updated_at.isoformat(),
    }


def config_tenant_json(t: ConfigTenant) -> dict[str, Any]:
    """A config file tenant, in a DB tenant's shape: its id is its name (what its requests carry in
    the ledger); no budget or rate limits (those are the admin DB's) and no stored prompts. Only the
    config changes it: `source: "config"` tells a client not to try."""
    return {
        "id": t.name,
        "name": t.name,
        "source": "config",
        "budget_usd_monthly": None,
        "rpm": None,
        "tpm": None,
        "max_messages": t.max_messages,
        "max_concurrent_streams": t.max_concurrent_streams,
        "max_output_tokens": t.max_output_tokens,
        "models": t.models,
        "keys": len(t.api_keys),
        "store_prompts": False,
        "prompt_retention_days": None,
        "created_at": None,
        "updated_at": None,
    }


def key_json(k: ApiKey) -> dict[str, Any]:
    return {
        "id": k.id,
        "tenant_id": k.tenant_id,
        "name": k.name,
        "prefix": k.prefix,
        "models": k.models,
        "budget_usd_monthly": _usd(k.budget_micro_usd_monthly),
        "rpm": k.rpm,
        "tpm": k.tpm,
        "expires_at": k.expires_at.isoformat() if k.expires_at else None,
        "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
        "created_at": k.created_at.isoformat(),
    }


def price_json(p: Price) -> dict[str, Any]:
    # Both fields on every row, the one that does not apply null: a client reading a search price as
    # per 1M tokens gets nothing rather than a number 1,000 times too large.
    per_request = p.token_class in PER_REQUEST
    return {
        "backend": p.backend,
        "model": p.model,
        "token_class": p.token_class,
        "service_tier": p.service_tier or None,
        "usd_per_1m_tokens": None if per_request else format_usd(micro_to_usd(p.micro_usd_per_mtok)),
        "usd_per_1k_requests": (
            format_usd(micro_to_usd_per_1k_requests(p.micro_usd_per_mtok)) if per_request else None
        ),
        "effective_from": p.effective_from.isoformat(),
    }


def _price_micro(item: PriceIn, i: int) -> int:
    """The catalog's micro-USD per 1M units of a price row, from the one field its class is priced in."""
    per_request = item.token_class in PER_REQUEST
    field = "usd_per_1k_requests" if per_request else "usd_per_1m_tokens"
    other = "usd_per_1m_tokens" if per_request else "usd_per_1k_requests"
    if getattr(item, other) is not None:
        if per_request:
            message = (
                f"{item.token_class} is billed per request and priced per 1,000 requests: send "
                "usd_per_1k_requests (Anthropic's $10 per 1,000 web searches is 10), not usd_per_1m_tokens"
            )
        else:
            message = (
                "usd_per_1k_requests prices only the classes billed per request (web_search): "
                f"{item.token_class} is priced in usd_per_1m_tokens"
            )
        raise AdminError(400, message, "invalid_value", f"prices[{i}].{other}")
    value = getattr(item, field)
    if value is None:
        message = f"{field} is required for {item.token_class}"
        raise AdminError(400, message, "invalid_value", f"prices[{i}].{field}")
    try:
        return usd_per_1k_requests_to_micro(value) if per_request else usd_per_mtok_to_micro(value)
    except ValueError as exc:
        raise AdminError(400, str(exc), "invalid_value", f"prices[{i}].{field}") from None


async def tenant_or_404(session: AsyncSession, tenant_id: str) -> Tenant:
    """The tenant, or the admin API's 404 (every tenant-scoped admin route starts with this)."""
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise AdminError(404, f"no tenant with id {tenant_id!r}", "not_found", "tenant_id")
    return tenant


# --- tenants -----------------------------------------------------------------------------------


def config_tenant(ctx: AdminContext, name: str) -> ConfigTenant | None:
    return next((t for t in ctx.config_tenants if t.name == name), None)


async def db_tenants_named_as_config(
    sessions: async_sessionmaker[AsyncSession], config_tenants: Sequence[ConfigTenant]
) -> list[tuple[str, str]]:
    """(id, name) of each admin-DB tenant named as a config tenant: the API refuses that name
    (`refuse_config_name`), but a config tenant added to the file after the DB tenant meets it only
    when a gateway starts with that config."""
    names = [t.name for t in config_tenants]
    if not names:
        return []
    async with sessions() as session:
        rows = await session.execute(select(Tenant.id, Tenant.name).where(Tenant.name.in_(names)))
    return [(tenant_id, name) for tenant_id, name in rows]


async def db_tenant_or_error(ctx: AdminContext, session: AsyncSession, tenant_id: str) -> Tenant:
    """`tenant_or_404` for the routes that change a tenant or its keys: a config tenant's id (its name,
    as GET /tenants lists it) gets 409 saying where it is changed, not a 404 that says it is not there."""
    if config_tenant(ctx, tenant_id) is not None and await session.get(Tenant, tenant_id) is None:
        raise AdminError(
            409,
            f"tenant {tenant_id!r} is defined in the config file (tenants:); edit the config to change "
            "it or its keys",
            "conflict",
            "tenant_id",
        )
    return await tenant_or_404(session, tenant_id)


def refuse_config_name(ctx: AdminContext, name: str) -> None:
    """409 for an admin-DB tenant named as a config tenant: both would be one tenant to routes'
    `when.tenants`, route previews and the pages, while their keys, limits and ledger rows differ."""
    if config_tenant(ctx, name) is not None:
        raise AdminError(
            409,
            f"a tenant named {name!r} is defined in the config file (tenants:); choose another name",
            "conflict",
            "name",
        )


@post("/tenants", status_code=201)
async def create_tenant(request: Request, ctx: AdminContext) -> dict[str, Any]:
    body = decode(await request.body(), TenantCreate)
    name = admin_name(body.name, "name")
    refuse_config_name(ctx, name)
    async with ctx.write() as (session, audit):
        tenant = Tenant(
            name=name,
            budget_micro_usd_monthly=_budget_micro(body.budget_usd_monthly),
            rpm=body.rpm,
            tpm=body.tpm,
            max_messages=body.max_messages,
            max_concurrent_streams=body.max_concurrent_streams,
            store_prompts=body.store_prompts,
            prompt_retention_days=body.prompt_retention_days,
        )
        session.add(tenant)
        await session.flush()
        audit("create", "tenant", tenant.id, None, tenant_json(tenant))
    return tenant_json(tenant)


@get("/tenants")
async def list_tenants(ctx: AdminContext) -> dict[str, Any]:
    async with ctx.sessions() as session:
        tenants = (await session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.name))).all()
    return {"data": [*map(tenant_json, tenants), *map(config_tenant_json, ctx.config_tenants)]}


@get("/tenants/{tenant_id:str}")
async def get_tenant(tenant_id: str, ctx: AdminContext) -> dict[str, Any]:
    """An admin-DB tenant by its id, else a config tenant by its id (its name), as GET /tenants
    lists them."""
    config = config_tenant(ctx, tenant_id)
    async with ctx.sessions() as session:
        if config is not None and await session.get(Tenant, tenant_id) is None:
            return config_tenant_json(config)
        return tenant_json(await tenant_or_404(session, tenant_id))


@patch("/tenants/{tenant_id:str}")
async def update_tenant(tenant_id: str, request: Request, ctx: AdminContext) -> dict[str, Any]:
    body = decode(await request.body(), TenantPatch)
    name = admin_name(body.name, "name") if body.name is not msgspec.UNSET else None
    if name is not None:
        refuse_config_name(ctx, name)
    from gateway.admin.routes import lock_route_callers, rename_tenant_in_routes  # it imports this module

    routes_renamed = False
    async with ctx.write() as (session, audit):
        if name is not None:
            # Before the tenant is read: a route write naming the old name waits, or is waited for.
            await lock_route_callers(session)
        tenant = await db_tenant_or_error(ctx, session, tenant_id)
        before = tenant_json(tenant)
        if name is not None and name != tenant.name:
            # Routes' `when.tenants` know the tenant by name: they follow it to the new one.
            routes_renamed = await rename_tenant_in_routes(session, audit, tenant.name, name)
            tenant.name = name
        if body.budget_usd_monthly is not msgspec.UNSET:
            tenant.budget_micro_usd_monthly = _budget_micro(body.budget_usd_monthly)
        if body.rpm is not msgspec.UNSET:
            tenant.rpm = body.rpm
        if body.tpm is not msgspec.UNSET:
            tenant.tpm = body.tpm
        for field in ("max_messages", "max_concurrent_streams", "store_prompts", "prompt_retention_days"):
            if getattr(body, field) is not msgspec.UNSET:
                setattr(tenant, field, getattr(body, field))
        await session.flush()
        after = tenant_json(tenant)
        changed = _without_stamp(after) != _without_stamp(before)
        if changed:  # a PATCH that changes nothing (`{}`, the values it has) is no change to audit
            audit("update", "tenant", tenant.id, before, after)
    if changed:
        await ctx.state.publish_revocation(EVICT_ALL)  # replicas reload limits with the next request
    gateway = getattr(request.app.state, "gateway", None)
    if routes_renamed and gateway is not None and gateway.router.store is not None:
        await gateway.router.store.refresh()  # in force here at once; the other replicas poll
    return after


def _without_stamp(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "updated_at"}


@delete("/tenants/{tenant_id:str}", status_code=204)
async def delete_tenant(tenant_id: str, request: Request, ctx: AdminContext) -> None:
    from gateway.admin.routes import forget_tenant_in_routes, lock_route_callers  # it imports this module

    async with ctx.write() as (session, audit):
        # Before the routes are read: a route write naming the tenant or its keys, checked against
        # them while this delete had not committed, would otherwise be stored naming none.
        await lock_route_callers(session)
        tenant = await db_tenant_or_error(ctx, session, tenant_id)
        keys = (
            await session.execute(select(ApiKey.id, ApiKey.key_hash).where(ApiKey.tenant_id == tenant_id))
        ).all()
        hashes = [key_hash for _, key_hash in keys]
        # Routes' `when.tenants` know the tenant by name: a later tenant of that name must not get them;
        # their `when.keys` lose its keys, which go with it.
        routes_changed = await forget_tenant_in_routes(session, audit, tenant.name, [i for i, _ in keys])
        audit("delete", "tenant", tenant.id, tenant_json(tenant), None)
        await session.delete(tenant)
    for key_hash in hashes:
        await ctx.state.publish_revocation(key_hash)
    gateway = getattr(request.app.state, "gateway", None)
    if routes_changed and gateway is not None and gateway.router.store is not None:
        await gateway.router.store.refresh()  # in force here at once; the other replicas poll


# --- keys --------------------------------------------------------------------------------------


async def refuse_unknown_models(ctx: AdminContext, models: Sequence[str]) -> None:
    """400 for a key's `models` naming what no request could be served as: such a key can never use
    that name (a typo made a key that every request refused with 404). A name is known when the gateway
    serves it (a route or a model) or a route stored in the admin DB has it (one this replica has not
    loaded yet, or leaves out until it is fixed)."""
    if ctx.serves_model is None:
        return
    unknown = [m for m in dict.fromkeys(models) if not ctx.serves_model(m)]
    if unknown:
        async with ctx.sessions() as session:
            stored = set(await session.scalars(select(RouteRow.name).where(RouteRow.name.in_(unknown))))
        unknown = [m for m in unknown if m not in stored]
    if not unknown:
        return
    names = ", ".join(repr(m) for m in unknown)
    raise AdminError(
        400,
        f"no route or model is named {names}, so this key could never use "
        f"{'it' if len(unknown) == 1 else 'them'}: name routes or models (models[].name) the gateway serves",
        "invalid_value",
        "models",
    )


@post("/tenants/{tenant_id:str}/keys", status_code=201)
async def create_key(tenant_id: str, request: Request, ctx: AdminContext) -> dict[str, Any]:
    body = decode(await request.body(), KeyCreate)
    name = None if body.name is None else admin_name(body.name, "name")
    if body.models is not None and not body.models:
        # Shown once and never usable: every request of it refused, as a typo in `models` was.
        raise AdminError(
            400,
            "models is empty, so this key could use no model: list the names it may use, or leave models "
            "out (or null) for every model its tenant may use",
            "invalid_value",
            "models",
        )
    if body.models:
        await refuse_unknown_models(ctx, body.models)
    if body.expires_at is not None:
        if body.expires_at.tzinfo is None:
            raise AdminError(
                400, "expires_at needs a time zone (e.g. 2027-01-01T00:00:00Z)", "invalid_value", "expires_at"
            )
        if _in_utc(body.expires_at, "expires_at") <= utcnow():
            # Issued already expired, the key (shown only now) would be refused from its first request.
            raise AdminError(
                400,
                f"expires_at {body.expires_at.isoformat()} is not in the future: the key would never work",
                "invalid_value",
                "expires_at",
            )
    key, prefix, digest = new_key()
    async with ctx.write() as (session, audit):
        await db_tenant_or_error(ctx, session, tenant_id)
        row = ApiKey(
            tenant_id=tenant_id,
            name=name,
            prefix=prefix,
            key_hash=digest,
            models=body.models,
            expires_at=body.expires_at,
            rpm=body.rpm,
            tpm=body.tpm,
            budget_micro_usd_monthly=_budget_micro(body.budget_usd_monthly),
        )
        session.add(row)
        await session.flush()
        audit("create", "key", row.id, None, key_json(row))
    # The only time the key itself is ever shown.
    return {**key_json(row), "key": key}


@get("/tenants/{tenant_id:str}/keys")
async def list_keys(tenant_id: str, ctx: AdminContext) -> dict[str, Any]:
    async with ctx.sessions() as session:
        await db_tenant_or_error(ctx, session, tenant_id)
        keys = (
            await session.scalars(
                select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
            )
        ).all()
    return {"data": [key_json(k) for k in keys]}


@delete("/keys/{key_id:str}", status_code=204)
async def revoke_key(key_id: str, ctx: AdminContext) -> None:
    async with ctx.write() as (session, audit):
        row = await session.get(ApiKey, key_id)
        if row is None:
            raise AdminError(404, f"no key with id {key_id!r}", "not_found", "key_id")
        if row.revoked_at is None:
            before = key_json(row)
            row.revoked_at = utcnow()
            audit("revoke", "key", row.id, before, key_json(row))
    await ctx.state.publish_revocation(row.key_hash)


# --- prices ------------------------------------------------------------------------------------


@get("/prices")
async def list_prices(
    ctx: AdminContext, model: str | None = None, at: str | None = None, history: bool = False
) -> dict[str, Any]:
    moment = _parse_time(at, "at") if at else utcnow()
    async with ctx.sessions() as session:
        query = select(Price).order_by(
            Price.model, Price.backend, Price.service_tier, Price.token_class, Price.effective_from
        )
        if model:
            query = query.where(Price.model == model)
        rows = (await session.scalars(query)).all()
    if not history:  # only the row valid at `moment` for each (backend, model, tier, class)
        valid: dict[tuple[str, str, str, str], Price] = {}
        for row in rows:
            if row.effective_from <= moment:
                valid[(row.backend, row.model, row.service_tier, row.token_class)] = row
        rows = list(valid.values())
    return {"at": None if history else moment.isoformat(), "data": [price_json(p) for p in rows]}


@put("/prices")
async def put_prices(request: Request, ctx: AdminContext) -> dict[str, Any]:
    body = decode(await request.body(), PricesPut)
    now = utcnow()
    created = []
    async with ctx.write() as (session, audit):
        for i, item in enumerate(body.prices):
            effective = item.effective_from or now
            if effective.tzinfo is None:
                raise AdminError(
                    400, "effective_from needs a time zone", "invalid_value", f"prices[{i}].effective_from"
                )
            _in_utc(effective, f"prices[{i}].effective_from")
            if effective < now - BACKDATE_TOLERANCE:
                raise AdminError(
                    400,
                    "effective_from is in the past: prices apply from now on, history is never re-priced",
                    "invalid_value",
                    f"prices[{i}].effective_from",
                )
            micro = _price_micro(item, i)
            row = Price(
                backend=item.backend,
                model=item.model,
                token_class=str(item.token_class),
                service_tier=item.tier,
                micro_usd_per_mtok=micro,
                effective_from=effective,
            )
            session.add(row)
            created.append(row)
        await session.flush()
        for row in created:
            audit("create", "price", str(row.id), None, price_json(row))
    if ctx.on_prices_changed is not None:
        await ctx.on_prices_changed()
    return {"data": [price_json(p) for p in created]}


# --- reports and audit -------------------------------------------------------------------------


def _parse_time(text: str, param: str) -> dt.datetime:
    try:
        value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise AdminError(
            400, f"{param} must be an ISO 8601 date or time, got {text!r}", "invalid_value", param
        ) from None
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else _in_utc(value, param)


def _in_utc(value: dt.datetime, param: str) -> dt.datetime:
    """`value` (with a time zone) in UTC, as the DB stores it, or a 400: year 9999 at -10:00 or year 1
    at +10:00 has no UTC equivalent, and converting it raised OverflowError, a 500."""
    try:
        return value.astimezone(dt.UTC)
    except OverflowError:
        raise AdminError(
            400,
            f"{param} is outside the years 1 to 9999 once in UTC, got {value.isoformat()}",
            "invalid_value",
            param,
        ) from None


def _range(start: str | None, end: str | None) -> tuple[dt.datetime, dt.datetime]:
    today = utcnow().replace(hour=0, minute=0, second=0, microsecond=0)
    lo = _parse_time(start, "start") if start else today.replace(day=1)
    hi = _parse_time(end, "end") if end else today + dt.timedelta(days=1)
    if hi <= lo:
        raise AdminError(400, "end must be after start", "invalid_value", "end")
    return lo, hi


@get("/reports/usage")
async def usage_report(
    ctx: AdminContext,
    start: str | None = None,
    end: str | None = None,
    group_by: str | None = None,
    format: str = "json",
) -> Response[Any]:
    lo, hi = _range(start, end)
    try:
        groups = reports.parse_group_by(group_by)
    except ValueError as exc:
        raise AdminError(400, str(exc), "invalid_value", "group_by") from None
    if format not in ("json", "csv"):
        raise AdminError(400, "format must be json or csv", "invalid_value", "format")
    async with ctx.sessions() as session:
        report = await reports.usage_report(session, lo, hi, groups)
    if format == "csv":
        name = f"weir-usage-{lo.date()}-{hi.date()}.csv"
        return Response(
            reports.usage_csv(report),
            media_type="text/csv; charset=utf-8",
            headers={"content-disposition": f'attachment; filename="{name}"'},
        )
    return Response(report)


@get("/reports/uptime")
async def uptime_report(
    ctx: AdminContext, start: str | None = None, end: str | None = None
) -> dict[str, Any]:
    lo, hi = _range(start, end)
    async with ctx.sessions() as session:
        return await reports.uptime_report(session, lo, hi)


@get("/audit")
async def audit_log(
    ctx: AdminContext,
    entity: str | None = None,
    entity_id: str | None = None,
    before: int | None = None,
    limit: int = 100,
) -> dict[str, Any]:
    """Newest first. `before` (an entry's `id`): the entries older than it, so the whole log can be
    paged through (only the newest 1,000 could be read); `entity_id`: one tenant's, key's or route's
    history, however many other changes came after it."""
    checked_limit(limit, MAX_AUDIT_LIMIT)
    async with ctx.sessions() as session:
        query = select(AuditLog).order_by(AuditLog.id.desc()).limit(limit)
        if entity:
            query = query.where(AuditLog.entity == entity)
        if entity_id:
            query = query.where(AuditLog.entity_id == entity_id)
        # The column is 32-bit: the driver cannot bind a larger value (a 500), and every id is below it.
        if before is not None and before <= MAX_AUDIT_ID:
            query = query.where(AuditLog.id < max(before, 0))
        rows = (await session.scalars(query)).all()
    return {
        # Where the next page starts: null once this page reached the oldest entry.
        "next_before": rows[-1].id if len(rows) == limit else None,
        "data": [
            {
                "id": r.id,
                "ts": r.ts.isoformat(),
                "actor": r.actor,
                "action": r.action,
                "entity": r.entity,
                "entity_id": r.entity_id,
                "before": r.before,
                "after": r.after,
            }
            for r in rows
        ],
    }


def admin_router(ctx: AdminContext, path: str = "/admin/api/v1") -> Router:
    return Router(
        path=path,
        route_handlers=[
            create_tenant,
            list_tenants,
            get_tenant,
            update_tenant,
            delete_tenant,
            create_key,
            list_keys,
            revoke_key,
            list_prices,
            put_prices,
            usage_report,
            uptime_report,
            audit_log,
            recent_requests,
            spend_by_class,
            preview_route,
            routing_savings,
            *_route_handlers(),
            *_head_handlers(),
            *_comparison_handlers(),
            *_security_handlers(),
        ],
        guards=[_admin_guard(ctx)],
        dependencies={"ctx": Provide(lambda: ctx, use_cache=True, sync_to_thread=False)},
        exception_handlers={
            AdminError: _on_admin_error,
            HTTPException: _on_http_error,
            DBAPIError: _on_db_error,
            Exception: _on_unexpected,
        },
    )


def _route_handlers() -> list[Any]:
    from gateway.admin.routes import ROUTE_HANDLERS  # routes.py imports this module

    return ROUTE_HANDLERS


def _head_handlers() -> list[Any]:
    from gateway.admin.heads import HEAD_HANDLERS  # heads.py imports this module

    return HEAD_HANDLERS


def _comparison_handlers() -> list[Any]:
    from gateway.admin.comparisons import COMPARISON_HANDLERS  # it imports this module

    return COMPARISON_HANDLERS


def _security_handlers() -> list[Any]:
    from gateway.admin.security_api import SECURITY_HANDLERS  # it imports this module

    return SECURITY_HANDLERS
