"""usage_events.purpose: why Weir itself made a call (`compare`, `judge`: a comparison's other answer
and its judge), None for a client's request; such a call is an attempt, not a client request, so
existing rows get theirs from their routing text and the rollups that held one are counted again

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

# What routing/compare.py has written in a background call's routing column since comparisons began
# (`...; candidate=M; purpose=compare; for=<client request id>`); a client's routing has no `purpose=`.
_PURPOSE = """
UPDATE usage_events
SET purpose = CASE WHEN routing LIKE '%; purpose=judge; for=%' THEN 'judge' ELSE 'compare' END
WHERE routing LIKE '%; purpose=compare; for=%' OR routing LIKE '%; purpose=judge; for=%'
"""

# Each rollup row's client requests, counted again from the ledger (as 0014 counts them: by the row's
# own group, a missing tenant or key "" in the rollups), for the rows whose group holds a call of
# Weir's own: `{starts}` says which attempts start a client request.
_RECOUNT = """
UPDATE usage_rollups SET client_requests = c.n
FROM (
    SELECT day, coalesce(tenant_id, '') AS tenant_id, coalesce(key_id, '') AS key_id, backend, model,
           sum(CASE WHEN {starts} THEN 1 ELSE 0 END) AS n
    FROM usage_events
    GROUP BY day, coalesce(tenant_id, ''), coalesce(key_id, ''), backend, model
    HAVING sum(CASE WHEN purpose IS NOT NULL THEN 1 ELSE 0 END) > 0
) AS c
WHERE usage_rollups.day = c.day AND usage_rollups.tenant_id = c.tenant_id
  AND usage_rollups.key_id = c.key_id AND usage_rollups.backend = c.backend
  AND usage_rollups.model = c.model
"""


def upgrade() -> None:
    # Nullable, no default: a replica still on 0014's code records its calls without one.
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("purpose", sa.String(length=16), nullable=True))
    op.execute(_PURPOSE)
    op.execute(_RECOUNT.format(starts="attempt = 1 AND purpose IS NULL"))


def downgrade() -> None:
    # 0014's code counts every first attempt as a client request: Weir's own calls again too.
    op.execute(_RECOUNT.format(starts="attempt = 1"))
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.drop_column("purpose")
