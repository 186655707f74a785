"""Accounting's projections: fold every event into read models, exactly once per event.

The durable consumers "accounting" (the ledger stream) and "accounting-samples" (usage and refusals, from the
samples stream) feed `Projector.handle`. An event is applied once, whatever the gap between its copies: each
event's effect and its idempotency claim (`applied_events`, consumer "accounting") commit in one transaction,
and every effect is idempotent by itself too (timeline rows are unique per event and allocation, a refusal
only replaces an older one, a usage event whose samples are stored is skipped), so a copy that arrives after
its claim was pruned (`dedupe_horizon`) changes nothing either. Usage events are not claimed: their samples
carry the event id, and a claim row per sample interval per node would outgrow the samples.
`rebuild_projections` refills the read models from what the streams still hold through the same `apply`.

Read models: `acc_timeline` (each allocation's steps with timestamps), `acc_pending` (the latest refusal
per pod until it gets a reservation) and `usage_samples` (usage events, one row per sample). The ledger
tables stay authoritative for current state and are only read here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Table, delete, insert, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.events.bus import EventBus
from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
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
from shared.ledger.models import applied_events
from shared.ledger.replay import read_events
from shared.ledger.rules import AllocationState

from .tables import CONSUMER, PROJECTION_TABLES, pending, timeline, usage_samples

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
PROJECTED = (
    ReservedEvent,
    BoundEvent,
    AssignedEvent,
    ExchangedEvent,
    TerminatingEvent,
    ReleasedEvent,
    FailedEvent,
    UsageEvent,
    RefusedEvent,
)  # the events that change the read models
REBUILD_BATCH = 500


@dataclass
class Applied:
    """What applying one event did: whether it was new, and life-cycle latencies it completed."""

    new: bool
    latencies: list[tuple[str, float]] = field(default_factory=list)


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
    """A timeline row: the step is the event's kind."""
    await conn.execute(
        pg_insert(timeline)
        .values(
            event_id=event.event_id,
            allocation_id=allocation_id,
            pod_uid=pod_uid,
            node=node,
            step=event.kind,
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
            await _step(conn, event, event.allocation_id, event.pod_uid, event.node)
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


class Projector:
    """The consumer's handler: applies an event in its own transaction, then reports latencies."""

    def __init__(
        self,
        engine: AsyncEngine,
        on_latency: Callable[[str, float], None] | None = None,
        *,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.engine = engine
        self.on_latency = on_latency
        self.clock = clock  # when claims are made (None: the database's clock); tests run a compressed clock
        self.applied = 0

    async def handle(self, event: Event) -> bool:
        """Apply one event (the DurableConsumer acks after this returns); True when it changed something."""
        return await self.handle_many([event]) == 1

    async def handle_many(self, events: list[Event]) -> int:
        """Apply several events in one transaction (all or none); returns how many changed something."""
        at = self.clock() if self.clock is not None else None
        async with self.engine.begin() as conn:
            results = [await apply(conn, event, at=at) for event in events]
        new = [r for r in results if r.new]
        self.applied += len(new)
        if self.on_latency is not None:
            for result in new:
                for name, seconds in result.latencies:
                    self.on_latency(name, max(seconds, 0.0))
        return len(new)


async def truncate_projections(conn: AsyncConnection, tables: tuple[Table, ...] = PROJECTION_TABLES) -> None:
    """Empty read models and forget which events the projections applied."""
    if tables:
        await conn.execute(text(f"TRUNCATE {', '.join(t.name for t in tables)} RESTART IDENTITY"))
    await conn.execute(delete(applied_events).where(applied_events.c.consumer == CONSUMER))


async def _complete(bus: EventBus, stream: str) -> bool:
    """Whether `stream` still holds its first event (nothing aged out or was trimmed)."""
    state = (await bus.js.stream_info(stream)).state
    return state.messages == 0 or state.first_seq <= 1


async def rebuild_projections(engine: AsyncEngine, bus: EventBus, progress: Progress | None = None) -> int:
    """Refill the read models from the ledger stream and the samples stream; returns how many events applied.

    A read model is emptied first when its stream still holds everything (a full rebuild). Once the snapshot
    job trimmed the ledger stream, or samples aged out, the rows derived from what is gone are kept, and what
    the streams hold is applied over them (every effect is idempotent, so rows that exist stay as they are).
    """
    names = bus.names
    emptied: list[Table] = []
    if await _complete(bus, names.stream):
        emptied.append(timeline)
    if await _complete(bus, names.samples_stream):
        emptied += [pending, usage_samples]
    async with engine.begin() as conn:
        await truncate_projections(conn, tuple(emptied))
    kept = [t.name for t in PROJECTION_TABLES if t not in emptied]
    if kept:
        log.info("the streams no longer hold their first events: keeping the rows of %s", ", ".join(kept))
    count = 0
    batch: list[Event] = []

    async def flush() -> int:
        applied = 0
        async with engine.begin() as conn:
            for ev in batch:
                applied += int((await apply(conn, ev)).new)
        batch.clear()
        return applied

    for stream in (names.stream, names.samples_stream):
        async for event in read_events(bus, stream=stream, progress=progress):
            batch.append(event)
            if len(batch) >= REBUILD_BATCH:
                count += await flush()
    if batch:
        count += await flush()
    log.info("accounting projections rebuilt from %d events", count)
    return count
