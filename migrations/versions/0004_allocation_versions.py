"""Allocations carry a version (raised by every exchange) and their pod's creation time.

The version lets every copy of an allocation record (the node agents' views, pod annotations, a replay)
tell a newer record from an older one; the pod creation time is the order kubelet admits pods in.

Revision ID: 0004_allocation_versions
Revises: 0003_terminating
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_allocation_versions"
down_revision = "0003_terminating"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("allocations", sa.Column("version", sa.Integer, nullable=False, server_default="1"))
    op.add_column("allocations", sa.Column("pod_created_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("allocations", "pod_created_at")
    op.drop_column("allocations", "version")
