"""The gateway's OpenAPI document, for schemathesis (tests/security/test_fuzz_openapi.py).

The gateway serves no schema (`openapi_config=None` in gateway/app.py: nothing a client needs, and
one less public route), and its handlers read raw bodies with msgspec, so Litestar alone would
describe paths, methods and query parameters but no request body. This module asks Litestar for the
paths of a real app and fills in what only the code knows:

- each request body from the msgspec type its handler decodes (`msgspec.json.schema_components`),
  with `model` limited to the configured models so generated requests reach the fake vendors;
- every 4xx as the error shape the client actually gets (OpenAI's, Anthropic's on /v1/messages and
  /v1/messages/count_tokens),
  in place of Litestar's default `{status_code, detail}` validation error it would document;
- `text/event-stream` beside JSON for the endpoints that stream.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgspec
from litestar.openapi import OpenAPIConfig

import gateway.app
from gateway.admin.requests import PreviewBody
from gateway.admin.routes import RouteBody
from gateway.admin.schemas import KeyCreate, PricesPut, TenantCreate, TenantPatch
from gateway.anthropic_inbound import CountTokensRequest, MessagesRequest
from gateway.api.anthropic import PATHS as ANTHROPIC_PATHS
from gateway.api.feedback import FeedbackBody
from gateway.responses_inbound import ResponsesRequest
from gateway.types import ChatRequest, CompletionRequest, EmbeddingRequest

ADMIN_PREFIX = "/admin/api/v1"
BODIES: dict[tuple[str, str], type] = {
    ("post", "/v1/chat/completions"): ChatRequest,
    ("post", "/v1/completions"): CompletionRequest,
    ("post", "/v1/embeddings"): EmbeddingRequest,
    ("post", "/v1/messages"): MessagesRequest,
    ("post", "/v1/messages/count_tokens"): CountTokensRequest,
    ("post", "/v1/responses"): ResponsesRequest,
    ("post", "/v1/feedback"): FeedbackBody,
    ("post", f"{ADMIN_PREFIX}/tenants"): TenantCreate,
    ("patch", f"{ADMIN_PREFIX}/tenants/{{tenant_id}}"): TenantPatch,
    ("post", f"{ADMIN_PREFIX}/tenants/{{tenant_id}}/keys"): KeyCreate,
    ("put", f"{ADMIN_PREFIX}/prices"): PricesPut,
    ("post", f"{ADMIN_PREFIX}/routes"): RouteBody,
    ("put", f"{ADMIN_PREFIX}/routes/{{route_id}}"): RouteBody,
    ("post", f"{ADMIN_PREFIX}/routes/preview"): PreviewBody,
}
STREAMING = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}
# Fields the gateway fills itself (unknown top-level keys land in `extra`); no client sends them.
INTERNAL_FIELDS = {"extra"}

OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string", "minLength": 1}},
        },
    },
}


def litestar_paths(build_app: Callable[[], Any]) -> dict[str, Any]:
    """The OpenAPI document Litestar generates for the app `build_app()` makes (with OpenAPI on)."""
    original = gateway.app.Litestar

    def with_openapi(*args: Any, **kwargs: Any) -> Any:
        kwargs["openapi_config"] = OpenAPIConfig(title="Weir", version="1", path="/openapi")
        return original(*args, **kwargs)

    gateway.app.Litestar = with_openapi  # type: ignore[assignment,misc]
    try:
        app = build_app()
    finally:
        gateway.app.Litestar = original  # type: ignore[misc]
    return app.openapi_schema.to_schema()


def _decimals_take_numbers(node: Any) -> None:
    # msgspec describes Decimal as a string, yet decodes JSON numbers into it too (the admin API
    # documents money as "number or string").
    if isinstance(node, dict):
        if node.get("format") == "decimal":
            node.pop("type", None)
            node["anyOf"] = [{"type": "string"}, {"type": "number"}]
        for value in node.values():
            _decimals_take_numbers(value)
    elif isinstance(node, list):
        for value in node:
            _decimals_take_numbers(value)


def _restrict_models(schema: dict[str, Any], models: list[str]) -> None:
    props = schema.get("properties", {})
    if "model" in props:
        props["model"] = {"type": "string", "enum": models}


def gateway_schema(build_app: Callable[[], Any], models: list[str]) -> dict[str, Any]:
    """The public (/v1/...) and admin API (/admin/api/v1/...) operations, bodies and errors filled in."""
    doc = litestar_paths(build_app)
    _, components = msgspec.json.schema_components(
        sorted(set(BODIES.values()), key=lambda t: t.__name__), ref_template="#/components/schemas/{name}"
    )
    # msgspec's request types are lenient (unknown fields kept or ignored) unless they forbid them.
    for name, schema in components.items():
        for field in INTERNAL_FIELDS & set(schema.get("properties", {})):
            del schema["properties"][field]
        if name in {t.__name__ for t in BODIES.values() if "model" in getattr(t, "__struct_fields__", ())}:
            _restrict_models(schema, models)
    _decimals_take_numbers(components)
    paths: dict[str, Any] = {}
    for path, operations in doc["paths"].items():
        if not (path.startswith("/v1/") or path.startswith(f"{ADMIN_PREFIX}/")):
            continue  # health, metrics and the admin UI's cookie session are not API surface
        kept: dict[str, Any] = {}
        for method, operation in operations.items():
            op = copy.deepcopy(operation)
            body_type = BODIES.get((method, path))
            if body_type is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{body_type.__name__}"}}
                    },
                }
            error = ANTHROPIC_ERROR if path in ANTHROPIC_PATHS else OPENAI_ERROR
            responses = {code: r for code, r in op.get("responses", {}).items() if not code.startswith("4")}
            for code, response in responses.items():
                if code.startswith("2") and path in STREAMING:
                    content = response.setdefault("content", {})
                    content.setdefault("application/json", {"schema": {}})
                    content["text/event-stream"] = {}  # events are checked by tests/gateway, not here
            responses["4XX"] = {
                "description": "the request is refused",
                "content": {"application/json": {"schema": error}},
            }
            op["responses"] = responses
            kept[method] = op
        paths[path] = kept
    return {
        "openapi": "3.1.0",
        "info": {"title": "Weir gateway", "version": "1"},
        "paths": paths,
        "components": {"schemas": components},
    }
