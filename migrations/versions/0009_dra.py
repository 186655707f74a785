"""Dynamic Resource Allocation: allocations know their ResourceClaim, nodes know who places shares on them.

- `allocations.claim_uid`, `allocations.claim_name`: set for an allocation kube-scheduler made from a gpushare
  ResourceClaim (recorded by the binder before the pod binds, docs/dra.md); NULL for the extender's. At most one
  live allocation per claim (partial unique index), as there is at most one per pod.
- `nodes.allocator`: `extender` (the node agent serves kubelet's device plugins) or `dra` (it is a DRA plugin);
  the inventory carries it. The extender places no pod on a `dra` node, and the ledger records no claim share
  on a GPU that holds device-plugin shares, so no GPU is reachable through both paths.

The binder writes the new columns (it records claims and node inventories): it is granted UPDATE on them. The
previous release neither reads nor writes them, so it keeps working during a rolling update (every node it sees
is an extender node). Downgrading forgets which allocations came from claims: end the DRA pods first.

Revision ID: 0009_dra
Revises: 0008_usage_sm_utilization
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_dra"
down_revision = "0008_usage_sm_utilization"
branch_labels = None
depends_on = None

LIVE = "state IN ('reserved', 'bound', 'assigned')"


def upgrade() -> None:
    op.add_column("allocations", sa.Column("claim_uid", sa.Text))
    op.add_column("allocations", sa.Column("claim_name", sa.Text))
    op.create_index(
        "uq_allocations_live_claim",
        "allocations",
        ["claim_uid"],
        unique=True,
        postgresql_where=sa.text(f"{LIVE} AND claim_uid IS NOT NULL"),
    )
    # the CHECK comes with the new column (old services never write it; its default satisfies it): additive
    op.add_column(
        "nodes",
        sa.Column(
            "allocator",
            sa.Text,
            sa.CheckConstraint("allocator IN ('extender', 'dra')", name="ck_nodes_known_allocator"),
            nullable=False,
            server_default="extender",
        ),
    )
    op.execute("GRANT UPDATE (claim_uid, claim_name) ON allocations TO gpushare_binder")
    op.execute("GRANT UPDATE (allocator) ON nodes TO gpushare_binder")


def downgrade() -> None:
    op.execute("REVOKE UPDATE (allocator) ON nodes FROM gpushare_binder")
    op.execute("REVOKE UPDATE (claim_uid, claim_name) ON allocations FROM gpushare_binder")
    op.drop_constraint("ck_nodes_known_allocator", "nodes", type_="check")
    op.drop_column("nodes", "allocator")
    op.drop_index("uq_allocations_live_claim", table_name="allocations")
    op.drop_column("allocations", "claim_name")
    op.drop_column("allocations", "claim_uid")
