"""usage_route_rollups: usage_rollups' daily sums per route as well, so that the usage report groups
by route over whole days from rollups; filled from the ledger's events. A table of its own: the
release before upserts usage_rollups on its unique key, which a route column in it would change

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05 21:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_GROUP = ("day", "tenant_id", "key_id", "backend", "model", "route")
_AMOUNTS = (
    "input_tokens",
    "cached_input_tokens",
    "cache_write_5m_tokens",
    "cache_write_1h_tokens",
    "output_tokens",
    "reasoning_tokens",
    "web_search_requests",
    "cost_pico_usd",
    "savings_pico_usd",
)
# Every event of the ledger, summed as the writer sums it (gateway/accounting/writer.py): attempts,
# failed ones (499s, cancelled, apart), client requests (first attempts of no Weir call of its own),
# then the amounts; a missing tenant or key as "". `weir db upgrade` runs it once, in its migration's
# transaction (docs/deploy.md says how to redo the rollout's days).
BACKFILL = f"""
INSERT INTO usage_route_rollups ({", ".join(_GROUP)}, requests, errors, cancelled, client_requests,
                                 {", ".join(_AMOUNTS)})
SELECT day, coalesce(tenant_id, ''), coalesce(key_id, ''), backend, model, route, count(*),
       sum(CASE WHEN (status < 200 OR status >= 400) AND status <> 499 THEN 1 ELSE 0 END),
       sum(CASE WHEN status = 499 THEN 1 ELSE 0 END),
       sum(CASE WHEN attempt = 1 AND purpose IS NULL THEN 1 ELSE 0 END),
       {", ".join(f"sum({name})" for name in _AMOUNTS)}
FROM usage_events
GROUP BY day, coalesce(tenant_id, ''), coalesce(key_id, ''), backend, model, route
"""


def upgrade() -> None:
    op.create_table(
        "usage_route_rollups",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("tenant_id", sa.String(length=200), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("backend", sa.String(length=200), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("route", sa.String(length=200), nullable=False),
        *(
            sa.Column(name, sa.BigInteger(), nullable=False)
            for name in ("requests", "errors", "cancelled", "client_requests", *_AMOUNTS)
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_route_rollups")),
        sa.UniqueConstraint(*_GROUP, name=op.f("uq_usage_route_rollups_day")),
    )
    op.execute(BACKFILL)


def downgrade() -> None:
    op.drop_table("usage_route_rollups")
