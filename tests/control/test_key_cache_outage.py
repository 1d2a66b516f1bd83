"""Keys the gateway already knows keep working through an admin-DB outage after their cache entry
expires; a key it has never seen fails (the DB is the only place that could vouch for it); a revoked
key is not revived by the stale entry."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from gateway.admin.keys import DbAuthenticator, new_key
from gateway.db import migrate
from gateway.db.models import ApiKey, Tenant
from gateway.db.session import create_engine, sessionmaker
from gateway.state import MemoryState


def unreachable() -> Any:
    raise OperationalError("SELECT 1", {}, ConnectionRefusedError("the admin DB is down"))


async def test_known_keys_survive_a_db_outage(sqlite_url: str) -> None:
    await migrate.upgrade_async(sqlite_url)
    engine = create_engine(sqlite_url)
    sessions = sessionmaker(engine)
    key, prefix, digest = new_key()
    other, other_prefix, other_digest = new_key()
    async with sessions() as session, session.begin():
        tenant = Tenant(name="acme")
        session.add(tenant)
        await session.flush()
        session.add(ApiKey(tenant_id=tenant.id, prefix=prefix, key_hash=digest))
        session.add(ApiKey(tenant_id=tenant.id, prefix=other_prefix, key_hash=other_digest))
    state = MemoryState()
    auth = DbAuthenticator(sessions, state, ttl_s=0.0)  # every lookup goes to the DB
    await auth.start()
    known = await auth.authenticate(key)
    assert known is not None and known.tenant_name == "acme"
    assert await auth.authenticate(other) is not None

    auth._sessions = unreachable  # type: ignore[assignment]  # the DB goes away
    assert await auth.authenticate(key) == known  # expired entry, served while the DB is down
    assert await auth.authenticate(key) == known  # and again, from the short retry entry
    with pytest.raises(OperationalError):
        await auth.authenticate(new_key()[0])  # never seen: nothing to vouch for it
    await state.publish_revocation(other_digest)  # revoked on another replica during the outage
    with pytest.raises(OperationalError):
        await auth.authenticate(other)
    await engine.dispose()
