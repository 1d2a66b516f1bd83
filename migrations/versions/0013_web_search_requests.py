"""usage_events.web_search_requests and usage_rollups.web_search_requests: Anthropic web searches,
billed per search as the `web_search` price class

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 11:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_TABLES = ("usage_events", "usage_rollups")


def upgrade() -> None:
    # 0, not NULL: attempts recorded before it made no search the ledger knew of, and a replica still
    # on 0012's code goes on inserting rows without the column.
    for table in _TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(
                sa.Column("web_search_requests", sa.BigInteger(), nullable=False, server_default="0")
            )


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("web_search_requests")
    # The older code knows no `web_search` class: its catalog could not load such a row. The config's
    # seeding markers go too, so that upgrading again seeds the config's search price afresh.
    op.execute(sa.text("DELETE FROM prices WHERE token_class = 'web_search'"))
    markers = sa.text("DELETE FROM settings WHERE key LIKE :pattern ESCAPE '\\'")
    op.execute(markers.bindparams(pattern="config_price:%:web\\_search"))
