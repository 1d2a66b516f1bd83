"""`GET /admin/api/v1/requests`: the recent request log, one entry per request with every upstream
attempt (backend, model, status, latency, tokens, cost), read from the usage ledger."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import msgspec
from litestar import Request, get, post
from sqlalchemy import and_, or_, select

from gateway.accounting.money import format_usd, pico_to_usd
from gateway.accounting.pricing import USAGE_FIELD, TokenClass
from gateway.accounting.reports import REQUEST_KEY
from gateway.admin.keys import key_principal
from gateway.auth import Principal, tenant_principal
from gateway.config import Tenant as ConfigTenant
from gateway.db.models import ApiKey, Tenant, UsageEventRow
from gateway.errors import GatewayError
from gateway.estimate import input_tokens
from gateway.types import ChatRequest, ContentPart, ImagePart, ImageURL, Message, TextPart
from routing.plan import Features

MAX_LIMIT = 500
# The log is found from the newest attempts, read in pages of this many rows per request wanted; each
# request found is then read whole, however many attempts it took.
ATTEMPTS_PER_REQUEST = 4
# With a status filter most requests found may be left out: the scan stops after this many pages.
MAX_PAGES = 10
# Attempts read per request found: far more than retries, fallbacks and hedges make.
MAX_ATTEMPTS_READ = 100


def _attempt(row: UsageEventRow) -> dict[str, Any]:
    return {
        "attempt": row.attempt,
        "ts": row.ts.isoformat(),
        "backend": row.backend,
        "model": row.model,
        "status": row.status,
        "fallback": row.fallback,
        "routing": row.routing,  # the x-weir-route decision as of this attempt
        "latency_ms": row.latency_ms,
        "ttft_ms": row.ttft_ms,
        # Every token class its cost is priced from (cache writes cost more than input), and whether
        # the gateway estimated them (a cut attempt) rather than its vendor reporting them.
        "input_tokens": row.input_tokens,
        "cached_input_tokens": row.cached_input_tokens,
        "cache_write_5m_tokens": row.cache_write_5m_tokens,
        "cache_write_1h_tokens": row.cache_write_1h_tokens,
        "output_tokens": row.output_tokens,
        "reasoning_tokens": row.reasoning_tokens,
        "web_search_requests": row.web_search_requests,  # billed per search, beside the tokens
        "estimated": row.estimated,
        "service_tier": row.service_tier,  # the tier its vendor served it at, which priced it
        "cost_usd": format_usd(pico_to_usd(row.cost_pico_usd)),
    }


def _request(attempts: list[UsageEventRow], names: dict[str, str]) -> dict[str, Any]:
    """One request of the log, from all its attempts."""
    attempts.sort(key=lambda r: r.attempt)
    # The attempt that answered stands for the request, else the last one: a hedge that lost is a
    # later attempt (cancelled, 499) than the primary that won.
    last = next((r for r in reversed(attempts) if _ok(r.status)), attempts[-1])
    return {
        "request_id": last.request_id,
        "exchange_id": last.exchange_id,  # set when request_id is the client's (x-request-id)
        # Why Weir itself made it (`compare`, `judge`: a difficulty route's comparison, its routing
        # saying `for=` which client request), None for a client's request: the usage report and the
        # uptime report's tenants count only those.
        "purpose": last.purpose,
        "ts": attempts[0].ts.isoformat(),
        "tenant_id": last.tenant_id,
        "tenant_name": names.get(last.tenant_id or ""),
        "key_id": last.key_id,
        "route": last.route,
        "routing": last.routing,
        "backend": last.backend,
        "model": last.model,
        "status": last.status,
        "latency_ms": _wall_time_ms(attempts, last),
        "cost_usd": format_usd(pico_to_usd(sum(r.cost_pico_usd for r in attempts))),
        "attempts": [_attempt(r) for r in attempts],
    }


def _wall_time_ms(attempts: list[UsageEventRow], last: UsageEventRow) -> float:
    """The request's latency as its client saw it: from its first attempt's start to the end of the one
    that answered (else of the last to end). Not the attempts' sum: hedged attempts run at once."""
    ended = [last] if _ok(last.status) else attempts
    end = max(
        r.ts + dt.timedelta(milliseconds=r.latency_ms if math.isfinite(r.latency_ms) else 0.0) for r in ended
    )
    return round((end - min(r.ts for r in attempts)) / dt.timedelta(milliseconds=1), 3)


def _ok(status: int) -> bool:
    return 200 <= status < 300


def _status_matches(wanted: str, status: int) -> bool:
    if wanted == "ok":
        return _ok(status)
    if wanted == "error":
        return not _ok(status)
    return str(status) == wanted


@get("/requests")
async def recent_requests(
    ctx: Any,
    tenant: str | None = None,
    model: str | None = None,
    status: str | None = None,
    limit: int = 100,
) -> dict[str, Any]:
    """Newest first. `tenant` (id), `model` (requests with an attempt on that upstream model, or for
    that public name: a route), `status` (`ok`, `error` or an HTTP code, matched against the attempt
    that answered, else the request's last attempt)."""
    from gateway.admin.router import AdminError, checked_limit  # the router imports this module

    if status not in (None, "", "ok", "error") and not (status or "").isdigit():
        raise AdminError(400, "status must be ok, error or an HTTP status code", "invalid_value", "status")
    checked_limit(limit, MAX_LIMIT)
    page_rows = limit * ATTEMPTS_PER_REQUEST
    # In (ts, event_id) order, each page read from where the last ended (a keyset): with OFFSET over
    # `ts` alone, attempts of one timestamp across a page boundary came in any order, so a page could
    # repeat some and skip others (a request missing from the log), and attempts written between two
    # pages shifted the next one.
    newest = (
        select(*REQUEST_KEY, UsageEventRow.ts, UsageEventRow.event_id)
        .order_by(UsageEventRow.ts.desc(), UsageEventRow.event_id.desc())
        .limit(page_rows)
    )
    if tenant:
        newest = newest.where(UsageEventRow.tenant_id == tenant)
    if model:
        # A request matches when any attempt was on that upstream model or for that public name (a
        # route); it is then shown whole: a request that failed over, filtered by the model that
        # failed, still shows the attempt that answered it.
        newest = newest.where(or_(UsageEventRow.model == model, UsageEventRow.route == model))
    data: list[dict[str, Any]] = []
    seen: set[tuple[str | None, str, str | None]] = set()
    async with ctx.sessions() as session:
        names = dict((await session.execute(select(Tenant.id, Tenant.name))).tuples().all())
        page = newest
        for _ in range(MAX_PAGES):
            found = (await session.execute(page)).tuples().all()
            # Newest first. A client may send its own x-request-id, on many requests: they are kept
            # apart by tenant and by the gateway's own id of each exchange.
            keys = [(tenant_id, request_id, exchange_id) for tenant_id, request_id, exchange_id, *_ in found]
            grouped: dict[tuple[str | None, str, str | None], list[UsageEventRow]] = {
                key: [] for key in dict.fromkeys(keys) if key not in seen
            }
            seen.update(grouped)
            attempts = (
                select(UsageEventRow)
                .where(UsageEventRow.request_id.in_({request_id for _, request_id, _ in grouped}))
                .order_by(UsageEventRow.ts.desc())
                # Bounded even when a client sends the same x-request-id on every request.
                .limit(len(grouped) * MAX_ATTEMPTS_READ)
            )
            for row in (await session.scalars(attempts)).all():
                if (key := (row.tenant_id, row.request_id, row.exchange_id)) in grouped:
                    grouped[key].append(row)
            for rows in grouped.values():
                if not rows:
                    continue  # its attempts were crowded out of the bounded read above
                entry = _request(rows, names)
                if not status or _status_matches(status, entry["status"]):
                    data.append(entry)
                if len(data) == limit:
                    return {"data": data}
            if len(found) < page_rows:
                break  # the ledger holds no older attempts
            *_, last_ts, last_id = found[-1]
            page = newest.where(
                or_(
                    UsageEventRow.ts < last_ts,
                    and_(UsageEventRow.ts == last_ts, UsageEventRow.event_id < last_id),
                )
            )
    return {"data": data}


@get("/reports/spend-by-class")
async def spend_by_class(ctx: Any, start: str | None = None, end: str | None = None) -> dict[str, Any]:
    """Spend per day split by token class, from the event ledger: each attempt's tokens of a class
    (searches, for `web_search`) times the price it was billed at (kept on the event), so the classes
    add up to its exact cost."""
    from gateway.admin.router import _range

    lo, hi = _range(start, end)
    columns = [getattr(UsageEventRow, USAGE_FIELD[c]) for c in TokenClass]
    query = (
        select(UsageEventRow.day, UsageEventRow.prices, *columns)
        .where(UsageEventRow.ts >= lo, UsageEventRow.ts < hi)
        .execution_options(yield_per=5000)
    )
    days: dict[str, dict[str, int]] = {}
    async with ctx.sessions() as session:
        async for day, prices, *tokens in await session.stream(query):
            into = days.setdefault(day.isoformat(), dict.fromkeys(map(str, TokenClass), 0))
            for token_class, count in zip(TokenClass, tokens, strict=True):
                into[str(token_class)] += count * (prices or {}).get(str(token_class), 0)
    totals = dict.fromkeys(map(str, TokenClass), 0)
    data = []
    for day in sorted(days):
        for name, pico in days[day].items():
            totals[name] += pico
        by_class = {name: format_usd(pico_to_usd(pico)) for name, pico in days[day].items()}
        data.append({"day": day, "cost_usd_by_class": by_class})
    return {
        "start": lo.isoformat(),
        "end": hi.isoformat(),
        "data": data,
        "totals": {name: format_usd(pico_to_usd(pico)) for name, pico in totals.items()},
    }


class PreviewBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A sample request: the model name a client would send and its last user message."""

    model: str
    prompt: str
    tenant: str | None = None  # tenant name, for routes with `when.tenants`
    key_id: str | None = None
    tools: bool = False
    images: bool = False
    metadata: dict[str, str] = {}
    max_tokens: int | None = None


def _sample_request(body: PreviewBody) -> ChatRequest:
    """The request a preview stands for, as far as its prompt's length goes: its prompt as the user's
    turn, with one image (by URL) where it says the request has images."""
    content: str | list[ContentPart] = body.prompt
    if body.images:
        content = [
            TextPart(text=body.prompt),
            ImagePart(image_url=ImageURL(url="https://preview.invalid/image")),
        ]
    return ChatRequest(model=body.model, messages=[Message(role="user", content=content)])


async def _preview_principal(body: PreviewBody, tenants: list[ConfigTenant], ctx: Any) -> Principal | None:
    """Who the preview plans for, with the models they may use, as their own requests are: the
    admin-DB key `key_id` names, else the config tenant `tenant` names. None for anyone else (an
    admin-DB tenant limits no models, only its keys do)."""
    from gateway.admin.router import AdminError

    if body.key_id is not None:
        async with ctx.sessions() as session:
            row = (
                await session.execute(
                    select(ApiKey, Tenant)
                    .join(Tenant, ApiKey.tenant_id == Tenant.id)
                    .where(ApiKey.id == body.key_id)
                )
            ).first()
        if row is not None:
            key, tenant = row
            if body.tenant is not None and body.tenant != tenant.name:
                raise AdminError(
                    400, f"key_id: the key belongs to the tenant {tenant.name!r}", "invalid_value", "key_id"
                )
            return key_principal(key, tenant)
    for tenant in tenants:
        if tenant.name == body.tenant:
            return tenant_principal(tenant, body.key_id)
    return None


@post("/routes/preview", status_code=200)
async def preview_route(request: Request, ctx: Any) -> dict[str, Any]:
    """Where a sample prompt would go and why: the route that matches, the candidates in the order
    they would be tried, each with its policy score and reason. Nothing is sent upstream. Policies
    that draw at random (`weighted`) show one draw."""
    from gateway.admin.router import AdminError, decode

    body = decode(await request.body(), PreviewBody)
    if not body.model.strip():
        raise AdminError(400, "model: enter the model name a client would send", "invalid_value", "model")
    gateway = request.app.state.gateway
    known = await _preview_principal(body, gateway.config.tenants or [], ctx)
    principal = known or Principal(
        tenant_id="preview", tenant_name=body.tenant or "preview", key_id=body.key_id
    )
    feats = Features(
        prompt=body.prompt,
        history_chars=None,
        last_user=body.prompt,
        prompt_tokens=input_tokens(_sample_request(body)),
        requested_output_tokens=body.max_tokens,
        tools=body.tools,
        images=body.images,
        metadata=body.metadata,
        tags=frozenset(t.strip() for t in body.metadata.get("tags", "").split(",") if t.strip()),
        tenant=known.tenant_name if known is not None else body.tenant,  # a DB key's own tenant
        key_id=body.key_id,
    )
    router = gateway.router
    try:
        plan = await router.plan(body.model, principal, feats, record=False)
    except GatewayError as exc:
        raise AdminError(400, f"model: {exc}", "invalid_value", "model") from None
    routed = any(plan.route is r for r in router.routes.get(body.model, []))
    return {
        "model": body.model,
        "routed": routed,
        "route": msgspec.to_builtins(plan.route) if routed else None,
        "policy": plan.route.policy if routed else None,
        "note": plan.note,
        "header": plan.header(),
        "prompt_tokens": feats.prompt_tokens,
        "choices": [
            {
                "model": c.candidate.model,
                "backend": c.target.backend.name,
                "upstream_model": c.target.upstream_model,
                "score": c.score,
                "reason": c.reason,
            }
            for c in plan.choices
        ],
    }


@get("/reports/routing-savings")
async def routing_savings(
    request: Request, ctx: Any, start: str | None = None, end: str | None = None
) -> dict[str, Any]:
    """Per day: what routed requests cost against what they would have cost on their route's most
    expensive candidate (the "send everything to the strongest model" baseline), priced at the
    prices in effect when each request ran, at the service tier its attempt was served at where the
    baseline model prices that tier (as the attempt itself was billed: flex traffic priced against a
    base-price baseline showed flex's discount as routing's savings), and at its long-context rates
    where the attempt's prompt is above the model's threshold (`pipeline.model_prices`, the rule that
    billed the attempt: at its base rates, a long prompt's baseline was below what it cost). Requests
    to a plain model (no route, or a route with one candidate) count on both sides alike. Routes are
    today's: a route since changed is judged by its current candidates."""
    from gateway.accounting.catalog import load_catalog
    from gateway.accounting.pricing import resolve
    from gateway.admin.router import _range
    from gateway.pipeline import model_prices

    lo, hi = _range(start, end)
    router = request.app.state.gateway.router
    targets = router.models.targets
    columns = [getattr(UsageEventRow, USAGE_FIELD[c]) for c in TokenClass]
    query = (
        select(
            UsageEventRow.day,
            UsageEventRow.ts,
            UsageEventRow.route,
            UsageEventRow.service_tier,
            UsageEventRow.cost_pico_usd,
            *columns,
        )
        .where(
            UsageEventRow.ts >= lo,
            UsageEventRow.ts < hi,
            UsageEventRow.status >= 200,
            UsageEventRow.status < 300,
        )
        .execution_options(yield_per=5000)
    )

    prompt_classes = (
        TokenClass.INPUT,
        TokenClass.CACHED_INPUT,
        TokenClass.CACHE_WRITE_5M,
        TokenClass.CACHE_WRITE_1H,
    )

    def strongest_cost(route: str, at: Any, tier: str | None, tokens: list[int]) -> int | None:
        prompt = sum(n for c, n in zip(TokenClass, tokens, strict=True) if c in prompt_classes)
        costs = []
        for candidate_route in router.routes.get(route, []):
            for model in (c.model for c in candidate_route.candidates):
                target = targets.get(model)
                if target is None:
                    continue
                catalog_prices = catalog.prices_at(target.backend.name, target.upstream_model, at, tier)
                prices = resolve(
                    model_prices(target.model, catalog_prices, tier, prompt, target.backend.type)
                )
                costs.append(sum(n * prices.get(c, 0) for c, n in zip(TokenClass, tokens, strict=True)))
        return max(costs) if len(costs) > 1 else None

    days: dict[str, list[int]] = {}
    async with ctx.sessions() as session:
        catalog = await load_catalog(session)
        async for day, ts, route, tier, cost, *tokens in await session.stream(query):
            baseline = strongest_cost(route, ts, tier, tokens)
            into = days.setdefault(day.isoformat(), [0, 0])
            into[0] += cost
            into[1] += cost if baseline is None else baseline
    data = [
        {
            "day": day,
            "cost_usd": format_usd(pico_to_usd(actual)),
            "strongest_cost_usd": format_usd(pico_to_usd(baseline)),
            "saved_usd": format_usd(pico_to_usd(baseline - actual)),
        }
        for day, (actual, baseline) in sorted(days.items())
    ]
    actual, baseline = sum(v[0] for v in days.values()), sum(v[1] for v in days.values())
    return {
        "start": lo.isoformat(),
        "end": hi.isoformat(),
        "data": data,
        "totals": {
            "cost_usd": format_usd(pico_to_usd(actual)),
            "strongest_cost_usd": format_usd(pico_to_usd(baseline)),
            "saved_usd": format_usd(pico_to_usd(baseline - actual)),
        },
    }
