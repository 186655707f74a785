"""Indexes for pruning: `applied_events.applied_at` (claims older than the dedupe horizon are deleted) and
`usage_samples.ts` (old samples are thinned, then deleted). Indexes only: the previous release's code runs
unchanged beside them.

Revision ID: 0006_retention_indexes
Revises: 0005_sidecar_parts
Create Date: 2026-12-04
"""

from alembic import op

revision = "0006_retention_indexes"
down_revision = "0005_sidecar_parts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_applied_events_applied_at", "applied_events", ["applied_at"])
    op.create_index("ix_usage_samples_ts", "usage_samples", ["ts"])


def downgrade() -> None:
    op.drop_index("ix_usage_samples_ts", "usage_samples")
    op.drop_index("ix_applied_events_applied_at", "applied_events")
