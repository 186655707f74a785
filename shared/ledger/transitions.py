"""Moving allocations through their life cycle, freeing GPU capacity exactly once at the end."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import and_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import AssignedEvent, BoundEvent, FailedEvent, ReleasedEvent
from shared.ledger.models import allocation_parts, allocations, gpus
from shared.ledger.rules import AllocationState, advances, gpu_charges, is_live

TransitionEvent = BoundEvent | AssignedEvent | ReleasedEvent | FailedEvent

_STATE_OF = {
    "bound": AllocationState.BOUND,
    "assigned": AllocationState.ASSIGNED,
    "released": AllocationState.RELEASED,
    "failed": AllocationState.FAILED,
}
_STAMP_OF = {"bound": "bound_at", "assigned": "assigned_at", "released": "ended_at", "failed": "ended_at"}


async def apply_transition(conn: AsyncConnection, event: TransitionEvent) -> bool:
    """Apply a life-cycle event inside the caller's transaction.

    The allocation row is locked; its timestamp for this step is recorded if not yet set; the state
    moves only forward; leaving a live state gives the GPU capacity back. Returns True when the state
    changed. An unknown allocation is a no-op (returns False).
    """
    row = (
        await conn.execute(
            select(allocations.c.state, getattr(allocations.c, _STAMP_OF[event.kind]).label("stamp"))
            .where(allocations.c.id == event.allocation_id)
            .with_for_update()
        )
    ).first()
    if row is None:
        return False
    new_state = _STATE_OF[event.kind]
    values: dict[str, object] = {}
    if row.stamp is None:
        values[_STAMP_OF[event.kind]] = event.occurred_at
    changed = advances(row.state, new_state)
    if changed:
        values["state"] = new_state.value
        if isinstance(event, ReleasedEvent | FailedEvent):
            values["reason"] = event.reason
        if is_live(row.state) and not is_live(new_state):
            await _give_back(conn, event.allocation_id, event.occurred_at)
    if isinstance(event, AssignedEvent):
        await conn.execute(
            update(allocation_parts)
            .where(
                and_(
                    allocation_parts.c.allocation_id == event.allocation_id,
                    allocation_parts.c.container == event.container,
                    allocation_parts.c.assigned_at.is_(None),
                )
            )
            .values(assigned_at=event.occurred_at)
        )
    if values:
        await conn.execute(update(allocations).where(allocations.c.id == event.allocation_id).values(**values))
    return changed


async def _give_back(conn: AsyncConnection, allocation_id: uuid.UUID, at: datetime) -> None:
    parts = (
        await conn.execute(select(allocation_parts).where(allocation_parts.c.allocation_id == allocation_id))
    ).all()
    for gpu_uuid, (memory, compute) in gpu_charges(parts).items():
        await conn.execute(
            update(gpus)
            .where(gpus.c.uuid == gpu_uuid)
            .values(
                allocated_memory_mib=gpus.c.allocated_memory_mib - memory,
                allocated_compute=gpus.c.allocated_compute - compute,
                updated_at=at,
            )
        )


async def live_allocation_ids(conn: AsyncConnection, *, node: str | None = None, pod_uid: str | None = None) -> list:
    """Ids (with pod UID and node) of live allocations, optionally on one node or of one pod."""
    query = select(allocations.c.id, allocations.c.pod_uid, allocations.c.node).where(
        allocations.c.state.in_(("reserved", "bound", "assigned"))
    )
    if node is not None:
        query = query.where(allocations.c.node == node)
    if pod_uid is not None:
        query = query.where(allocations.c.pod_uid == pod_uid)
    return list((await conn.execute(query)).all())
