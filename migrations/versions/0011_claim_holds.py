"""GiB quotas at admission: the quota each gpushare ResourceClaim took when it was created (`claim_holds`).

gpushare admission (the extender's validating webhook for ResourceClaims of the `gpushare-gpu` class, docs/dra.md)
counts a namespace's outstanding claims against its ledger quota when a claim is created: it takes the
namespace's quota lock, adds the live allocations and the holds of claims not allocated yet, and records the new
claim's hold in the same transaction, so two creations at the same moment cannot both pass. A hold counts while
its claim holds no live allocation (an allocated claim counts through its allocation), and ends when the claim is
deleted (the binder's claim watch) or was never created (reconciliation).

Holds are admission's bookkeeping about objects Kubernetes keeps, not ledger history: they have no events, and the
binder derives them again from the claims at every relist. The extender inserts them (admission), the binder
deletes them; both read them (their quota checks).
Additive: the previous release neither reads nor writes the table (its quota checks just do not see holds).

Revision ID: 0011_claim_holds
Revises: 0010_schema_revisions
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_claim_holds"
down_revision = "0010_schema_revisions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "claim_holds",
        sa.Column("claim_uid", sa.Text(), primary_key=True),
        sa.Column("namespace", sa.Text(), nullable=False),
        sa.Column("claim_name", sa.Text(), nullable=False),
        sa.Column("pod_name", sa.Text(), nullable=False, server_default=""),
        sa.Column("memory_mib", sa.Integer(), nullable=False),
        sa.Column("compute", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("memory_mib >= 0 AND compute >= 0", name="ck_claim_holds_non_negative"),
    )
    op.create_index("ix_claim_holds_namespace", "claim_holds", ["namespace"])
    op.execute("GRANT SELECT, INSERT ON claim_holds TO gpushare_extender")
    op.execute("GRANT SELECT, DELETE ON claim_holds TO gpushare_binder")


def downgrade() -> None:
    op.drop_index("ix_claim_holds_namespace", table_name="claim_holds")
    op.drop_table("claim_holds")
