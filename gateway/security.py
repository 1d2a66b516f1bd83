"""The security controls that need the admin DB, wired into the app: vendor keys stored encrypted
(gateway.credentials), opt-in prompt storage with retention (gateway.prompts), and the tenant
policies (limits, prompt opt-in) read from the caller's cached key record (gateway.limits)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from gateway.auth import Principal
from gateway.credentials import CredentialStore
from gateway.limits import TenantPolicy
from gateway.prompts import PromptStore
from gateway.runtime import Gateway
from gateway.state.degradable import DegradableState
from gateway.stream_slots import RedisSlots
from gateway.vault import Vault


@dataclass
class SecurityControls:
    vault: Vault | None
    credentials: CredentialStore | None = None
    prompts: PromptStore | None = None
    stream_slots: RedisSlots | None = None

    @classmethod
    def build(cls, gateway: Gateway, control: Any) -> SecurityControls:
        """`control`: the gateway's ControlPlane, or None without a database. A malformed
        WEIR_MASTER_KEY raises gateway.vault.VaultError here, before the gateway serves anything."""
        vault = Vault.from_env()
        if control is None:
            return cls(vault)
        authenticator = control.authenticator

        def policy(principal: Principal) -> TenantPolicy | None:
            record = authenticator.record_for(principal)
            return record.policy if record is not None else None

        # How often this replica deletes stored prompts past their retention (default hourly).
        interval = float(os.environ.get("WEIR_PROMPT_PURGE_INTERVAL_S", "3600"))
        prompts = PromptStore(control.sessions, vault, retention_interval_s=interval)
        gateway.limits.lookup = policy
        settings = control.settings
        if settings.redis_url:  # stream slots shared by every replica
            # The same Redis as the limits' state: an outage either meets is the other's too.
            outage = control.state if isinstance(control.state, DegradableState) else None
            gateway.limits.shared = RedisSlots.from_url(
                settings.redis_url, prefix=settings.redis_prefix, outage=outage
            )
        gateway.limits.on_capture = prompts.capture
        credentials = CredentialStore(control.sessions, gateway.config.backends, vault)
        return cls(vault, credentials, prompts, gateway.limits.shared)

    @asynccontextmanager
    async def lifespan(self, _: Any) -> AsyncIterator[None]:
        # Entered after the control plane's start (the schema is migrated), left before its stop.
        if self.credentials is not None:
            await self.credentials.start()
        if self.prompts is not None:
            await self.prompts.start()
        if self.stream_slots is not None:
            self.stream_slots.start()
        try:
            yield
        finally:
            if self.stream_slots is not None:
                await self.stream_slots.close()
            if self.prompts is not None:
                await self.prompts.stop()
            if self.credentials is not None:
                await self.credentials.stop()
