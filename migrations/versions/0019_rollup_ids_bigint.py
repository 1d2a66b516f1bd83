"""usage_rollups.id, usage_route_rollups.id: bigint on PostgreSQL. Its INSERT ... ON CONFLICT DO
UPDATE takes a number from the id sequence for every row it proposes, even one that only adds to an
existing rollup, so the batch writer used one per group per batch; an `integer` sequence ran out after
2^31 (weeks of busy batches) and every batch then failed (2200H, a data exception: set aside). SQLite's
INTEGER PRIMARY KEY is already a 64-bit rowid that an upsert does not consume: nothing to do there.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05 22:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_TABLES = ("usage_rollups", "usage_route_rollups")


def _retype(to: type[sa.Integer]) -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    before = sa.Integer() if to is sa.BigInteger else sa.BigInteger()
    sql_type = "bigint" if to is sa.BigInteger else "integer"
    for table in _TABLES:
        # Rewrites the table (rollups: a row per day and group, small beside the ledger).
        op.alter_column(table, "id", existing_type=before, type_=to(), existing_nullable=False)
        # The serial's sequence keeps its own type (and so its limit) otherwise. Named by the server,
        # in SQL (not read back here), so that `alembic upgrade --sql` writes it too.
        op.execute(
            sa.text(
                f"DO $$ BEGIN EXECUTE format('ALTER SEQUENCE %s AS {sql_type}', "
                f"pg_get_serial_sequence('{table}', 'id')); END $$"
            )
        )


def upgrade() -> None:
    _retype(sa.BigInteger)


def downgrade() -> None:
    # Fails (22003) where an id is past 2^31 already: such a rollup table fits no `integer` id.
    _retype(sa.Integer)
