"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, head
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.api.common import json_response, runtime


@get("/healthz")
async def healthz() -> Response[Any]:
    return json_response({"status": "ok"})


# What Claude Code asks of its ANTHROPIC_BASE_URL before and between requests: `HEAD /` as a
# connectivity preflight (a 404 or 405 reads as the endpoint being down) and `HEAD /api/hello` to warm
# its connection. Answered as /healthz is, without a key: they say only that the gateway is up.
PROBES = ["/", "/api/hello"]


@get(PROBES)
async def probe() -> Response[Any]:
    return json_response({"status": "ok"})


@head(PROBES)
async def probe_head() -> None:
    return None


@get("/readyz")
async def readyz(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway = runtime(request)
    status = gateway.readiness
    engines = {engine.backend.name: engine.state for engine in gateway.engines}
    # Each engine's state, not why it failed: anyone may read /readyz, and the engine's own error can
    # name files and directories. The error is in the `engine_failed` log line and in the admin API's
    # GET /routes/status.
    body: dict[str, Any] = {"status": status, "engines": engines}
    if gateway.router.scorer_loading:
        body["difficulty_classifier"] = "loading"
    return json_response(body, 200 if status == "ready" else 503)


@get("/metrics")
async def metrics(request: Request[Any, Any, Any]) -> Response[Any]:
    return Response(runtime(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


ROUTES = [healthz, probe, probe_head, readyz, metrics]
