"""Accounting's own tables, beside the authoritative ledger: its read models (projections of the event
stream) and the usage samples.

`migrations/versions/0002_accounting.py` creates the projections, `0001_ledger.py` `usage_samples` (0008 adds
its SM column). They are
derived data: `gpushare ledger rebuild` truncates and refills them from the stream
(`projections.rebuild_projections`).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Float, Index, Integer, MetaData, Table, Text, UniqueConstraint
from sqlalchemy.dialects.postgresql import JSONB, UUID

from shared.ledger.models import NAMING_CONVENTION

# Kept apart from the ledger's metadata: these tables belong to accounting alone.
metadata = MetaData(naming_convention=NAMING_CONVENTION)

CONSUMER = "accounting"  # the durable consumer of the ledger stream (and the name of both consumers' claims)
SAMPLES_CONSUMER = "accounting-samples"  # the durable consumer of the samples stream

# One row per life-cycle step of an allocation: reserved, bound, assigned, exchanged, released, failed.
timeline = Table(
    "acc_timeline",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("allocation_id", UUID(as_uuid=True), nullable=False),
    Column("pod_uid", Text, nullable=False),
    Column("node", Text, nullable=False),
    Column("step", Text, nullable=False),
    Column("ts", DateTime(timezone=True), nullable=False),
    Column("detail", Text, nullable=False, server_default=""),
    UniqueConstraint("event_id", "allocation_id", name="uq_acc_timeline_event_id_allocation_id"),
    Index("ix_acc_timeline_allocation_id_ts", "allocation_id", "ts"),
    Index("ix_acc_timeline_pod_uid", "pod_uid"),
)

# The latest reasons a pod did not fit, until it gets a reservation.
pending = Table(
    "acc_pending",
    metadata,
    Column("pod_uid", Text, primary_key=True),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("namespace", Text, nullable=False),
    Column("pod_name", Text, nullable=False),
    Column("summary", Text, nullable=False, server_default=""),
    Column("reasons", JSONB, nullable=False),
    Column("refused_at", DateTime(timezone=True), nullable=False),
    Index("ix_acc_pending_namespace_pod_name", "namespace", "pod_name"),
)

# One row per usage sample (usage events).
usage_samples = Table(
    "usage_samples",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("ts", DateTime(timezone=True), nullable=False),
    Column("node", Text, nullable=False),
    Column("gpu_uuid", Text, nullable=False),
    Column("pod_uid", Text, nullable=False, server_default=""),
    Column("namespace", Text, nullable=False, server_default=""),
    Column("pod_name", Text, nullable=False, server_default=""),
    Column("container", Text, nullable=False, server_default=""),
    Column("used_memory_mib", Integer, nullable=False),
    Column("utilization_pct", Float, nullable=False, server_default="0"),
    Column("sm_utilization_pct", Float, nullable=True),  # the pod's share of the GPU's SMs (null: unknown)
    Index("ix_usage_samples_pod_uid_ts", "pod_uid", "ts"),
    Index("ix_usage_samples_namespace_ts", "namespace", "ts"),
    Index("ix_usage_samples_event_id", "event_id"),
    Index("ix_usage_samples_ts", "ts"),  # old samples are thinned, then deleted (housekeeping)
)

PROJECTION_TABLES = (timeline, pending, usage_samples)  # what `gpushare ledger rebuild` refills
