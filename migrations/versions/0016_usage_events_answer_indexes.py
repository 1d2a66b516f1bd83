"""usage_events: partial indexes, by time, of the client requests whose first attempt did not answer
and of the later attempts that did, for the uptime report's per-tenant success (which reads those few
rows instead of grouping the range's ledger by request)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# As gateway/accounting/events.py says them today (UNANSWERED_START_SQL, ANSWERED_RETRY_SQL): a client
# request's first attempt (no purpose: not a call Weir made itself) that got no 2xx/3xx answer, and a
# later attempt that got one.
_INDEXES = {
    "ix_usage_events_unanswered_starts": "attempt = 1 AND purpose IS NULL AND (status < 200 OR status >= 400)",
    "ix_usage_events_answered_retries": "attempt > 1 AND status >= 200 AND status < 400",
}


def upgrade() -> None:
    # IF NOT EXISTS: on a big PostgreSQL ledger an operator may have built them beforehand, with
    # CREATE INDEX CONCURRENTLY, rather than hold off the writers' inserts while this reads the ledger
    # (docs/deploy.md).
    for name, where in _INDEXES.items():
        op.create_index(
            name,
            "usage_events",
            ["ts"],
            if_not_exists=True,
            sqlite_where=sa.text(where),
            postgresql_where=sa.text(where),
        )


def downgrade() -> None:
    for name in _INDEXES:
        op.drop_index(name, table_name="usage_events")
