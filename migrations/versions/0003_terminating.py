"""Allocations remember when their pod started terminating (the share stays held until the pod is gone).

Revision ID: 0003_terminating
Revises: 0002_accounting
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_terminating"
down_revision = "0002_accounting"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("allocations", sa.Column("terminating_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("allocations", "terminating_at")
