"""Who is calling: an API key becomes a Principal (tenant, key, allowed models).

`Authenticator` is the seam: the in-memory one here is seeded from the config's `tenants:`; the
admin DB provides another with the same method. Keys are never kept in clear: only their SHA-256,
compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Protocol

import msgspec

from gateway.config import Tenant


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    tenant_name: str
    key_id: str | None
    allowed_models: frozenset[str] | None = None  # public model names; None: every model

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


ANONYMOUS = Principal(tenant_id="anonymous", tenant_name="anonymous", key_id=None)


class Authenticator(Protocol):
    async def authenticate(self, api_key: str) -> Principal | None: ...


async def authenticate_known(authenticator: Authenticator, api_key: str) -> Principal | None:
    """The key's caller if the authenticator can tell without a DB query (`authenticate_known`, where
    it has one): what a client over its failed-key allowance may still use (gateway.throttle). An
    authenticator without the method is taken to be in memory."""
    known = getattr(authenticator, "authenticate_known", None)
    if known is None:
        return await authenticator.authenticate(api_key)
    principal: Principal | None = await known(api_key)
    return principal


def hash_key(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


def key_id(api_key: str) -> str:
    """A stable, non-secret name for a key (for logs and the ledger)."""
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def tenant_principal(tenant: Tenant, key: str | None) -> Principal:
    """A config tenant's caller, with the models it may use: what its keys authenticate as, and what
    a route preview for it plans with (a preview that let it use more showed routes it is refused)."""
    allowed = frozenset(tenant.models) if tenant.models is not None else None
    return Principal(tenant_id=tenant.name, tenant_name=tenant.name, key_id=key, allowed_models=allowed)


class StaticAuthenticator:
    """Keys from the config file's tenants (their values come from the environment)."""

    def __init__(self, tenants: list[Tenant]) -> None:
        self._keys: dict[bytes, Principal] = {}
        for tenant in tenants:
            for api_key in tenant.api_keys:
                self._keys[hash_key(api_key)] = tenant_principal(tenant, key_id(api_key))

    async def authenticate(self, api_key: str) -> Principal | None:
        digest = hash_key(api_key)
        found: Principal | None = None
        for stored, principal in self._keys.items():
            # Every stored hash is compared, so the time taken says nothing about which one matched.
            if hmac.compare_digest(stored, digest):
                found = principal
        return found

    async def authenticate_known(self, api_key: str) -> Principal | None:
        return await self.authenticate(api_key)  # in memory


class OpenAuthenticator:
    """No tenants configured: every caller is the anonymous principal (local development only)."""

    async def authenticate(self, api_key: str) -> Principal | None:
        return ANONYMOUS

    async def authenticate_known(self, api_key: str) -> Principal | None:
        return ANONYMOUS


def api_key_from(headers: Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer` (OpenAI SDK) or `x-api-key` (Anthropic SDK)."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return headers.get("x-api-key") or None
