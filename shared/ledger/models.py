"""Ledger tables (SQLAlchemy Core). The migrations in `migrations/` create exactly these.

The no-overcommit invariant is enforced by the database itself: each GPU row carries the memory and
compute its live allocations hold, every reservation raises those counters with a conditional UPDATE
(which takes the row lock, so concurrent writers serialise per GPU), and CHECK constraints make any
write that would exceed capacity fail, whatever process attempts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

from shared.events.catalogue import AllocationPart
from shared.ledger.rules import LIVE_STATE_VALUES, AllocationState

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}  # how the migrations name constraints and indexes (accounting's tables follow it too)

metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _state_in(states: tuple[str, ...]) -> str:
    return "state IN (" + ", ".join(f"'{s}'" for s in states) + ")"


LIVE_SQL = _state_in(LIVE_STATE_VALUES)

nodes = Table(
    "nodes",
    metadata,
    Column("name", Text, primary_key=True),
    Column("labels", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("driver_version", Text, nullable=False, server_default=""),
    Column("cuda_version", Text, nullable=False, server_default=""),
    Column("retired_at", DateTime(timezone=True)),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # who places shares on the node: "extender" (device plugins) or "dra" (kube-scheduler's DRA allocator)
    Column("allocator", Text, nullable=False, server_default="extender"),
    CheckConstraint("allocator IN ('extender', 'dra')", name="known_allocator"),
)

gpus = Table(
    "gpus",
    metadata,
    Column("uuid", Text, primary_key=True),
    Column("node", Text, ForeignKey("nodes.name", ondelete="CASCADE"), nullable=False),
    Column("index", Integer, nullable=False),
    Column("model", Text, nullable=False, server_default=""),
    Column("memory_mib", Integer, nullable=False),
    Column("memory_total_mib", Integer, nullable=False),
    Column("compute_units", Integer, nullable=False, server_default="100"),
    Column("allocated_memory_mib", Integer, nullable=False, server_default="0"),
    Column("allocated_compute", Integer, nullable=False, server_default="0"),
    Column("healthy", Boolean, nullable=False, server_default=text("true")),
    Column("health_reason", Text, nullable=False, server_default=""),
    Column("mig_mode", Boolean, nullable=False, server_default=text("false")),
    Column("numa_node", Integer),
    Column("pci_bus_id", Text, nullable=False, server_default=""),
    Column("retired_at", DateTime(timezone=True)),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("allocated_memory_mib >= 0 AND allocated_memory_mib <= memory_mib", name="memory_fits"),
    CheckConstraint("allocated_compute >= 0 AND allocated_compute <= compute_units", name="compute_fits"),
    CheckConstraint("memory_mib >= 0 AND memory_mib <= memory_total_mib", name="memory_sane"),
    Index("ix_gpus_node", "node"),
)

allocations = Table(
    "allocations",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("pod_uid", Text, nullable=False),
    Column("namespace", Text, nullable=False),
    Column("pod_name", Text, nullable=False),
    Column("owner_kind", Text, nullable=False, server_default=""),
    Column("owner_name", Text, nullable=False, server_default=""),
    Column("node", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("memory_mib", Integer, nullable=False),
    Column("compute", Integer, nullable=False, server_default="0"),
    Column("reason", Text, nullable=False, server_default=""),
    Column("reserved_at", DateTime(timezone=True), nullable=False),
    Column("bound_at", DateTime(timezone=True)),
    Column("assigned_at", DateTime(timezone=True)),
    Column("ended_at", DateTime(timezone=True)),
    Column("terminating_at", DateTime(timezone=True)),  # the pod got a deletionTimestamp; the share stays held
    Column("version", Integer, nullable=False, server_default="1"),  # raised by every exchange
    Column("pod_created_at", DateTime(timezone=True)),  # kubelet admits pods in creation order
    # a DRA allocation: the ResourceClaim kube-scheduler allocated (NULL: placed by the extender)
    Column("claim_uid", Text),
    Column("claim_name", Text),
    CheckConstraint(_state_in(tuple(s.value for s in AllocationState)), name="known_state"),
    Index("uq_allocations_live_pod", "pod_uid", unique=True, postgresql_where=text(LIVE_SQL)),
    Index(
        "uq_allocations_live_claim",
        "claim_uid",
        unique=True,
        postgresql_where=text(f"{LIVE_SQL} AND claim_uid IS NOT NULL"),
    ),
    Index("ix_allocations_node_state", "node", "state"),
    Index("ix_allocations_namespace_state", "namespace", "state"),
    Index("ix_allocations_reserved_at", "reserved_at"),
)

allocation_parts = Table(
    "allocation_parts",
    metadata,
    Column("allocation_id", UUID(as_uuid=True), ForeignKey("allocations.id", ondelete="CASCADE"), nullable=False),
    Column("container", Text, nullable=False),
    Column("container_index", Integer, nullable=False),
    Column("init", Boolean, nullable=False, server_default=text("false")),
    # an init container with restartPolicy Always: it keeps its share beside the app containers
    Column("sidecar", Boolean, nullable=False, server_default=text("false")),
    Column("gpu_uuid", Text, nullable=False),
    Column("gpu_index", Integer, nullable=False),
    Column("memory_mib", Integer, nullable=False),
    Column("compute", Integer, nullable=False, server_default="0"),
    Column("assigned_at", DateTime(timezone=True)),
    PrimaryKeyConstraint("allocation_id", "container_index", "init", "gpu_uuid"),
    CheckConstraint("memory_mib >= 0 AND compute >= 0", name="non_negative"),
    CheckConstraint("init OR NOT sidecar", name="sidecar_is_init"),
    Index("ix_allocation_parts_gpu_uuid", "gpu_uuid"),
)

quotas = Table(
    "quotas",
    metadata,
    Column("namespace", Text, primary_key=True),
    Column("memory_mib", Integer),
    Column("compute", Integer),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("memory_mib IS NULL OR memory_mib >= 0", name="memory_non_negative"),
    CheckConstraint("compute IS NULL OR compute >= 0", name="compute_non_negative"),
)

claim_holds = Table(
    "claim_holds",
    metadata,
    # the quota a gpushare ResourceClaim took at admission (migration 0011: admission's bookkeeping, no events)
    Column("claim_uid", Text, primary_key=True),
    Column("namespace", Text, nullable=False),
    Column("claim_name", Text, nullable=False),
    Column("pod_name", Text, nullable=False, server_default=""),
    Column("memory_mib", Integer, nullable=False),
    Column("compute", Integer, nullable=False, server_default="0"),
    Column("admitted_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("memory_mib >= 0 AND compute >= 0", name="non_negative"),
    Index("ix_claim_holds_namespace", "namespace"),
)

applied_events = Table(
    "applied_events",
    metadata,
    Column("consumer", Text, nullable=False),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("applied_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("consumer", "event_id"),
    Index("ix_applied_events_applied_at", "applied_at"),  # claims are pruned after the dedupe horizon
)

outbox = Table(
    "outbox",
    metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=True),
    Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("subject", Text, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)


def part_from_row(row: Any) -> AllocationPart:
    """An `allocation_parts` row as the event model the rest of the code speaks."""
    return AllocationPart(
        container=row.container,
        container_index=row.container_index,
        gpu_uuid=row.gpu_uuid,
        gpu_index=row.gpu_index,
        memory_mib=row.memory_mib,
        compute=row.compute,
        init=row.init,
        sidecar=row.sidecar,
    )


def part_arrays(parts: Sequence[AllocationPart]) -> list[list[Any]]:
    """The parts as one array per `allocation_parts` column, in the order container, container_index, init, sidecar,
    gpu_uuid, gpu_index, memory_mib, compute (text, integer, boolean, boolean, text, integer, integer, integer): what
    an INSERT of many parts takes over `unnest`, in one statement."""
    return [
        [p.container for p in parts],
        [p.container_index for p in parts],
        [p.init for p in parts],
        [p.sidecar for p in parts],
        [p.gpu_uuid for p in parts],
        [p.gpu_index for p in parts],
        [p.memory_mib for p in parts],
        [p.compute for p in parts],
    ]


def part_row(allocation_id: Any, part: AllocationPart, assigned_at: Any = None) -> dict[str, Any]:
    """The `allocation_parts` row of one part (the inverse of `part_from_row`)."""
    return {
        "allocation_id": allocation_id,
        "container": part.container,
        "container_index": part.container_index,
        "init": part.init,
        "sidecar": part.sidecar,
        "gpu_uuid": part.gpu_uuid,
        "gpu_index": part.gpu_index,
        "memory_mib": part.memory_mib,
        "compute": part.compute,
        "assigned_at": assigned_at,
    }
