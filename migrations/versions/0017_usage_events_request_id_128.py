"""usage_events.request_id: 128 characters, as every request id the gateway takes (gateway.ids: a
client's `x-request-id` of up to 128 is kept, echoed, logged and joined with feedback by it); at 64,
PostgreSQL refused every batch holding a longer one, and the writer retried it for ever

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


def upgrade() -> None:
    # PostgreSQL widens a varchar in place (no rewrite of the table or its index).
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.alter_column(
            "request_id",
            existing_type=sa.String(length=64),
            type_=sa.String(length=128),
            existing_nullable=False,
        )


def downgrade() -> None:
    # An id longer than 64 is cut to its first 64 characters: 0016's column cannot hold it.
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.alter_column(
            "request_id",
            existing_type=sa.String(length=128),
            type_=sa.String(length=64),
            existing_nullable=False,
            postgresql_using="left(request_id, 64)",
        )
