"""usage_rollups.client_requests: the client requests whose first attempt is in the row's group, so
that a whole-day usage report counts requests from the rollups; existing rows are counted from the
ledger's events

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# Each rollup row's first attempts (attempt 1: one per request, `events.FIRST_ATTEMPT`), counted from
# the ledger by the row's own group (the writer stores a missing tenant or key as ""), as 0010 counts
# its 499s: one pass over the events, not one per rollup row; UPDATE ... FROM runs on PostgreSQL and
# on SQLite (3.33 and later).
_CLIENT_REQUESTS = """
UPDATE usage_rollups SET client_requests = c.n
FROM (
    SELECT day, coalesce(tenant_id, '') AS tenant_id, coalesce(key_id, '') AS key_id, backend, model,
           count(*) AS n
    FROM usage_events WHERE attempt = 1
    GROUP BY day, coalesce(tenant_id, ''), coalesce(key_id, ''), backend, model
) AS c
WHERE usage_rollups.day = c.day AND usage_rollups.tenant_id = c.tenant_id
  AND usage_rollups.key_id = c.key_id AND usage_rollups.backend = c.backend
  AND usage_rollups.model = c.model
"""


def upgrade() -> None:
    # 0 by default: a replica still on 0013's code goes on upserting rows without the column.
    with op.batch_alter_table("usage_rollups", schema=None) as batch_op:
        batch_op.add_column(sa.Column("client_requests", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute(_CLIENT_REQUESTS)


def downgrade() -> None:
    with op.batch_alter_table("usage_rollups", schema=None) as batch_op:
        batch_op.drop_column("client_requests")
