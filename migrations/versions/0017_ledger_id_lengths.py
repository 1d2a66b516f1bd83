"""usage_events.request_id: 128 characters, as every request id the gateway takes (gateway.ids: a
client's `x-request-id` of up to 128 is kept, echoed, logged and joined with feedback by it); and
usage_events.tenant_id, usage_rollups.tenant_id: 200, as a tenant's name (a config file's tenant is
its name in the ledger). PostgreSQL refused every batch holding a longer one (at 64 and 32), and the
writer retried it for ever

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05 20:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# (table, column, length before, length after, nullable)
_WIDENED = [
    ("usage_events", "request_id", 64, 128, False),
    ("usage_events", "tenant_id", 32, 200, True),
    ("usage_rollups", "tenant_id", 32, 200, False),
]


def upgrade() -> None:
    # PostgreSQL widens a varchar in place (no rewrite of the table or its indexes); SQLite copies it.
    for table, column, before, after, nullable in _WIDENED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.alter_column(
                column,
                existing_type=sa.String(length=before),
                type_=sa.String(length=after),
                existing_nullable=nullable,
            )


def downgrade() -> None:
    # A longer value is cut to what 0016's column holds.
    for table, column, before, after, nullable in _WIDENED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.alter_column(
                column,
                existing_type=sa.String(length=after),
                type_=sa.String(length=before),
                existing_nullable=nullable,
                postgresql_using=f"left({column}, {before})",
            )
