"""backend_credentials (vendor keys encrypted at rest), stored_prompts (opt-in bodies), tenant limits

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 23:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "backend_credentials",
        sa.Column("backend", sa.String(length=200), nullable=False),
        sa.Column("ciphertext", sa.Text(), nullable=False),
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("fingerprint", sa.String(length=16), nullable=False),
        sa.Column("last4", sa.String(length=4), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("backend", name=op.f("pk_backend_credentials")),
    )
    op.create_table(
        "stored_prompts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("endpoint", sa.String(length=100), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.String(length=16), nullable=True),
        sa.Column("request_body", sa.Text(), nullable=False),
        sa.Column("response_body", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stored_prompts")),
    )
    op.create_index(
        "ix_stored_prompts_tenant_request", "stored_prompts", ["tenant_id", "request_id"], unique=False
    )
    op.create_index(op.f("ix_stored_prompts_ts"), "stored_prompts", ["ts"], unique=False)
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_messages", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_concurrent_streams", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column("store_prompts", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch_op.add_column(sa.Column("prompt_retention_days", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("prompt_retention_days")
        batch_op.drop_column("store_prompts")
        batch_op.drop_column("max_concurrent_streams")
        batch_op.drop_column("max_messages")
    op.drop_index(op.f("ix_stored_prompts_ts"), table_name="stored_prompts")
    op.drop_index("ix_stored_prompts_tenant_request", table_name="stored_prompts")
    op.drop_table("stored_prompts")
    op.drop_table("backend_credentials")
