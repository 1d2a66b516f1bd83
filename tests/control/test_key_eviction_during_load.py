"""A key revoked (or its tenant's limits changed) while a replica is reading it from the admin DB: the
row that read returns predates the change, and caching it undid the eviction for the cache's whole
TTL, or, with the DB down, for as long as the outage lasted."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from sqlalchemy.exc import OperationalError

from gateway.accounting.admission import Quotas
from gateway.admin.keys import DbAuthenticator, KeyRecord, key_digest
from gateway.auth import Principal
from gateway.state import MemoryState

KEY = "wk-a-key-about-to-be-revoked"
RECORD = KeyRecord(
    principal=Principal(tenant_id="t1", tenant_name="acme", key_id="k1"),
    key_hash=key_digest(KEY),
    quotas=Quotas("t1", "k1", tenant_rpm=600),
)


class SlowDb:
    """The admin DB as `_load` reads it: the key's row (None once revoked), the first read held until
    `release` (it read the row before the revocation committed), or every read failing when `down`."""

    def __init__(self) -> None:
        self.row: KeyRecord | None = RECORD
        self.reads = 0
        self.release = asyncio.Event()
        self.down = False

    async def load(self, digest: str) -> KeyRecord | None:
        self.reads += 1
        row = self.row
        if self.reads == 1:
            await self.release.wait()
        if self.down:
            raise OperationalError("SELECT", {}, ConnectionRefusedError("the admin DB is down"))
        return row


async def _authenticator(db: SlowDb, ttl_s: float) -> tuple[DbAuthenticator, MemoryState]:
    state = MemoryState()
    auth = DbAuthenticator(sessions=None, state=state, ttl_s=ttl_s)  # type: ignore[arg-type]
    auth._load = db.load  # type: ignore[method-assign]
    await auth.start()
    return auth, state


@pytest.mark.parametrize("change", ["key revoked", "tenant limits changed"])
async def test_an_eviction_during_a_load_is_not_undone_by_its_result(change: str) -> None:
    db = SlowDb()
    auth, state = await _authenticator(db, ttl_s=3600)
    first = asyncio.ensure_future(auth.lookup(KEY))
    await asyncio.sleep(0.01)  # its read is under way
    if change == "key revoked":
        db.row = None
        await state.publish_revocation(RECORD.key_hash)
    else:
        db.row = replace(RECORD, quotas=replace(RECORD.quotas, tenant_rpm=60))
        await state.publish_revocation("*")
    after = asyncio.ensure_future(auth.lookup(KEY))  # a request after the change: its read ends first
    await asyncio.sleep(0.01)
    db.release.set()
    await first  # under way before the change: it may still get the row it read
    assert await after == db.row  # not the read begun before the change
    assert await auth.lookup(KEY) == db.row  # nor, for an hour, the cache
    # Admission's record is the one read after the change too, not the earlier read that ended last.
    if db.row is not None:
        assert auth.record_for(RECORD.principal) == db.row


async def test_an_eviction_during_a_failed_load_is_not_undone_by_the_stale_entry() -> None:
    """With the DB down, a key already known is served from its expired entry; one revoked while the
    failing read was under way must not be put back, to be served for the rest of the outage."""
    db = SlowDb()
    db.release.set()
    auth, state = await _authenticator(db, ttl_s=0.0)  # every lookup reads the DB
    assert await auth.lookup(KEY) == RECORD
    db.release = asyncio.Event()
    db.reads = 0  # the next read is held
    db.down = True
    failing = asyncio.ensure_future(auth.lookup(KEY))
    await asyncio.sleep(0.01)
    await state.publish_revocation(RECORD.key_hash)
    db.release.set()
    with pytest.raises(OperationalError):
        await failing
    with pytest.raises(OperationalError):  # never vouched for again while the DB is down
        await auth.lookup(KEY)
