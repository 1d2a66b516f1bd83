"""comparisons: a judge's grades of both candidates' answers (difficulty routes with `compare`)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 21:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "comparisons",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=200), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("route", sa.String(length=200), nullable=False),
        sa.Column("weak_model", sa.String(length=200), nullable=False),
        sa.Column("strong_model", sa.String(length=200), nullable=False),
        sa.Column("served", sa.String(length=8), nullable=False),
        sa.Column("weak_score", sa.Float(), nullable=False),
        sa.Column("strong_score", sa.Float(), nullable=False),
        sa.Column("judge", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_comparisons")),
        sa.UniqueConstraint("tenant_id", "request_id", name=op.f("uq_comparisons_tenant_id")),
    )


def downgrade() -> None:
    op.drop_table("comparisons")
