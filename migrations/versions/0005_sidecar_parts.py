"""Sidecar shares: `allocation_parts.sidecar` marks an init container with restartPolicy Always.

Kubernetes counts a sidecar beside the app containers (and beside every init container that starts after
it), so the ledger must tell it from a regular init container to charge a GPU as Kubernetes counts it.
Existing rows are regular init or app containers (false). The previous release's code neither writes nor
reads the column, so its statements keep working during a rolling update (it would give back a sidecar
share released meanwhile as a regular init share: less than was charged, never more). Downgrading
turns live sidecar shares into regular init shares, whose release gives back less than was charged: end the
pods with GPU sidecars first.

Revision ID: 0005_sidecar_parts
Revises: 0004_allocation_versions
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_sidecar_parts"
down_revision = "0004_allocation_versions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("allocation_parts", sa.Column("sidecar", sa.Boolean, nullable=False, server_default=sa.text("false")))
    op.create_check_constraint("ck_allocation_parts_sidecar_is_init", "allocation_parts", "init OR NOT sidecar")


def downgrade() -> None:
    op.drop_constraint("ck_allocation_parts_sidecar_is_init", "allocation_parts", type_="check")
    op.drop_column("allocation_parts", "sidecar")
