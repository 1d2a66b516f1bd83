"""feedback.updated_at, comparisons.updated_at: when a row's label last changed, so a retraining run
ranks a re-scored row as one the head in use has not seen (it was trained on the older label)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 10:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TABLES = ("feedback", "comparisons")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))
        # Rows written before this migration: their label is as old as the row.
        op.execute(f"UPDATE {table} SET updated_at = created_at")
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.alter_column("updated_at", existing_type=sa.DateTime(timezone=True), nullable=False)


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("updated_at")
