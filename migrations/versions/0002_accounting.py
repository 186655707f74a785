"""Accounting's projections: allocation timeline and pending-pod reasons.

Revision ID: 0002_accounting
Revises: 0001_ledger
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0002_accounting"
down_revision = "0001_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "acc_timeline",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("allocation_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("pod_uid", sa.Text, nullable=False),
        sa.Column("node", sa.Text, nullable=False),
        sa.Column("step", sa.Text, nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("detail", sa.Text, nullable=False, server_default=""),
        sa.PrimaryKeyConstraint("id", name="pk_acc_timeline"),
        sa.UniqueConstraint("event_id", "allocation_id", name="uq_acc_timeline_event_id_allocation_id"),
    )
    op.create_index("ix_acc_timeline_allocation_id_ts", "acc_timeline", ["allocation_id", "ts"])
    op.create_index("ix_acc_timeline_pod_uid", "acc_timeline", ["pod_uid"])
    op.create_table(
        "acc_pending",
        sa.Column("pod_uid", sa.Text, nullable=False),
        sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("namespace", sa.Text, nullable=False),
        sa.Column("pod_name", sa.Text, nullable=False),
        sa.Column("summary", sa.Text, nullable=False, server_default=""),
        sa.Column("reasons", pg.JSONB, nullable=False),
        sa.Column("refused_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("pod_uid", name="pk_acc_pending"),
    )
    op.create_index("ix_acc_pending_namespace_pod_name", "acc_pending", ["namespace", "pod_name"])


def downgrade() -> None:
    op.drop_table("acc_pending")
    op.drop_table("acc_timeline")
