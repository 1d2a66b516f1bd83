"""Anyone can present a key: a flood of random ones must not grow the gateway without bound. The
admin-DB authenticator caches misses (so a client retrying a wrong key does not query the DB each
time), but only the `MAX_MISSES` most recent; the keys that do exist stay cached through a flood."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.accounting.admission import Quotas
from gateway.admin import keys
from gateway.admin.keys import DbAuthenticator, KeyRecord, key_digest
from gateway.auth import Principal

GOOD = "wk-the-one-real-key"


def _authenticator(monkeypatch: pytest.MonkeyPatch) -> tuple[DbAuthenticator, list[str]]:
    loads: list[str] = []
    record = KeyRecord(
        principal=Principal(tenant_id="t1", tenant_name="acme", key_id="k1"),
        key_hash=key_digest(GOOD),
        quotas=Quotas("t1", "k1"),
    )

    async def load(digest: str) -> KeyRecord | None:  # the DB: one key exists
        loads.append(digest)
        return record if digest == record.key_hash else None

    auth = DbAuthenticator(sessions=None, state=None)  # type: ignore[arg-type]  # _load replaced
    monkeypatch.setattr(auth, "_load", load)
    return auth, loads


def _entries(auth: Any) -> int:
    # Every digest the authenticator holds on to, hits and misses alike.
    return len(auth._cache) + len(getattr(auth, "_misses", {}))


async def test_random_keys_do_not_grow_the_cache_without_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys, "MAX_MISSES", 50, raising=False)
    auth, loads = _authenticator(monkeypatch)
    assert await auth.authenticate(GOOD) is not None
    for i in range(500):
        assert await auth.authenticate(f"wk-guess-{i}") is None
    assert _entries(auth) <= 50 + 1  # the misses kept, and the one real key

    # The real key is still served from the cache: a flood does not push it out.
    loads.clear()
    assert await auth.authenticate(GOOD) is not None
    assert loads == []
    # A recent miss is still cached (a client retrying its wrong key costs no query)...
    assert await auth.authenticate("wk-guess-499") is None
    assert loads == []
    # ... and one pushed out is looked up again, and still refused.
    assert await auth.authenticate("wk-guess-0") is None
    assert loads == [key_digest("wk-guess-0")]


async def test_a_miss_is_forgotten_when_the_key_is_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    auth, loads = _authenticator(monkeypatch)
    assert await auth.authenticate("wk-unknown") is None
    auth.evict(key_digest("wk-unknown"))
    assert await auth.authenticate("wk-unknown") is None
    assert loads == [key_digest("wk-unknown")] * 2
