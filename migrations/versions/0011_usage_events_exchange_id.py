"""usage_events.exchange_id: the gateway's own id of an exchange whose request id is the client's
x-request-id, so that requests sharing one are told apart (request log, uptime report)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 08:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: rows written before it (and requests with the gateway's own id) have none.
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("exchange_id", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.drop_column("exchange_id")
