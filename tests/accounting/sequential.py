"""The projections' one-by-one path as it was before batches were applied in bulk (issue 18), kept verbatim
as the reference the bulk path is compared with (`test_bulk_projections.py`): one event at a time, a claim
and a few statements each, every read seeing the rows of the events before it."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import delete, insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from services.accounting.projections import PROJECTED, Applied
from services.accounting.tables import CONSUMER, pending, timeline, usage_samples
from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
    ClaimReservedEvent,
    Event,
    ExchangedEvent,
    FailedEvent,
    RefusedEvent,
    ReleasedEvent,
    ReservedEvent,
    TerminatingEvent,
    UsageEvent,
)
from shared.ledger.idempotency import claim
from shared.ledger.rules import AllocationState


async def _first_step(
    conn: AsyncConnection, allocation_id: uuid.UUID, step: str = AllocationState.RESERVED.value
) -> datetime | None:
    """When the allocation's timeline first reached `step` (a life-cycle event's kind)."""
    return (
        await conn.execute(
            select(timeline.c.ts)
            .where(timeline.c.allocation_id == allocation_id, timeline.c.step == step)
            .order_by(timeline.c.ts)
            .limit(1)
        )
    ).scalar()


async def _step(
    conn: AsyncConnection, event: Event, allocation_id: uuid.UUID, pod_uid: str, node: str, detail: str = ""
) -> None:
    """A timeline row: the step is the event's kind (any reservation, a DRA claim's too, is `reserved`)."""
    await conn.execute(
        pg_insert(timeline)
        .values(
            event_id=event.event_id,
            allocation_id=allocation_id,
            pod_uid=pod_uid,
            node=node,
            step=AllocationState.RESERVED.value if isinstance(event, ReservedEvent) else event.kind,
            ts=event.occurred_at,
            detail=detail[:2048],
        )
        .on_conflict_do_nothing()
    )


async def apply(conn: AsyncConnection, event: Event, *, at: datetime | None = None) -> Applied:
    """Apply one event to the read models inside the caller's transaction (idempotent). `at` is when (the
    claim's time; the database's clock by default)."""
    if not isinstance(event, PROJECTED):
        return Applied(new=False)
    if isinstance(event, UsageEvent):
        return Applied(new=await _usage(conn, event))
    if not await claim(conn, CONSUMER, event.event_id, at=at):
        return Applied(new=False)
    out = Applied(new=True)
    match event:
        case ReservedEvent():
            detail = f"claim {event.claim_name}" if isinstance(event, ClaimReservedEvent) else ""
            await _step(conn, event, event.allocation_id, event.pod_uid, event.node, detail)
            await conn.execute(
                delete(pending).where(pending.c.pod_uid == event.pod_uid, pending.c.refused_at <= event.occurred_at)
            )
        case BoundEvent():
            await _step(conn, event, event.allocation_id, event.pod_uid, event.node)
            reserved = await _first_step(conn, event.allocation_id)
            if reserved is not None:
                out.latencies.append(("reserved_to_bound", (event.occurred_at - reserved).total_seconds()))
        case AssignedEvent():
            first = await _first_step(conn, event.allocation_id, event.kind)
            await _step(
                conn,
                event,
                event.allocation_id,
                event.pod_uid,
                event.node,
                f"container {event.container}: {', '.join(event.gpu_uuids)}",
            )
            bound = await _first_step(conn, event.allocation_id, AllocationState.BOUND.value)
            if first is None and bound is not None:
                out.latencies.append(("bound_to_assigned", (event.occurred_at - bound).total_seconds()))
        case TerminatingEvent():
            detail = "pod is being deleted; its share stays held until the pod is gone"
            await _step(conn, event, event.allocation_id, event.pod_uid, event.node, detail)
        case ReleasedEvent() | FailedEvent():
            await _step(conn, event, event.allocation_id, event.pod_uid, event.node, event.reason)
        case ExchangedEvent():
            pairs = (
                (event.first_allocation_id, event.first_container, event.second_allocation_id, event.second_container),
                (event.second_allocation_id, event.second_container, event.first_allocation_id, event.first_container),
            )
            for mine, my_container, other, other_container in pairs:
                pod_uid = (
                    await conn.execute(select(timeline.c.pod_uid).where(timeline.c.allocation_id == mine).limit(1))
                ).scalar() or ""
                detail = f"container {my_container} swapped shares with allocation {other} container {other_container}"
                await _step(conn, event, mine, pod_uid, event.node, detail)
        case RefusedEvent():
            await _refused(conn, event)
    return out


async def _usage(conn: AsyncConnection, event: UsageEvent) -> bool:
    """Store a usage event's samples unless they are stored already; True when stored."""
    if not event.samples:
        return False
    known = (
        await conn.execute(select(usage_samples.c.id).where(usage_samples.c.event_id == event.event_id).limit(1))
    ).first()
    if known is not None:
        return False
    await conn.execute(
        insert(usage_samples),
        [
            {
                "event_id": event.event_id,
                "ts": event.occurred_at,
                "node": event.node,
                "gpu_uuid": s.gpu_uuid,
                "pod_uid": s.pod_uid,
                "namespace": s.namespace,
                "pod_name": s.pod_name,
                "container": s.container,
                "used_memory_mib": s.used_memory_mib,
                "utilization_pct": s.utilization_pct,
            }
            for s in event.samples
        ],
    )
    return True


async def _refused(conn: AsyncConnection, event: RefusedEvent) -> None:
    later_reservation = (
        await conn.execute(
            select(timeline.c.id)
            .where(
                timeline.c.pod_uid == event.pod_uid,
                timeline.c.step == AllocationState.RESERVED.value,
                timeline.c.ts >= event.occurred_at,
            )
            .limit(1)
        )
    ).first()
    if later_reservation is not None:
        return
    values = {
        "pod_uid": event.pod_uid,
        "event_id": event.event_id,
        "namespace": event.namespace,
        "pod_name": event.pod_name,
        "summary": event.summary,
        "reasons": dict(event.reasons),
        "refused_at": event.occurred_at,
    }
    stmt = pg_insert(pending).values(**values)
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[pending.c.pod_uid],
            set_={k: stmt.excluded[k] for k in values if k != "pod_uid"},
            where=pending.c.refused_at <= stmt.excluded.refused_at,
        )
    )
