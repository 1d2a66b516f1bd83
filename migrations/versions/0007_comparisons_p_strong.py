"""comparisons.p_strong, comparisons.head: the score the route's head gave the compared request, and
which head gave it, so the admin API can say how well a head ranks a tenant's own traffic

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 05:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("comparisons", schema=None) as batch_op:
        batch_op.add_column(sa.Column("p_strong", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("head", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("comparisons", schema=None) as batch_op:
        batch_op.drop_column("head")
        batch_op.drop_column("p_strong")
