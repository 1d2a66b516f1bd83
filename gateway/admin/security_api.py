"""Admin API for stored secrets and stored prompts.

`PUT|GET|DELETE /backends/{name}/credentials`: a backend's vendor API key, encrypted with the master
key before it reaches the DB; reads show only its last four characters and a fingerprint, and the
audit log records the same (never the key). `GET /credentials` lists them all.

`GET /tenants/{id}/prompts` and `GET /tenants/{id}/prompts/{request_id}`: the bodies kept for a
tenant that opted in (`store_prompts`), only under that tenant's id; reading one is audited.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Request, delete, get, put
from sqlalchemy import select

from gateway.admin.router import AdminContext, AdminError, checked_limit, decode, tenant_or_404
from gateway.credentials import context
from gateway.db.models import BackendCredential, StoredPrompt, utcnow
from gateway.prompts import read_body
from gateway.security import SecurityControls
from gateway.vault import VaultError, fingerprint

MIN_KEY_CHARS = 8


class CredentialPut(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    api_key: Annotated[str, msgspec.Meta(min_length=MIN_KEY_CHARS, max_length=4096)]


def _security(request: Request[Any, Any, Any]) -> SecurityControls:
    return request.app.state.security


def _known_backend(request: Request[Any, Any, Any], name: str) -> None:
    names = {b.name for b in request.app.state.gateway.config.backends}
    if name not in names:
        raise AdminError(404, f"no backend named {name!r} in the configuration", "not_found", "backend")


def credential_json(row: BackendCredential, security: SecurityControls) -> dict[str, Any]:
    store = security.credentials
    return {
        "backend": row.backend,
        "last4": row.last4,
        "fingerprint": row.fingerprint,
        "key_id": row.key_id,  # the master key it is encrypted under
        "in_use": store is not None and row.backend in store.in_use,
        "error": store.errors.get(row.backend) if store is not None else None,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
    }


async def _applied(security: SecurityControls) -> None:
    if security.credentials is not None:
        await security.credentials.refresh()  # this replica at once; the others within a second


def _vendor_key(sent: str) -> str:
    """The key as stored: surrounding whitespace (a paste's newline) dropped, then checked again. The
    length was checked only as sent, so eight spaces stored an empty key in place of a working one,
    and a line break inside one made every request of the backend fail on an invalid header."""
    secret = sent.strip()
    if len(secret) < MIN_KEY_CHARS or any(c.isspace() or not c.isprintable() for c in secret):
        raise AdminError(
            400,
            f"api_key must be at least {MIN_KEY_CHARS} characters with no spaces, line breaks or control "
            "characters (surrounding whitespace is dropped): paste the vendor's key as it is",
            "invalid_value",
            "api_key",
        )
    return secret


@put("/backends/{name:str}/credentials")
async def put_credential(name: str, request: Request[Any, Any, Any], ctx: AdminContext) -> dict[str, Any]:
    _known_backend(request, name)
    body = decode(await request.body(), CredentialPut)
    security = _security(request)
    if security.vault is None:
        raise AdminError(
            409,
            "storing a vendor key needs a master key: set WEIR_MASTER_KEY (make one with "
            "`weir db new-master-key`) and restart; keys are never stored in plain text",
            "master_key_not_configured",
        )
    secret = _vendor_key(body.api_key)
    now = utcnow()
    async with ctx.write() as (session, audit):
        row = await session.get(BackendCredential, name)
        before = credential_json(row, security) if row is not None else None
        if row is None:
            row = BackendCredential(backend=name, created_at=now)
            session.add(row)
        row.ciphertext = security.vault.encrypt(secret, context(name))
        row.key_id, row.fingerprint, row.last4 = security.vault.primary_id, fingerprint(secret), secret[-4:]
        row.updated_at = now
        await session.flush()
        audit(
            "update" if before else "create",
            "backend_credential",
            name,
            before,
            credential_json(row, security),
        )
    await _applied(security)
    return credential_json(row, security)


@get("/backends/{name:str}/credentials")
async def get_credential(name: str, request: Request[Any, Any, Any], ctx: AdminContext) -> dict[str, Any]:
    async with ctx.sessions() as session:
        row = await session.get(BackendCredential, name)
    if row is None:
        raise AdminError(404, f"no stored key for backend {name!r}", "not_found", "backend")
    return credential_json(row, _security(request))


@get("/credentials")
async def list_credentials(request: Request[Any, Any, Any], ctx: AdminContext) -> dict[str, Any]:
    async with ctx.sessions() as session:
        rows = (await session.scalars(select(BackendCredential).order_by(BackendCredential.backend))).all()
    security = _security(request)
    return {"data": [credential_json(r, security) for r in rows]}


@delete("/backends/{name:str}/credentials", status_code=204)
async def delete_credential(name: str, request: Request[Any, Any, Any], ctx: AdminContext) -> None:
    security = _security(request)
    async with ctx.write() as (session, audit):
        row = await session.get(BackendCredential, name)
        if row is None:
            raise AdminError(404, f"no stored key for backend {name!r}", "not_found", "backend")
        audit("delete", "backend_credential", name, credential_json(row, security), None)
        await session.delete(row)
    await _applied(security)


# --- stored prompts ------------------------------------------------------------------------------


@get("/tenants/{tenant_id:str}/prompts")
async def list_prompts(tenant_id: str, ctx: AdminContext, limit: int = 100) -> dict[str, Any]:
    checked_limit(limit, 1000)
    async with ctx.sessions() as session:
        await tenant_or_404(session, tenant_id)
        rows = (
            await session.execute(
                select(StoredPrompt.request_id, StoredPrompt.ts, StoredPrompt.endpoint, StoredPrompt.status)
                .where(StoredPrompt.tenant_id == tenant_id)
                .order_by(StoredPrompt.ts.desc(), StoredPrompt.id.desc())
                .limit(limit)
            )
        ).all()
    return {
        "data": [
            {"request_id": r, "ts": ts.isoformat(), "endpoint": endpoint, "status": status}
            for r, ts, endpoint, status in rows
        ]
    }


@get("/tenants/{tenant_id:str}/prompts/{request_id:str}")
async def get_prompt(
    tenant_id: str, request_id: str, request: Request[Any, Any, Any], ctx: AdminContext
) -> dict[str, Any]:
    async with ctx.write() as (session, audit):
        await tenant_or_404(session, tenant_id)
        rows = (
            await session.scalars(
                select(StoredPrompt)
                .where(StoredPrompt.tenant_id == tenant_id, StoredPrompt.request_id == request_id)
                .order_by(StoredPrompt.id)
            )
        ).all()
        if not rows:
            # Another tenant's request id reads exactly like one that does not exist.
            raise AdminError(
                404, f"no stored prompt {request_id!r} for this tenant", "not_found", "request_id"
            )
        audit("read", "stored_prompt", f"{tenant_id}/{request_id}", None, None)
    vault = _security(request).vault
    data = []
    for row in rows:
        try:
            request_body, response_body = read_body(row, vault)
        except VaultError as exc:
            raise AdminError(409, f"cannot decrypt this stored prompt: {exc}", "undecryptable") from None
        data.append(
            {
                "request_id": row.request_id,
                "ts": row.ts.isoformat(),
                "endpoint": row.endpoint,
                "status": row.status,
                "request": request_body,
                "response": response_body,
            }
        )
    return {"data": data}


SECURITY_HANDLERS = [
    put_credential,
    get_credential,
    list_credentials,
    delete_credential,
    list_prompts,
    get_prompt,
]
