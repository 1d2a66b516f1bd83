"""The Litestar application: `create_app(config)`."""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException

from gateway.admin import control_plane
from gateway.admin.ui import ui_routers
from gateway.api import ROUTES
from gateway.api.openai import MODELS_PATH, anthropic_client
from gateway.auth import Authenticator, StaticAuthenticator
from gateway.config import Config
from gateway.disconnect import cancel_on_disconnect
from gateway.errors import (
    NESTED_TOO_DEEPLY,
    GatewayError,
    InvalidRequest,
    PayloadTooLarge,
    anthropic_status,
    encode_anthropic_error,
    encode_openai_error,
    is_anthropic_path,
)
from gateway.middleware import request_middleware
from gateway.preflight import admin_db_failure
from gateway.runtime import Gateway
from gateway.security import SecurityControls
from gateway.startup import StartupFailed
from gateway.throttle import FailureThrottle, SharedFailureThrottle
from gateway.usage_sink import FanoutSink, UsageSink

log = structlog.get_logger("weir.gateway")


def _anthropic_shaped(request: Request[Any, Any, Any]) -> bool:
    """Whether an error is said in Anthropic's shape: on the Messages API's paths, and on /v1/models
    to an Anthropic client, which is answered there in Anthropic's shape."""
    path = request.url.path
    models = path == MODELS_PATH or path.startswith(MODELS_PATH + "/")
    return is_anthropic_path(path) or (models and anthropic_client(request))


def _error_response(request: Request[Any, Any, Any], error: GatewayError) -> Response[bytes]:
    anthropic = _anthropic_shaped(request)
    state = request.scope.get("state", {})
    info = state.get("weir") if isinstance(state, dict) else None
    if anthropic:
        body = encode_anthropic_error(error, info.request_id if info is not None else None)
    else:
        body = encode_openai_error(error)
    status = anthropic_status(error) if anthropic else error.status
    if info is not None and info.error is None:
        info.error = error.type
    return Response(body, status_code=status, media_type="application/json", headers=error.headers)


def _on_gateway_error(request: Request[Any, Any, Any], exc: GatewayError) -> Response[bytes]:
    return _error_response(request, exc)


def _on_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    # Litestar's own errors (unknown route, wrong method, body too large) in the client's error shape.
    if exc.status_code == 413:
        error: GatewayError = PayloadTooLarge("Request body too large.")
    else:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = GatewayError(str(exc.detail), status=exc.status_code, type="invalid_request_error", code=kind)
    return _error_response(request, error)


def _on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    # Never a stack trace to the client; the log has it.
    info = request.scope.get("state", {}).get("weir")
    if isinstance(exc, RecursionError):
        # A body nested just shallower than the JSON decoder's limit, which the translators' own
        # recursion then ran past: the client's doing, not a fault. Logged without its traceback,
        # a thousand frames long: with one per request, any tenant could flood the log.
        log.warning("request_nested_too_deeply", request_id=getattr(info, "request_id", None))
        return _error_response(request, InvalidRequest(NESTED_TOO_DEEPLY))
    log.error("unhandled_error", request_id=getattr(info, "request_id", None), exc_info=exc)
    return _error_response(request, GatewayError("The server had an error while processing your request."))


async def _start(gateway: Gateway, control: control_plane.ControlPlane | None) -> None:
    """The gateway's start, a failure of the admin DB's part (its migration, the DB gone since `weir
    serve` checked it) said as one line naming the DB (gateway.startup)."""
    if control is not None:
        try:
            await control.start()
        except Exception as exc:
            raise StartupFailed(admin_db_failure(control.database_url, exc)) from exc
    await gateway.start()


def create_app(
    config: Config,
    *,
    authenticator: Authenticator | None = None,
    usage_sink: UsageSink | None = None,
) -> Litestar:
    """The gateway app. `authenticator` (default: the config's tenants) and `usage_sink` (default:
    metrics and logs only) are the seams the admin DB and accounting plug into."""
    # The control plane (admin DB, keys, limits, budgets, ledger, admin API) when a database is set.
    control = control_plane.from_config(config)
    admission = None
    if control is not None:
        authenticator = control_plane.FirstMatch(
            [authenticator or StaticAuthenticator(config.tenants or []), control.authenticator]
        )
        usage_sink = FanoutSink([control.sink, usage_sink]) if usage_sink is not None else control.sink
        admission = control.admit
    gateway = Gateway(config, authenticator=authenticator, usage_sink=usage_sink, admission=admission)
    if control is not None:
        server = config.server
        if control.settings.redis_url:
            # One bucket per address across the replicas, not one each (R replicas: R x the allowance).
            gateway.auth_throttle = SharedFailureThrottle(
                server.auth_failures_per_minute, control.state, "api"
            )
            control.admin.throttle = SharedFailureThrottle(
                server.admin_auth_failures_per_minute, control.state, "admin"
            )
        else:
            control.admin.throttle = FailureThrottle(server.admin_auth_failures_per_minute)
        # Routes in the admin DB; every backend's probe results feed the uptime report.
        gateway.router.use_control_plane(control.sessions, control.state, on_probe=control.uptime.record)
        gateway.comparer.use_control_plane(control.sessions, control.admission.finish, control.state)
        gateway.executor.hedges.state = control.state  # hedged spend capped across replicas
        control.admin.serves_model = gateway.router.in_force  # a key's `models` checked at its issue
        # The catalog's prices bill every attempt (priced once, as it is recorded); `cheapest` and the
        # spend caps' estimates price at those valid now.
        gateway.pipeline.catalog = lambda backend, model, at, tier: control.catalog.prices_at(
            backend, model, at, tier
        )
        gateway.router.context.prices = lambda backend, model, tier: control.catalog.prices_at(
            backend, model, dt.datetime.now(dt.UTC), tier
        )
        control.long_context = gateway.pipeline.long_context  # budget estimates of long prompts
        gateway.metrics.watch_budgets(lambda: control.admission.budget_usage_ratio)
        gateway.metrics.watch_set_aside(lambda: control.writer.stats.set_aside)
    security = SecurityControls.build(gateway, control)  # stored vendor keys, prompt storage

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        try:
            await _start(gateway, control)
        except BaseException:
            # What started (a supervised engine above all) stops now, in order, not when the process
            # ends; the start's own failure is what gets reported, not one of stopping the rest.
            with contextlib.suppress(Exception):
                await gateway.stop()
            if control is not None:
                with contextlib.suppress(Exception):
                    await control.stop()
            raise
        # Everything built so far lives as long as the process: moving it out of the collector's
        # reach keeps full collections (pauses on the request path) short.
        gc.freeze()
        try:
            yield
        finally:
            await gateway.stop()
            if control is not None:
                await control.stop()

    app = Litestar(
        route_handlers=[*ROUTES, control.router(), *ui_routers(control)] if control is not None else ROUTES,
        middleware=[
            gateway.limits.middleware,  # stream leases and prompt capture (gateway.limits)
            cancel_on_disconnect,  # a client gone before its response: its request ends there
        ],
        exception_handlers={
            GatewayError: _on_gateway_error,
            HTTPException: _on_http_exception,
            Exception: _on_unexpected,
        },
        lifespan=[lifespan, security.lifespan],
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=None,
        logging_config=None,
        debug=False,
    )
    # The request id, metrics and log line wrap Litestar's whole handler, not its routes alone: the
    # middleware above runs for a matched route only, so its own 404 (no route) and 405 (no such
    # method) went out with no `x-request-id` and were never logged.
    finish = control.admission.finish if control is not None else None
    app.asgi_handler = request_middleware(gateway.metrics, finish)(app.asgi_handler)
    app.state.gateway = gateway
    app.state.security = security
    app.state.control = control  # None without a database
    return app
