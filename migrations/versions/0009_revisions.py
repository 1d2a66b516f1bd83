"""routes.revision, difficulty_heads.revision, backend_credentials.revision: how many times a row was
written, so the signature replicas poll moves with every committed edit, whatever the order of commits

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TABLES = ("routes", "difficulty_heads", "backend_credentials")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("revision", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("revision")
