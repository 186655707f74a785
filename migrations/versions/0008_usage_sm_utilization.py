"""Per-pod SM utilisation: `usage_samples.sm_utilization_pct`, the share of the GPU's SMs a pod's processes kept
busy (NVML's per-process samples), null where the GPU could not say and for samples stored before.

A nullable column only: the previous release's accounting neither writes nor reads it, so its statements keep
working during a rolling update. Downgrading drops the figures.

Revision ID: 0008_usage_sm_utilization
Revises: 0007_service_roles
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_usage_sm_utilization"
down_revision = "0007_service_roles"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("usage_samples", sa.Column("sm_utilization_pct", sa.Float, nullable=True))


def downgrade() -> None:
    op.drop_column("usage_samples", "sm_utilization_pct")
