"""Admin API for routes: `/admin/api/v1/routes` (list, create, read, replace, delete) and
`/admin/api/v1/routes/status` (breakers, routes' latency breakers, affinity hit rates, observed
speeds, trained heads loaded). Both say which stored routes the answering replica leaves out and why,
and why it refused the table as a whole, if it did.

A route body is a `routing.routes.Route` as JSON, plus an optional `position` (routes sharing a
name are tried in position order). Writes are validated against the gateway's models before they
are stored, audited in the same transaction, applied on this replica at once and picked up by the
others within their poll interval.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from typing import Annotated, Any

import msgspec
from litestar import Request, delete, get, post, put
from sqlalchemy import false, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.admin.router import AdminContext, AdminError, decode
from gateway.auth import key_id
from gateway.db.models import ApiKey, DifficultyHeadRow, RouteRow, Tenant, utcnow
from routing.router import RouteError, Router, validate
from routing.routes import Conditions, Route
from routing.store import route_spec, stamp

# The admin DB's `routes.position` column is a 32-bit integer: beyond it the insert itself fails.
LAST_POSITION = 2**31 - 1
Position = Annotated[int, msgspec.Meta(ge=-(2**31), le=LAST_POSITION)]


class RouteBody(Route, kw_only=True, frozen=True):
    position: Position | None = None
    # What GET returns beside the route, so a route read, edited and sent back is accepted: the row's
    # id (a PUT to another route's id is refused) and its last change (ignored: the server sets it;
    # send it as `If-Match` to refuse the write when the route changed since it was read).
    id: int | None = None
    updated_at: str | None = None


def _router(request: Request) -> Router:
    return request.app.state.gateway.router


def route_json(row: RouteRow) -> dict[str, Any]:
    return {"id": row.id, "position": row.position, **row.spec, "updated_at": row.updated_at.isoformat()}


async def _checked(
    request: Request, body: bytes, session: AsyncSession, route_id: int | None = None
) -> tuple[Route, int | None]:
    parsed = decode(body, RouteBody)
    if route_id is not None and parsed.id not in (None, route_id):
        raise AdminError(400, f"the body is route {parsed.id}, not route {route_id}", "invalid_value", "id")
    fields = {f: getattr(parsed, f) for f in Route.__struct_fields__}
    route = Route(**fields)
    try:
        validate([route], _router(request).models)
    except RouteError as exc:
        # "routes[0] (NAME).retry.jitter: ..." names the field; "routes[0] (NAME): no model named ..."
        # is about the models the route lists.
        message, prefix = str(exc), f"routes[0] ({route.name})"
        rest = message[len(prefix) :] if message.startswith(prefix) else ""
        param = rest[1:].split(":", 1)[0] if rest.startswith(".") else "candidates"
        known = _router(request).models.targets
        if rest.startswith(": no model named") and all(c.model in known for c in route.candidates):
            param = "fallbacks"  # candidates are checked first: every one is known, so a fallback is not
        raise AdminError(400, message.replace("routes[0] ", "", 1), "invalid_value", param) from None
    if route.head is not None and await session.get(DifficultyHeadRow, route.head) is None:
        raise AdminError(
            400,
            f"no difficulty head named {route.head!r}: upload it first (PUT /admin/api/v1/difficulty-heads/"
            f"{route.head}, or `weir router heads install`)",
            "invalid_value",
            "head",
        )
    await _refuse_unknown_callers(request, session, route.when)
    return route, parsed.position


async def _refuse_unknown_callers(request: Request, session: AsyncSession, when: Conditions | None) -> None:
    """400 for `when.tenants` or `when.keys` naming a tenant or key that does not exist: no request
    could ever carry it, so a typo made a route that silently never matched (its tenant's requests
    went to the route or model everyone else gets). Known: the admin DB's tenants (by name) and keys
    (by id, revoked ones too: a revocation must not make the routes naming the key unwritable), and
    the config file's tenants and their keys (`key_` ids, as the ledger has them)."""
    if when is None:
        return
    config_tenants = request.app.state.gateway.config.tenants or []
    if when.tenants:
        stored = select(Tenant.name).where(Tenant.name.in_(when.tenants))
        known = {t.name for t in config_tenants} | set(await session.scalars(stored))
        _refuse_unknown("when.tenants", [t for t in when.tenants if t not in known])
    if when.keys:
        stored = select(ApiKey.id).where(ApiKey.id.in_(when.keys))
        known = {key_id(k) for t in config_tenants for k in t.api_keys} | set(await session.scalars(stored))
        _refuse_unknown("when.keys", [k for k in when.keys if k not in known])


def _refuse_unknown(param: str, unknown: list[str]) -> None:
    if not unknown:
        return
    names = ", ".join(repr(n) for n in dict.fromkeys(unknown))
    what = "tenant is named" if param == "when.tenants" else "key has the id"
    takes = (
        "the names of existing tenants"
        if param == "when.tenants"
        else "the ids of existing keys (a key's `id` in the admin API, `key_` and 12 hex digits for a config key)"
    )
    raise AdminError(
        400,
        f"no {what} {names}: {param} takes {takes} (one that is none matches no request)",
        "invalid_value",
        param,
    )


async def _applied(request: Request, route_id: int | None = None) -> None:
    """Put a committed write in force on this replica now (the others poll). `_checked` refuses a route
    this replica's load would leave out, so that is not expected; should it happen all the same (or
    the table be refused as a whole), the answer says so rather than report a change not in force."""
    store = _router(request).store
    if store is None:
        return
    await store.refresh()
    left_out = next((r for r in store.left_out if r.id == route_id), None)
    if left_out is not None:
        message = (
            f"route {left_out.id} ({left_out.name}) is stored, but this replica leaves it out "
            f"({left_out.error}): fix it with a PUT or delete it"
        )
    elif store.rejected is not None:
        message = (
            "the change is stored, but this replica keeps the routes it had: it refused the routes "
            f"table ({store.rejected})"
        )
    else:
        return
    raise AdminError(409, message, "route_left_out")


async def _row(session: Any, route_id: int, *, lock: bool = False) -> RouteRow:
    """`lock`: read it from the database again, not the session's copy, and lock it (PostgreSQL; on
    SQLite a transaction holds the write lock from its first write on)."""
    # An id beyond 64 bits names no row, and the database driver cannot even bind it (a 500).
    row = (
        await session.get(RouteRow, route_id, with_for_update=lock, populate_existing=lock)
        if 0 < route_id < 2**63
        else None
    )
    if row is None:
        raise AdminError(404, f"no route with id {route_id}", "not_found", "route_id")
    return row


def _unchanged_since_read(request: Request, row: RouteRow) -> None:
    """`If-Match: <updated_at as read>`: refuse a write made from an older read of the route (a 412,
    nothing changed), so a form left open does not silently undo another admin's newer edit."""
    wanted = request.headers.get("if-match")
    if wanted is None:
        return
    tags = [t.strip().removeprefix("W/").strip('"') for t in wanted.split(",")]
    current = row.updated_at.isoformat()
    if "*" in tags or current in tags:
        return
    raise AdminError(
        412,
        f"route {row.id} ({row.name}) was changed at {current}, after you read it: reload it and make "
        "your change again",
        "route_changed",
        "updated_at",
    )


async def _claimed(request: Request, session: AsyncSession, route_id: int) -> RouteRow:
    """Route `route_id` as this transaction writes it: read, checked against `If-Match`, and held
    until the transaction ends by a first write made on the condition that the row is still the one
    read (`UPDATE ... WHERE revision = <as read>`, one row or none).

    A lock taken on the read holds on PostgreSQL only: SQLite ignores SELECT ... FOR UPDATE, and its
    driver reads outside the transaction until the first write, so two writers from one read both
    passed a check made on the read, and the second silently undid the first (and audited the route
    it had read as the one it replaced). A write that finds the row changed reads it again, now under
    the write lock (SQLite's, or PostgreSQL's row lock), and checks that: a 412 for a client whose
    `If-Match` names the older read, the route as it is now for one without."""
    for lock in (False, True):  # as read, then (another write came first) as it is under the lock
        row = await _row(session, route_id, lock=lock)
        _unchanged_since_read(request, row)
        claim = (
            update(RouteRow)
            .where(RouteRow.id == row.id, RouteRow.revision == row.revision)
            .values(revision=RouteRow.revision + 1)
            .execution_options(synchronize_session=False)
        )
        claimed = await session.execute(claim)
        if claimed.rowcount == 1:  # type: ignore[attr-defined]  # an UPDATE gives a CursorResult
            return row
    raise AssertionError(f"route {route_id} changed under its write lock")


async def _lock_name(session: AsyncSession, name: str) -> None:
    """Hold the route name `name` until the transaction ends: the check that a delete or a rename
    leaves the name a route (`_still_named`) and the write are then one step for each name. Two
    transactions that each removed one of a name's last two routes each counted the other's route
    as still there (neither had committed) and both went through. On PostgreSQL a transaction
    advisory lock on the name: the second waits for the first to end, and its count (a new
    snapshot, at READ COMMITTED) sees what the first wrote. On SQLite the writes are serial already:
    the row's claim (`_claimed`) takes the database's write lock before the count."""
    await _advisory_lock(session, b"weir-route-name\0" + name.encode())


async def lock_route_callers(session: AsyncSession) -> None:
    """Hold the tenants and keys that routes' `when` may name until the transaction ends: taken first
    by every route write (before `_refuse_unknown_callers` checks them, and before any other lock, so
    the order is one) and by a tenant's delete or rename before it rewrites the routes naming it.
    Without it a route written while a delete of its tenant had not committed passed the check, the
    delete did not see the route, and the route was stored naming a tenant that was gone (a later
    tenant of that name got it); and a rename's rewrite of a route read before a PUT of it committed
    undid that PUT. One lock for all of them: route writes and tenant deletes are rare. On
    PostgreSQL an advisory lock, as `_lock_name`; on SQLite the database's write lock, taken by a
    write that changes nothing: its driver reads outside any transaction until the first write, so
    the reads before it (the check, the rewrite's scan) were not serial at all."""
    if session.get_bind().dialect.name == "sqlite":
        noop = update(RouteRow).where(false()).values(revision=RouteRow.revision)
        await session.execute(noop.execution_options(synchronize_session=False))
        return
    await _advisory_lock(session, b"weir-route-callers")


async def _advisory_lock(session: AsyncSession, key: bytes) -> None:
    """A PostgreSQL transaction advisory lock on `key` (hashed to its 64-bit id); nothing on SQLite."""
    if session.get_bind().dialect.name != "postgresql":
        return
    digest = hashlib.blake2b(key, digest_size=8).digest()
    await session.execute(select(func.pg_advisory_xact_lock(int.from_bytes(digest, "big", signed=True))))


async def _still_named(
    request: Request, session: AsyncSession, row: RouteRow, name: str | None = None
) -> None:
    """409 `route_in_use` when deleting `row` (`name` None) or renaming it to `name` leaves its name
    with no route, no model of the config serves it, and callers may still use it: a config tenant's
    or a live key's `models` names it. Such a key is refused when issued (it could never use the
    name, `refuse_unknown_models`); made so by a route's removal, every request of it for the name was
    a 404, and the admin who removed it was told nothing."""
    if name == row.name or row.name in _router(request).models.targets:
        return
    await _lock_name(session, row.name)
    others = await session.scalar(
        select(func.count(RouteRow.id)).where(RouteRow.name == row.name, RouteRow.id != row.id)
    )
    if others:
        return
    tenants = request.app.state.gateway.config.tenants or []
    holders = [f"config tenant {t.name!r}" for t in tenants if t.models is not None and row.name in t.models]
    now = utcnow()
    keys = await session.execute(
        select(ApiKey.id, ApiKey.models, ApiKey.expires_at).where(ApiKey.revoked_at.is_(None))
    )
    holders += [
        f"key {key_id}"
        for key_id, models, expires_at in keys
        if isinstance(models, list) and row.name in models and (expires_at is None or expires_at > now)
    ]
    if not holders:
        return
    shown = ", ".join(holders[:5]) + (f" and {len(holders) - 5} more" if len(holders) > 5 else "")
    raise AdminError(
        409,
        f"route {row.id} is the last route named {row.name!r}, which {shown} may use: without it their "
        f"requests for {row.name!r} would get 404. Add another route of that name first, or revoke those "
        "keys (a config tenant's `models` is changed in the config)",
        "route_in_use",
        "name",
    )


async def rename_tenant_in_routes(
    session: AsyncSession, audit: Callable[..., None], old: str, new: str
) -> bool:
    """A tenant renamed from `old` to `new` (`PATCH /tenants/{id}`): the stored routes whose
    `when.tenants` name it name it anew, each audited, in the tenant's transaction. Routes know tenants
    by name, and left naming the old one, the tenant's requests silently went to whatever route or
    model the others get. Whether any route changed (the caller refreshes the route store)."""

    def renamed(tenants: list[str]) -> list[str]:
        return list(dict.fromkeys(new if t == old else t for t in tenants)) if old in tenants else tenants

    return await _rewrite_callers(session, audit, {"tenants": renamed})


async def forget_tenant_in_routes(
    session: AsyncSession, audit: Callable[..., None], name: str, key_ids: Collection[str] = ()
) -> bool:
    """A tenant deleted (`DELETE /tenants/{id}`) with its keys `key_ids`: the stored routes whose
    `when.tenants` name it, or whose `when.keys` name one of its keys, name them no more, each
    audited, in the tenant's transaction. Routes know tenants by name, and left naming it, a tenant
    created later with the same name silently got them (another customer's dedicated models); a key
    id left behind names no key, which a write of the route is refused for. A route that named only
    them is deleted: with them gone its condition would be empty, which no route may have
    (`when.tenants: []` matches nobody, and dropping the condition would open the route to every
    tenant), and no one else could use it. Whether any route changed (the caller refreshes the route
    store)."""
    keys = set(key_ids)
    return await _rewrite_callers(
        session,
        audit,
        {
            "tenants": lambda tenants: [t for t in tenants if t != name],
            "keys": lambda ids: [k for k in ids if k not in keys],
        },
    )


async def _rewrite_callers(
    session: AsyncSession, audit: Callable[..., None], rewrites: dict[str, Callable[[list[str]], list[str]]]
) -> bool:
    """Give every stored route the `when` lists (`tenants`, `keys`) that `rewrites` make of its own,
    each route changed audited; a route whose list is left empty is deleted. Whether any changed."""
    changed = False
    for row in (await session.scalars(select(RouteRow))).all():
        when = row.spec.get("when") if isinstance(row.spec, dict) else None
        if not isinstance(when, dict):
            continue
        lists = {f: when[f] for f in rewrites if isinstance(when.get(f), list)}
        rewritten = {f: rewrites[f](values) for f, values in lists.items()}
        if rewritten == lists:
            continue
        changed = True
        before = route_json(row)
        if any(lists[f] and not values for f, values in rewritten.items()):
            audit("delete", "route", str(row.id), before, None)
            await session.delete(row)
            continue
        row.spec = {**row.spec, "when": {**when, **rewritten}}
        row.updated_at = await stamp(session, utcnow())  # its revision moves on too (`revision_column`)
        await session.flush()
        audit("update", "route", str(row.id), before, route_json(row))
    return changed


def _not_in_force(router: Router) -> dict[str, Any]:
    """Stored routes this replica does not serve ({id, name, error}), and why it keeps routes older than
    the table (null unless the table as a whole was refused): what the admin who must fix them needs."""
    store = router.store
    return {
        "left_out": msgspec.to_builtins(store.left_out) if store is not None else [],
        "routes_rejected": store.rejected if store is not None else None,
    }


@get("/routes")
async def list_routes(request: Request, ctx: AdminContext) -> dict[str, Any]:
    async with ctx.sessions() as session:
        rows = (await session.scalars(select(RouteRow).order_by(RouteRow.position, RouteRow.id))).all()
    router = _router(request)
    # `data` lists every stored row, served or not, so one left out can still be fixed or deleted.
    return {
        "version": router.version,
        "data": [route_json(r) for r in rows],
        **_not_in_force(router),
        "model_max_output_tokens": _model_output_limits(router),
    }


def _model_output_limits(router: Router) -> dict[str, int]:
    """The answering replica's `models[].max_output_tokens`, of the models that set one: the limit a
    candidate without its own, and every fallback, inherits (`routing.plan.Choice.max_output_tokens`).
    Models live in the config, not the admin DB, so a route's own fields cannot show it."""
    return {
        name: limit
        for name, target in router.models.targets.items()
        if (limit := target.model.max_output_tokens) is not None
    }


@post("/routes", status_code=201)
async def create_route(request: Request, ctx: AdminContext) -> dict[str, Any]:
    body = await request.body()
    async with ctx.write() as (session, audit):
        await lock_route_callers(session)
        route, position = await _checked(request, body, session)
        if position is None:
            # After every other route. Past the last position that is the last one itself: routes
            # of one position are tried in the order they were created (ids only grow).
            last = (await session.scalar(select(func.max(RouteRow.position)))) or 0
            position = min(last + 1, LAST_POSITION)
        updated_at = await stamp(session, utcnow())
        row = RouteRow(name=route.name, position=position, spec=route_spec(route), updated_at=updated_at)
        session.add(row)
        await session.flush()
        audit("create", "route", str(row.id), None, route_json(row))
    await _applied(request, row.id)
    return route_json(row)


@get("/routes/{route_id:int}")
async def get_route(route_id: int, ctx: AdminContext) -> dict[str, Any]:
    async with ctx.sessions() as session:
        return route_json(await _row(session, route_id))


@put("/routes/{route_id:int}")
async def replace_route(route_id: int, request: Request, ctx: AdminContext) -> dict[str, Any]:
    body = await request.body()
    async with ctx.write() as (session, audit):
        await lock_route_callers(session)
        route, position = await _checked(request, body, session, route_id)
        row = await _claimed(request, session, route_id)
        await _still_named(request, session, row, route.name)
        before = route_json(row)
        spec, position = route_spec(route), row.position if position is None else position
        if (row.name, row.spec, row.position) != (route.name, spec, position):
            # Stamped once the row is held: on SQLite no other write comes before this one commits.
            # A PUT of the route as it is changes nothing: no new `updated_at`, no audit entry.
            updated_at = await stamp(session, utcnow())
            row.name, row.spec, row.position, row.updated_at = route.name, spec, position, updated_at
            await session.flush()
            audit("update", "route", str(row.id), before, route_json(row))
    await _applied(request, row.id)
    return route_json(row)


@delete("/routes/{route_id:int}", status_code=204)
async def delete_route(route_id: int, request: Request, ctx: AdminContext) -> None:
    async with ctx.write() as (session, audit):
        await lock_route_callers(session)
        row = await _claimed(request, session, route_id)
        await _still_named(request, session, row)
        audit("delete", "route", str(row.id), route_json(row), None)
        await session.delete(row)
    await _applied(request)


@get("/routes/status")
async def routes_status(request: Request) -> dict[str, Any]:
    router = _router(request)
    context = router.context
    return {
        "version": router.version,
        # This replica's supervised engines: the state /readyz says, and why each last stopped (the
        # engine's own last error), which /readyz leaves out as it needs no token.
        "engines": {
            engine.backend.name: {"state": engine.state, "error": engine.error}
            for engine in request.app.state.gateway.engines
        },
        "routes": {name: [msgspec.to_builtins(r) for r in routes] for name, routes in router.routes.items()},
        **_not_in_force(router),
        "breakers": {key: b.current().value for key, b in router.breakers.breakers.items()},
        # Routes' own breakers for their TTFT timeouts on models other routes wait longer for
        # (routing.breaker.Breakers.too_slow), by route and backend/model; this replica's own.
        "latency_breakers": router.breakers.latency_states(),
        "prefix_affinity_hit_rate": {name: context.affinity_hit_rate(name) for name in context.affinity},
        # What the replicas' prefix caches served of those routes' prompts (their usage reports).
        "prefix_affinity_cache": {
            name: context.stats.affinity_cache(name) for name in context.stats.affinity_tokens
        },
        # Trained heads the routes name, as this replica serves them: loaded (name@digest), or why not.
        "difficulty_heads": {
            name: (loaded.label if (loaded := heads.get(name)) else heads.status(name))
            for name in sorted(heads.wanted)
        }
        if (heads := router.heads) is not None
        else {},
        "models": {
            f"{backend}/{model}": {
                "ttft_s": s.ttft_s,
                "p95_ttft_s": s.p95_ttft(),
                "tokens_per_s": s.tokens_per_s,
                "cache_hit_rate": s.cache_hit_rate,
                "samples": s.samples,
            }
            for (backend, model), s in router.stats.models.items()
        },
    }


ROUTE_HANDLERS = [list_routes, create_route, get_route, replace_route, delete_route, routes_status]
