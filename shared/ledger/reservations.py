"""Reserving GPU shares for a pod: the statements that keep the no-overcommit invariant.

Inside the caller's transaction, after it took the quota and GPU locks the pod needs
(`locks.lock_for_reservations`: the ledger's one lock order, so concurrent writers cannot deadlock): insert the
allocation (the partial unique index on live allocations per pod UID makes a retried or concurrent reserve for
the same pod find the existing one), check the namespace quota under its lock, then raise each GPU's counters
with a conditional UPDATE. The CHECK constraints on `gpus` back this up: no code path can commit an
overcommitted GPU.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import and_, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import AllocationPart, ReservedEvent
from shared.ledger.models import LIVE_SQL, allocation_parts, allocations, gpus, part_from_row, part_row, quotas
from shared.ledger.quotas import lock_quota, namespace_usage
from shared.ledger.rules import LIVE_STATE_VALUES, AllocationState, gpu_charges


class ReservationError(Exception):
    """A reservation that cannot be made; the message says why in terms a person can act on."""


class InsufficientCapacity(ReservationError):
    """A GPU does not have the free memory or compute the pod needs (or is unhealthy / gone)."""

    def __init__(self, gpu_uuid: str, message: str) -> None:
        super().__init__(message)
        self.gpu_uuid = gpu_uuid


class QuotaExceeded(ReservationError):
    """The pod would take its namespace past its GPU quota."""


@dataclass(frozen=True)
class ReservationRequest:
    """What the extender decided: a pod, a node, and each container's share of each GPU."""

    pod_uid: str
    namespace: str
    pod_name: str
    node: str
    parts: tuple[AllocationPart, ...]
    owner_kind: str = ""
    owner_name: str = ""
    allocation_id: uuid.UUID = field(default_factory=uuid.uuid4)
    pod_created_at: datetime | None = None


@dataclass(frozen=True)
class Reservation:
    """A live allocation as the ledger holds it."""

    allocation_id: uuid.UUID
    pod_uid: str
    node: str
    state: AllocationState
    parts: tuple[AllocationPart, ...]
    created: bool


def reserved_event(req: ReservationRequest, *, source: str = "") -> ReservedEvent:
    """The event that records a reservation (its timestamp is the reservation's)."""
    return ReservedEvent(
        allocation_id=req.allocation_id,
        pod_uid=req.pod_uid,
        namespace=req.namespace,
        pod_name=req.pod_name,
        owner_kind=req.owner_kind,
        owner_name=req.owner_name,
        node=req.node,
        parts=list(req.parts),
        pod_created_at=req.pod_created_at,
        source=source,
    )


async def live_reservation(conn: AsyncConnection, pod_uid: str) -> Reservation | None:
    """The live allocation of a pod, if it has one."""
    row = (
        await conn.execute(
            select(allocations.c.id, allocations.c.node, allocations.c.state).where(
                and_(allocations.c.pod_uid == pod_uid, allocations.c.state.in_(LIVE_STATE_VALUES))
            )
        )
    ).first()
    if row is None:
        return None
    part_rows = (
        await conn.execute(
            select(allocation_parts)
            .where(allocation_parts.c.allocation_id == row.id)
            .order_by(allocation_parts.c.init.desc(), allocation_parts.c.container_index, allocation_parts.c.gpu_index)
        )
    ).all()
    parts = tuple(part_from_row(p) for p in part_rows)
    return Reservation(row.id, pod_uid, row.node, AllocationState(row.state), parts, created=False)


async def reserve(conn: AsyncConnection, event: ReservedEvent, *, check_quota: bool = True) -> Reservation:
    """Apply a reservation inside the caller's transaction (which must stage `event` and commit, and took the
    locks `locks.lock_for_reservations` names first).

    Returns the existing live allocation (created=False) when the pod already has one. Raises
    `InsufficientCapacity` or `QuotaExceeded`; the caller then rolls back, leaving nothing behind.
    `check_quota=False`: a DRA claim's allocation, whose quota was taken when the claim was created
    (`claim_holds`).
    """
    charges = gpu_charges(event.parts)
    total_memory = sum(m for m, _ in charges.values())
    total_compute = sum(c for _, c in charges.values())
    at: datetime = event.occurred_at

    inserted = await conn.execute(
        insert(allocations)
        .values(
            id=event.allocation_id,
            pod_uid=event.pod_uid,
            namespace=event.namespace,
            pod_name=event.pod_name,
            owner_kind=event.owner_kind,
            owner_name=event.owner_name,
            node=event.node,
            state=AllocationState.RESERVED.value,
            memory_mib=total_memory,
            compute=total_compute,
            reserved_at=at,
            pod_created_at=event.pod_created_at,
        )
        .on_conflict_do_nothing(index_elements=["pod_uid"], index_where=text(LIVE_SQL))
        .returning(allocations.c.id)
    )
    if inserted.first() is None:
        existing = await live_reservation(conn, event.pod_uid)
        if existing is not None:
            return existing
        raise ReservationError(f"pod {event.namespace}/{event.pod_name} changed while reserving; retry")

    if check_quota:
        await _check_quota(conn, event.namespace, total_memory, total_compute)

    for gpu_uuid, (memory, compute) in charges.items():
        done = await conn.execute(
            update(gpus)
            .where(
                and_(
                    gpus.c.uuid == gpu_uuid,
                    gpus.c.node == event.node,
                    gpus.c.healthy.is_(True),
                    gpus.c.retired_at.is_(None),
                    gpus.c.allocated_memory_mib + memory <= gpus.c.memory_mib,
                    gpus.c.allocated_compute + compute <= gpus.c.compute_units,
                )
            )
            .values(
                allocated_memory_mib=gpus.c.allocated_memory_mib + memory,
                allocated_compute=gpus.c.allocated_compute + compute,
                updated_at=at,
            )
            .returning(gpus.c.uuid)
        )
        if done.first() is None:
            raise InsufficientCapacity(gpu_uuid, await explain_refusal(conn, event.node, gpu_uuid, memory, compute))

    await conn.execute(insert(allocation_parts), [part_row(event.allocation_id, p) for p in event.parts])
    return Reservation(
        event.allocation_id, event.pod_uid, event.node, AllocationState.RESERVED, tuple(event.parts), created=True
    )


async def _check_quota(conn: AsyncConnection, namespace: str, memory: int, compute: int) -> None:
    read = select(quotas).where(quotas.c.namespace == namespace)
    quota = (await conn.execute(read)).first()
    if quota is None or (quota.memory_mib is None and quota.compute is None):
        return
    await lock_quota(conn, namespace)  # concurrent reservations in the namespace (and quota changes) wait here
    quota = (await conn.execute(read)).first()  # as it is now that nobody else can change it
    if quota is None or (quota.memory_mib is None and quota.compute is None):
        return
    usage = await namespace_usage(conn, namespace)  # includes this pod's row, and the claims waiting (`claim_holds`)
    waiting = f" (of which {usage.waiting_claims} DRA claim(s) not allocated yet)" if usage.waiting_claims else ""
    if quota.memory_mib is not None and usage.memory_mib > quota.memory_mib:
        raise QuotaExceeded(
            f"namespace {namespace} GPU memory quota {quota.memory_mib} MiB exceeded: "
            f"{usage.memory_mib - memory} MiB in use{waiting}, pod needs {memory} MiB"
        )
    if quota.compute is not None and usage.compute > quota.compute:
        raise QuotaExceeded(
            f"namespace {namespace} GPU compute quota {quota.compute}% exceeded: "
            f"{usage.compute - compute}% in use{waiting}, pod needs {compute}%"
        )


async def explain_refusal(conn: AsyncConnection, node: str, gpu_uuid: str, memory: int, compute: int) -> str:
    """Why a GPU refused a share, as a person reads it (removed, unhealthy, or how much is free)."""
    row = (await conn.execute(select(gpus).where(gpus.c.uuid == gpu_uuid))).first()
    if row is None or row.node != node:
        return f"GPU {gpu_uuid} is not on node {node}"
    if row.retired_at is not None:
        return f"GPU {row.index} ({gpu_uuid}) on {node} was removed"
    if not row.healthy:
        return f"GPU {row.index} ({gpu_uuid}) on {node} is unhealthy: {row.health_reason or 'no reason given'}"
    free_memory = row.memory_mib - row.allocated_memory_mib
    free_compute = row.compute_units - row.allocated_compute
    if free_memory < memory:
        return f"GPU {row.index} on {node} has {free_memory} MiB free, pod needs {memory} MiB"
    return f"GPU {row.index} on {node} has {free_compute}% compute free, pod needs {compute}%"
