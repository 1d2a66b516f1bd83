"""The admin token: `WEIR_ADMIN_TOKEN`, or one generated at first start, printed once, kept as a hash."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import Setting

SETTING = "admin_token_sha256"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def ensure_admin_token(
    sessions: async_sessionmaker[AsyncSession], env_token: str | None = None
) -> tuple[str, str | None]:
    """(digest to check requests against, the new token if one was generated now and must be shown)."""
    env_token = env_token if env_token is not None else os.environ.get("WEIR_ADMIN_TOKEN")
    if env_token:
        return token_digest(env_token), None
    token = "wa-" + secrets.token_urlsafe(32)
    try:
        async with sessions() as session, session.begin():
            stored = await session.get(Setting, SETTING)
            if stored is not None:
                return stored.value, None
            session.add(Setting(key=SETTING, value=token_digest(token)))
    except IntegrityError:  # another replica generated one at the same moment: use theirs
        async with sessions() as session:
            stored = await session.get(Setting, SETTING)
            assert stored is not None
            return stored.value, None
    return token_digest(token), token


def token_matches(presented: str, digest: str) -> bool:
    return hmac.compare_digest(token_digest(presented), digest)
