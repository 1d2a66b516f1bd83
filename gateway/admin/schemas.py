"""Request bodies of the admin API. Money comes in as USD (number or string) and is kept exact."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Annotated

import msgspec

from gateway.accounting.pricing import ANY_BACKEND, BASE_TIER, TierName, TokenClass

Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # stored as 32-bit integers
Usd = Decimal  # checked for sign and precision when converted to micro-dollars
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]


Positive = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
RetentionDays = Annotated[int, msgspec.Meta(ge=1, le=36500)]


class TenantCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Name
    budget_usd_monthly: Usd | None = None
    rpm: Count | None = None
    tpm: Count | None = None
    max_messages: Positive | None = None  # None: the config's `limits.max_messages`
    max_concurrent_streams: Positive | None = None
    store_prompts: bool = False  # keep request and response bodies (opt-in)
    prompt_retention_days: RetentionDays | None = None  # None: 30 days


class TenantPatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Absent fields stay as they are; `null` clears a limit."""

    name: Name | msgspec.UnsetType = msgspec.UNSET
    budget_usd_monthly: Usd | msgspec.UnsetType | None = msgspec.UNSET
    rpm: Count | msgspec.UnsetType | None = msgspec.UNSET
    tpm: Count | msgspec.UnsetType | None = msgspec.UNSET
    max_messages: Positive | msgspec.UnsetType | None = msgspec.UNSET
    max_concurrent_streams: Positive | msgspec.UnsetType | None = msgspec.UNSET
    store_prompts: bool | msgspec.UnsetType = msgspec.UNSET
    prompt_retention_days: RetentionDays | msgspec.UnsetType | None = msgspec.UNSET


class KeyCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Name | None = None
    models: list[str] | None = None  # public model names this key may use; None: all the tenant may
    expires_at: dt.datetime | None = None
    budget_usd_monthly: Usd | None = None
    rpm: Count | None = None
    tpm: Count | None = None


class PriceIn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: Name
    token_class: TokenClass
    # Exactly one, by class: a token class's price per 1M tokens, or a per-request class's
    # (`web_search`) per 1,000 requests, the unit vendors quote ($10 per 1,000 searches is 10). A
    # field of its own, not one number whose unit hangs on the class: a search price typed per 1M
    # tokens would bill 1,000 times too little.
    usd_per_1m_tokens: Usd | None = None
    usd_per_1k_requests: Usd | None = None
    backend: Name = ANY_BACKEND
    # The service tier whose attempts it bills (`flex`, `priority`); None: the base price, which bills
    # attempts of every other tier and those whose vendor reports none.
    service_tier: TierName | None = None
    effective_from: dt.datetime | None = None  # None: now

    @property
    def tier(self) -> str:
        return self.service_tier or BASE_TIER


class PricesPut(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prices: Annotated[list[PriceIn], msgspec.Meta(min_length=1)]
