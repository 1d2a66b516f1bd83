"""Service tiers: prices.service_tier (a tier's own price; "" for the base price, in the unique key)
and usage_events.service_tier (the tier the vendor served an attempt at, which priced it)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 08:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Every existing price is a base price: "", not NULL, so the unique key holds for them.
    with op.batch_alter_table("prices", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("service_tier", sa.String(length=32), nullable=False, server_default="")
        )
        batch_op.drop_constraint("uq_prices_backend", type_="unique")
        batch_op.create_unique_constraint(
            "uq_prices_backend", ["backend", "model", "service_tier", "token_class", "effective_from"]
        )
    # Nullable, no default: attempts recorded before it (and vendors that report none) have none.
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("service_tier", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.drop_column("service_tier")
    # A tier's own prices have no place in the older key: they go, the base prices stay.
    op.execute(sa.text("DELETE FROM prices WHERE service_tier <> ''"))
    with op.batch_alter_table("prices", schema=None) as batch_op:
        batch_op.drop_constraint("uq_prices_backend", type_="unique")
        batch_op.create_unique_constraint(
            "uq_prices_backend", ["backend", "model", "token_class", "effective_from"]
        )
        batch_op.drop_column("service_tier")
