"""Alembic environment: async engines for SQLite and PostgreSQL, batch mode so SQLite can ALTER."""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.types import TypeDecorator

from gateway.db.models import Base
from gateway.db.session import normalise_url, resolve_database_url

config = context.config
# alembic's recipe: a caller with logging of its own (the gateway, gateway.db.migrate) says so.
configure_logger = config.attributes.get("configure_logger", True)
if configure_logger and config.config_file_name and os.path.exists(config.config_file_name):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata
MIGRATION_LOCK_KEY = 0x7765697200  # any constant unique to Weir


def _render_item(type_: str, obj: object, autogen_context: object) -> str | bool:
    # Migrations must not import the models (old revisions would change with them): a TypeDecorator
    # is written as the plain SQLAlchemy type it stores.
    if type_ == "type" and isinstance(obj, TypeDecorator):
        return f"sa.{obj.impl!r}"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=_render_item,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Replicas starting together all run `upgrade`; one at a time, and the later ones then
            # find the schema already at head.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


async def _run_online() -> None:
    url = config.get_main_option("sqlalchemy.url") or resolve_database_url()
    engine = create_async_engine(normalise_url(url), poolclass=pool.NullPool)
    async with engine.connect() as connection:
        await connection.run_sync(_configure)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())
