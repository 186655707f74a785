"""The ledger: nodes, GPUs with capacity counters, allocations, quotas, usage, idempotency, outbox.

Revision ID: 0001_ledger
Revises:
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0001_ledger"
down_revision = None
branch_labels = None
depends_on = None

LIVE = "state IN ('reserved', 'bound', 'assigned')"


def _ts(name: str, nullable: bool = True, default: bool = False) -> sa.Column:
    return sa.Column(
        name, sa.DateTime(timezone=True), nullable=nullable, server_default=sa.func.now() if default else None
    )


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("labels", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("driver_version", sa.Text, nullable=False, server_default=""),
        sa.Column("cuda_version", sa.Text, nullable=False, server_default=""),
        _ts("retired_at"),
        _ts("updated_at", nullable=False, default=True),
        sa.PrimaryKeyConstraint("name", name="pk_nodes"),
    )
    op.create_table(
        "gpus",
        sa.Column("uuid", sa.Text, nullable=False),
        sa.Column("node", sa.Text, nullable=False),
        sa.Column("index", sa.Integer, nullable=False),
        sa.Column("model", sa.Text, nullable=False, server_default=""),
        sa.Column("memory_mib", sa.Integer, nullable=False),
        sa.Column("memory_total_mib", sa.Integer, nullable=False),
        sa.Column("compute_units", sa.Integer, nullable=False, server_default="100"),
        sa.Column("allocated_memory_mib", sa.Integer, nullable=False, server_default="0"),
        sa.Column("allocated_compute", sa.Integer, nullable=False, server_default="0"),
        sa.Column("healthy", sa.Boolean, nullable=False, server_default=sa.text("true")),
        sa.Column("health_reason", sa.Text, nullable=False, server_default=""),
        sa.Column("mig_mode", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("numa_node", sa.Integer),
        sa.Column("pci_bus_id", sa.Text, nullable=False, server_default=""),
        _ts("retired_at"),
        _ts("updated_at", nullable=False, default=True),
        sa.PrimaryKeyConstraint("uuid", name="pk_gpus"),
        sa.ForeignKeyConstraint(["node"], ["nodes.name"], name="fk_gpus_node_nodes", ondelete="CASCADE"),
        sa.CheckConstraint(
            "allocated_memory_mib >= 0 AND allocated_memory_mib <= memory_mib", name="ck_gpus_memory_fits"
        ),
        sa.CheckConstraint(
            "allocated_compute >= 0 AND allocated_compute <= compute_units", name="ck_gpus_compute_fits"
        ),
        sa.CheckConstraint("memory_mib >= 0 AND memory_mib <= memory_total_mib", name="ck_gpus_memory_sane"),
    )
    op.create_index("ix_gpus_node", "gpus", ["node"])

    op.create_table(
        "allocations",
        sa.Column("id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("pod_uid", sa.Text, nullable=False),
        sa.Column("namespace", sa.Text, nullable=False),
        sa.Column("pod_name", sa.Text, nullable=False),
        sa.Column("owner_kind", sa.Text, nullable=False, server_default=""),
        sa.Column("owner_name", sa.Text, nullable=False, server_default=""),
        sa.Column("node", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("memory_mib", sa.Integer, nullable=False),
        sa.Column("compute", sa.Integer, nullable=False, server_default="0"),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
        _ts("reserved_at", nullable=False),
        _ts("bound_at"),
        _ts("assigned_at"),
        _ts("ended_at"),
        sa.PrimaryKeyConstraint("id", name="pk_allocations"),
        sa.CheckConstraint(
            "state IN ('reserved', 'bound', 'assigned', 'released', 'failed')", name="ck_allocations_known_state"
        ),
    )
    op.create_index("uq_allocations_live_pod", "allocations", ["pod_uid"], unique=True, postgresql_where=sa.text(LIVE))
    op.create_index("ix_allocations_node_state", "allocations", ["node", "state"])
    op.create_index("ix_allocations_namespace_state", "allocations", ["namespace", "state"])
    op.create_index("ix_allocations_reserved_at", "allocations", ["reserved_at"])

    op.create_table(
        "allocation_parts",
        sa.Column("allocation_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("container", sa.Text, nullable=False),
        sa.Column("container_index", sa.Integer, nullable=False),
        sa.Column("init", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("gpu_uuid", sa.Text, nullable=False),
        sa.Column("gpu_index", sa.Integer, nullable=False),
        sa.Column("memory_mib", sa.Integer, nullable=False),
        sa.Column("compute", sa.Integer, nullable=False, server_default="0"),
        _ts("assigned_at"),
        sa.PrimaryKeyConstraint("allocation_id", "container_index", "init", "gpu_uuid", name="pk_allocation_parts"),
        sa.ForeignKeyConstraint(
            ["allocation_id"],
            ["allocations.id"],
            name="fk_allocation_parts_allocation_id_allocations",
            ondelete="CASCADE",
        ),
        sa.CheckConstraint("memory_mib >= 0 AND compute >= 0", name="ck_allocation_parts_non_negative"),
    )
    op.create_index("ix_allocation_parts_gpu_uuid", "allocation_parts", ["gpu_uuid"])

    op.create_table(
        "quotas",
        sa.Column("namespace", sa.Text, nullable=False),
        sa.Column("memory_mib", sa.Integer),
        sa.Column("compute", sa.Integer),
        _ts("updated_at", nullable=False, default=True),
        sa.PrimaryKeyConstraint("namespace", name="pk_quotas"),
        sa.CheckConstraint("memory_mib IS NULL OR memory_mib >= 0", name="ck_quotas_memory_non_negative"),
        sa.CheckConstraint("compute IS NULL OR compute >= 0", name="ck_quotas_compute_non_negative"),
    )
    op.create_table(
        "applied_events",
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
        _ts("applied_at", nullable=False, default=True),
        sa.PrimaryKeyConstraint("consumer", "event_id", name="pk_applied_events"),
    )
    op.create_table(
        "usage_samples",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
        _ts("ts", nullable=False),
        sa.Column("node", sa.Text, nullable=False),
        sa.Column("gpu_uuid", sa.Text, nullable=False),
        sa.Column("pod_uid", sa.Text, nullable=False, server_default=""),
        sa.Column("namespace", sa.Text, nullable=False, server_default=""),
        sa.Column("pod_name", sa.Text, nullable=False, server_default=""),
        sa.Column("container", sa.Text, nullable=False, server_default=""),
        sa.Column("used_memory_mib", sa.Integer, nullable=False),
        sa.Column("utilization_pct", sa.Float, nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("id", name="pk_usage_samples"),
    )
    op.create_index("ix_usage_samples_pod_uid_ts", "usage_samples", ["pod_uid", "ts"])
    op.create_index("ix_usage_samples_namespace_ts", "usage_samples", ["namespace", "ts"])
    op.create_index("ix_usage_samples_event_id", "usage_samples", ["event_id"])
    op.create_table(
        "outbox",
        sa.Column("seq", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        _ts("created_at", nullable=False, default=True),
        sa.PrimaryKeyConstraint("seq", name="pk_outbox"),
        sa.UniqueConstraint("event_id", name="uq_outbox_event_id"),
    )


def downgrade() -> None:
    for table in (
        "outbox",
        "usage_samples",
        "applied_events",
        "quotas",
        "allocation_parts",
        "allocations",
        "gpus",
        "nodes",
    ):
        op.drop_table(table)
