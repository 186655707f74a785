"""Accounting's own read models (projections of the event stream), beside the authoritative ledger.

`migrations/versions/0002_accounting.py` creates exactly these. They are derived data: `gpushare ledger
rebuild` truncates and refills them from the stream (`projections.rebuild_projections`).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Index, MetaData, Table, Text, UniqueConstraint
from sqlalchemy.dialects.postgresql import JSONB, UUID

# Kept apart from the ledger's metadata: these tables belong to accounting alone.
metadata = MetaData()

CONSUMER = "accounting"

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

PROJECTION_TABLES = (timeline, pending)
