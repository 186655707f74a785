"""Accounting's projections: fold every event into read models, exactly once per event.

The durable consumers "accounting" (the ledger stream) and "accounting-samples" (usage and refusals, from the
samples stream) feed `Projector.handle_many`, a batch per transaction. An event is applied once, whatever the
gap between its copies: each event's effect and its idempotency claim (`applied_events`, consumer "accounting")
commit in one transaction, and every effect is idempotent by itself too (timeline rows are unique per event
and allocation, a refusal only replaces an older one, a usage event whose samples are stored is skipped), so
a copy that arrives after its claim was pruned (`dedupe_horizon`) changes nothing either. Usage events are not
claimed: their samples carry the event id, and a claim row per sample interval per node would outgrow the
samples.
`rebuild_projections` refills the read models from what the streams still hold through the same `apply_many`.

Several accounting replicas share the two durable consumers, each batch going to one of them. Batches are applied
one at a time (a transaction-scoped advisory lock, `PROJECTION_LOCK`), so none reads the read models while
another's rows are uncommitted; the order in which the replicas commit does not matter, since every effect
depends on the events' times, not on when they are applied (an exchange applied before any step of its
allocation takes the allocation's pod from the ledger, where the allocation exists before any of its events).

A batch is applied in bulk (`apply_many`): its event ids are claimed in one statement, what its events ask of
the read models is read with one query per question, `projection_plan.plan` folds the events in order over
that (pure), and each table is written with one multi-row statement; the effects are those of applying the
events one by one, in order.

Read models: `acc_timeline` (each allocation's steps with timestamps), `acc_pending` (the latest refusal
per pod until it gets a reservation) and `usage_samples` (usage events, one row per sample). The ledger
tables stay authoritative for current state and are only read here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    DateTime,
    Select,
    Table,
    Text,
    any_,
    bindparam,
    column,
    delete,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, UUID, distinct_on
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.types import TypeEngine

from shared.events.bus import EventBus
from shared.events.catalogue import Event
from shared.ledger.models import allocations, applied_events
from shared.ledger.replay import read_events

from .projection_plan import ASSIGNED, BOUND, PROJECTED, RESERVED, Applied, Known, Plan, Reads, Row, claims, plan, reads
from .tables import CONSUMER, PROJECTION_TABLES, pending, timeline, usage_samples

__all__ = ["PROJECTED", "Applied", "Projector", "apply", "apply_many", "rebuild_projections", "truncate_projections"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
REBUILD_BATCH = 500
# Every projection transaction holds this transaction-scoped advisory lock: batches of the two consumers (ledger,
# samples) and of every accounting replica apply one after the other, never interleaved.
PROJECTION_LOCK = 0x6770_7573_6861_7265  # "gpushare"
TIMELINE_COLUMNS = ("event_id", "allocation_id", "pod_uid", "node", "step", "ts", "detail")
SAMPLE_COLUMNS = (
    "event_id",
    "ts",
    "node",
    "gpu_uuid",
    "pod_uid",
    "namespace",
    "pod_name",
    "container",
    "used_memory_mib",
    "utilization_pct",
    "sm_utilization_pct",
)


def _array(values: Sequence[object], item: TypeEngine[Any]) -> Any:
    """One array parameter: the statement's text stays the same whatever the batch's size (compiled once)."""
    return bindparam(None, list(values), type_=ARRAY(item))


def _any(values: Sequence[object], item: TypeEngine[Any]) -> Any:
    """`= ANY(:array)`."""
    return any_(_array(values, item))


def _rows(table: Table, columns: Sequence[str], rows: list[Row]) -> Select[Any]:
    """`SELECT unnest(:c1), unnest(:c2), ...`: `rows` as one array per column, for `INSERT ... SELECT`."""
    return select(*(func.unnest(_array([r[c] for r in rows], table.c[c].type)).label(c) for c in columns))


async def _claim(conn: AsyncConnection, event_ids: list[uuid.UUID], at: datetime | None) -> set[uuid.UUID]:
    """Record in one statement that the projections apply these events (`at`: when, the database's clock by
    default); returns the ids not claimed before, whose effects the caller then applies in the same
    transaction (claims commit or roll back with the effects: a crash in between leaves neither)."""
    ids = select(literal(CONSUMER).label("consumer"), func.unnest(_array(event_ids, UUID(as_uuid=True))))
    columns = ["consumer", "event_id"]
    if at is not None:
        ids = ids.add_columns(literal(at, DateTime(timezone=True)))
        columns.append("applied_at")
    result = await conn.execute(
        pg_insert(applied_events)
        .from_select(columns, ids)
        .on_conflict_do_nothing()
        .returning(applied_events.c.event_id)
    )
    return set(result.scalars())


async def _known(conn: AsyncConnection, wanted: Reads) -> Known:
    """Answer a batch's questions about the read models: one query per kind of question asked."""
    first_steps: dict[tuple[uuid.UUID, str], datetime] = {}
    earliest: dict[uuid.UUID, tuple[datetime, str]] = {}
    latest: dict[str, datetime] = {}
    stored: frozenset[uuid.UUID] = frozenset()
    if wanted.step_allocations:
        rows = await conn.execute(
            select(timeline.c.allocation_id, timeline.c.step, func.min(timeline.c.ts))
            .where(
                timeline.c.allocation_id == _any(wanted.step_allocations, UUID(as_uuid=True)),
                timeline.c.step == _any([RESERVED, BOUND, ASSIGNED], Text()),
            )
            .group_by(timeline.c.allocation_id, timeline.c.step)
        )
        first_steps = {(allocation_id, step): ts for allocation_id, step, ts in rows}
    if wanted.pod_allocations:
        rows = await conn.execute(
            select(timeline.c.allocation_id, timeline.c.ts, timeline.c.pod_uid)
            .where(timeline.c.allocation_id == _any(wanted.pod_allocations, UUID(as_uuid=True)))
            .ext(distinct_on(timeline.c.allocation_id))
            .order_by(timeline.c.allocation_id, timeline.c.ts, timeline.c.id)
        )
        earliest = {allocation_id: (ts, pod_uid) for allocation_id, ts, pod_uid in rows}
        unknown = [a for a in wanted.pod_allocations if a not in earliest]
        if unknown:  # no step applied yet (another replica holds its batch): the ledger knows the allocation's pod
            rows = await conn.execute(
                select(allocations.c.id, allocations.c.reserved_at, allocations.c.pod_uid).where(
                    allocations.c.id == _any(unknown, UUID(as_uuid=True))
                )
            )
            earliest |= {allocation_id: (ts, pod_uid) for allocation_id, ts, pod_uid in rows}
    if wanted.refused_pods:
        reserved = await conn.execute(
            select(timeline.c.pod_uid, func.max(timeline.c.ts))
            .where(timeline.c.pod_uid == _any(wanted.refused_pods, Text()), timeline.c.step == RESERVED)
            .group_by(timeline.c.pod_uid)
        )
        latest = {pod_uid: ts for pod_uid, ts in reserved}
    if wanted.usage_ids:
        rows = await conn.execute(
            select(usage_samples.c.event_id)
            .where(usage_samples.c.event_id == _any(wanted.usage_ids, UUID(as_uuid=True)))
            .distinct()
        )
        stored = frozenset(rows.scalars())
    return Known(first_steps, earliest, latest, stored)


async def _write(conn: AsyncConnection, planned: Plan) -> None:
    """A batch's rows: one statement per table (and kind of change), whatever the batch's size."""
    if planned.timeline_rows:
        rows = _rows(timeline, TIMELINE_COLUMNS, planned.timeline_rows)
        await conn.execute(pg_insert(timeline).from_select(TIMELINE_COLUMNS, rows).on_conflict_do_nothing())
    if planned.sample_rows:
        rows = _rows(usage_samples, SAMPLE_COLUMNS, planned.sample_rows)
        await conn.execute(insert(usage_samples).from_select(SAMPLE_COLUMNS, rows))
    deletes = planned.pending_deletes
    if deletes:
        gone = (
            func.unnest(
                _array([pod for pod, _ in deletes], Text()),
                _array([upto for _, upto in deletes], DateTime(timezone=True)),
            )
            .table_valued(column("pod_uid", Text()), column("upto", DateTime(timezone=True)))
            .render_derived(name="gone")
        )
        await conn.execute(
            delete(pending).where(pending.c.pod_uid == gone.c.pod_uid, pending.c.refused_at <= gone.c.upto)
        )
    if planned.pending_rows:  # one row per pod (executemany: the reasons are JSON)
        stmt = pg_insert(pending)
        upsert = stmt.on_conflict_do_update(
            index_elements=[pending.c.pod_uid],
            set_={
                "event_id": stmt.excluded.event_id,
                "namespace": stmt.excluded.namespace,
                "pod_name": stmt.excluded.pod_name,
                "summary": stmt.excluded.summary,
                "reasons": stmt.excluded.reasons,
                "refused_at": stmt.excluded.refused_at,
            },
            where=pending.c.refused_at <= stmt.excluded.refused_at,
        )
        await conn.execute(upsert, planned.pending_rows)


async def apply_many(conn: AsyncConnection, events: list[Event], *, at: datetime | None = None) -> list[Applied]:
    """Apply a batch of events to the read models inside the caller's transaction, with the same effects as
    applying them one by one in order (idempotent: copies and events applied before change nothing). `at` is
    when they are claimed (the database's clock by default). Returns what each event did, in order.

    Batches are applied one at a time across every consumer and replica (`PROJECTION_LOCK`): each reads what
    the batches before it wrote."""
    await conn.execute(select(func.pg_advisory_xact_lock(PROJECTION_LOCK)))
    ids = claims(events)
    claimed = await _claim(conn, ids, at) if ids else set()
    planned = plan(events, claimed, await _known(conn, reads(events, claimed)))
    await _write(conn, planned)
    return planned.results


async def apply(conn: AsyncConnection, event: Event, *, at: datetime | None = None) -> Applied:
    """Apply one event to the read models inside the caller's transaction (idempotent). `at` is when (the
    claim's time; the database's clock by default)."""
    return (await apply_many(conn, [event], at=at))[0]


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
            results = await apply_many(conn, events, at=at)
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
    """Whether `stream` still holds its first event (nothing aged out or was trimmed). An empty stream is complete
    only if it never had an event: once trimmed to nothing its first sequence is past the last one purged."""
    state = (await bus.js.stream_info(stream)).state
    return state.first_seq <= 1


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
        async with engine.begin() as conn:
            applied = sum(r.new for r in await apply_many(conn, batch))
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
