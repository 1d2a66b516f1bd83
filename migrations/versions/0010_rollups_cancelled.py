"""usage_rollups.cancelled: attempts cancelled (499: a hedge race's loser, a client that left), counted
apart from `errors`, which counted them until now; existing rows are split from the ledger's events

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Each rollup row's 499s, counted from the ledger by the row's own group (the writer stores a missing
# tenant or key as ""). One pass over the events, not one per rollup row; UPDATE ... FROM runs on
# PostgreSQL and on SQLite (3.33 and later).
_CANCELLED = """
UPDATE usage_rollups SET cancelled = c.n, errors = usage_rollups.errors - c.n
FROM (
    SELECT day, coalesce(tenant_id, '') AS tenant_id, coalesce(key_id, '') AS key_id, backend, model,
           count(*) AS n
    FROM usage_events WHERE status = 499
    GROUP BY day, coalesce(tenant_id, ''), coalesce(key_id, ''), backend, model
) AS c
WHERE usage_rollups.day = c.day AND usage_rollups.tenant_id = c.tenant_id
  AND usage_rollups.key_id = c.key_id AND usage_rollups.backend = c.backend
  AND usage_rollups.model = c.model
"""


def upgrade() -> None:
    with op.batch_alter_table("usage_rollups", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cancelled", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute(_CANCELLED)


def downgrade() -> None:
    # Back to one count: the cancelled attempts are errors again.
    op.execute("UPDATE usage_rollups SET errors = errors + cancelled")
    with op.batch_alter_table("usage_rollups", schema=None) as batch_op:
        batch_op.drop_column("cancelled")
