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
from gateway.vault import Vault


@dataclass
class SecurityControls:
    vault: Vault | None
    credentials: CredentialStore | None = None
    prompts: PromptStore | None = None

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
        gateway.limits.on_capture = prompts.capture
        return cls(vault, CredentialStore(control.sessions, gateway.config.backends, vault), prompts)

    @asynccontextmanager
    async def lifespan(self, _: Any) -> AsyncIterator[None]:
        # Entered after the control plane's start (the schema is migrated), left before its stop.
        if self.credentials is not None:
            await self.credentials.start()
        if self.prompts is not None:
            await self.prompts.start()
        try:
            yield
        finally:
            if self.prompts is not None:
                await self.prompts.stop()
            if self.credentials is not None:
                await self.credentials.stop()
