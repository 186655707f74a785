"""Moving allocations through their life cycle, freeing GPU capacity exactly once at the end."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
    ExchangedEvent,
    FailedEvent,
    PartMove,
    ReleasedEvent,
    TerminatingEvent,
)
from shared.ledger import driver, locks
from shared.ledger.models import allocation_parts, allocations, gpus, part_from_row
from shared.ledger.rules import (
    LIVE_STATE_VALUES,
    STAMPS,
    AllocationState,
    ExchangeRefused,
    advances,
    exchange_plan,
    gpu_charges,
    is_live,
)

TransitionEvent = BoundEvent | AssignedEvent | ReleasedEvent | FailedEvent


async def apply_transition(conn: AsyncConnection, event: TransitionEvent) -> bool:
    """Apply a life-cycle event inside the caller's transaction.

    The allocation row is locked; its timestamp for this step is recorded if not yet set; the state
    moves only forward; leaving a live state gives the GPU capacity back. Returns True when the state
    changed. An unknown allocation is a no-op (returns False). An event that may end the allocation locks
    its GPUs before its row (the ledger's lock order, `locks`).
    """
    return (await transition(conn, event)).changed


@dataclass(frozen=True)
class Transition:
    """What a life-cycle event did: `changed` the allocation's state, `wrote` anything at all (a state, a
    timestamp, a container's assignment). An event that wrote nothing is one the ledger had already applied, or
    one for an allocation it does not hold: a replay without it ends in the same tables."""

    changed: bool
    wrote: bool


async def transition(conn: AsyncConnection, event: TransitionEvent) -> Transition:
    """`apply_transition`, saying whether the event wrote anything."""
    new_state = AllocationState(event.kind)  # a life-cycle event's kind names the state it moves to
    if not is_live(new_state):
        await locks.lock_gpus_of(conn, [event.allocation_id])
    return await _apply(conn, event, await _locked_row(conn, event.allocation_id, STAMPS[new_state]))


async def end_allocation(
    conn: AsyncConnection, while_reserved: FailedEvent, otherwise: ReleasedEvent
) -> tuple[Transition, FailedEvent | ReleasedEvent]:
    """End one allocation from whichever live state it is in, without a read before: `while_reserved` (`failed`)
    when it is still reserved (its pod never bound), else `otherwise` (`released`). Locks and writes as
    `transition` does (both end states share one stamp); returns what it did and which of the two events applies
    (the one to stage). Both events name the same allocation."""
    assert while_reserved.allocation_id == otherwise.allocation_id
    await locks.lock_gpus_of(conn, [otherwise.allocation_id])
    row = await _locked_row(conn, otherwise.allocation_id, STAMPS[AllocationState.RELEASED])
    event = while_reserved if row is not None and row.state == AllocationState.RESERVED.value else otherwise
    return await _apply(conn, event, row), event


async def _locked_row(conn: AsyncConnection, allocation_id: uuid.UUID, stamp: str) -> Any:
    """The allocation's state and the step's stamp (`stamp`), its row locked for the transaction (None: unknown)."""
    query = (
        select(allocations.c.state, getattr(allocations.c, stamp).label("stamp"))
        .where(allocations.c.id == allocation_id)
        .with_for_update()
    )
    return (await conn.execute(query)).first()


async def _apply(conn: AsyncConnection, event: TransitionEvent, row: Any) -> Transition:
    """Apply `event` to the allocation whose locked `row` (`_locked_row`) was read (None: unknown, a no-op)."""
    new_state = AllocationState(event.kind)
    stamp = STAMPS[new_state]
    if row is None:
        return Transition(changed=False, wrote=False)
    values: dict[str, object] = {}
    if row.stamp is None:
        values[stamp] = event.occurred_at
    changed = advances(row.state, new_state)
    if changed:
        values["state"] = new_state.value
        if isinstance(event, ReleasedEvent | FailedEvent):
            values["reason"] = event.reason
        if is_live(row.state) and not is_live(new_state):
            await _give_back(conn, event.allocation_id, event.occurred_at)
    wrote = bool(values)
    if isinstance(event, AssignedEvent):
        parts = await conn.execute(
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
        wrote = wrote or bool(parts.rowcount)
    if values:
        await conn.execute(update(allocations).where(allocations.c.id == event.allocation_id).values(**values))
    return Transition(changed=changed, wrote=wrote)


# on asyncpg directly (`driver`): it runs for every batch of bindings
_BIND_MANY = (
    "WITH old AS (SELECT id, state FROM allocations WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE) "
    "UPDATE allocations AS a SET state = CASE WHEN old.state = $3 THEN $4 ELSE a.state END,"
    " bound_at = COALESCE(a.bound_at, u.at) "
    "FROM old, unnest($1::uuid[], $2::timestamptz[]) AS u(id, at) "
    "WHERE a.id = old.id AND a.id = u.id AND (old.state = $3 OR a.bound_at IS NULL) "
    "RETURNING a.id, old.state"
)


async def apply_bound_many(conn: AsyncConnection, events: list[BoundEvent]) -> list[bool]:
    """`apply_transition` for many `bound` events in one statement (the binder's group commit): each row is
    locked (in id order), stamped `bound_at` if not yet, and moved to `bound` only from `reserved` (the only state
    `bound` advances; binding gives no capacity back). True per event whose allocation changed state; an unknown
    allocation, or the same allocation named again in the batch, is a no-op (False)."""
    return (await bind_many(conn, events))[0]


async def bind_many(conn: AsyncConnection, events: list[BoundEvent]) -> tuple[list[bool], list[bool]]:
    """`apply_bound_many`, answering per event (whether its allocation changed state, whether its row was written
    at all: a `bound_at` stamped on an allocation already past `bound` changes no state but is a change a replay
    must see)."""
    if not events:
        return [], []
    # one stamp per allocation, the first event's: with an id twice in the UPDATE's FROM, PostgreSQL would take
    # either row's time, and the row could disagree with the one event staged (a replay would stamp another time)
    first = {e.allocation_id: e.occurred_at for e in reversed(events)}
    rows = await driver.fetch(
        conn,
        _BIND_MANY,
        list(first),
        list(first.values()),
        AllocationState.RESERVED.value,
        AllocationState.BOUND.value,
    )
    moved = {r["id"] for r in rows if advances(r["state"], AllocationState.BOUND)}
    written = {r["id"] for r in rows}
    changed, wrote = [], []
    for event in events:
        changed.append(event.allocation_id in moved)
        wrote.append(event.allocation_id in written)
        moved.discard(event.allocation_id)
        written.discard(event.allocation_id)
    return changed, wrote


# on asyncpg directly (`driver`): the node agents' `assigned` commands, a group commit of them per transaction
_LOCK_FOR_ASSIGN = "SELECT id, node, state FROM allocations WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE"
_ASSIGN = (
    "UPDATE allocations AS a SET state = CASE WHEN a.state = ANY($3::text[]) THEN $4 ELSE a.state END,"
    " assigned_at = COALESCE(a.assigned_at, u.at) "
    "FROM unnest($1::uuid[], $2::timestamptz[]) AS u(id, at) WHERE a.id = u.id"
)
_ASSIGN_PARTS = (
    "UPDATE allocation_parts AS p SET assigned_at = u.at "
    "FROM unnest($1::uuid[], $2::text[], $3::timestamptz[]) AS u(id, container, at) "
    "WHERE p.allocation_id = u.id AND p.container = u.container AND p.assigned_at IS NULL"
)
_BEFORE_ASSIGNED = [s.value for s in AllocationState if advances(s, AllocationState.ASSIGNED)]


async def assign_many(conn: AsyncConnection, events: list[AssignedEvent]) -> list[str | None]:
    """`assigned` events of node agents in three statements, inside the caller's transaction: each named allocation
    is locked (in id order) and must exist and live on the event's node; then, as `apply_transition` does one by
    one, its `assigned_at` is stamped if not yet (the batch's first event of it), its state moves to `assigned`
    when that is forward, and each container's parts are stamped. None per applied event, else why it was
    refused (nothing of it is written)."""
    if not events:
        return []
    rows = {r["id"]: r for r in await driver.fetch(conn, _LOCK_FOR_ASSIGN, list({e.allocation_id for e in events}))}
    answers: list[str | None] = []
    firsts: dict[uuid.UUID, datetime] = {}
    containers: dict[tuple[uuid.UUID, str], datetime] = {}
    for e in events:
        row = rows.get(e.allocation_id)
        if row is None:
            answers.append(f"the ledger has no allocation {e.allocation_id}")
        elif row["node"] != e.node or not is_live(row["state"]):
            answers.append(f"allocation {e.allocation_id} is {row['state']} on {row['node']}")
        else:
            answers.append(None)
            firsts.setdefault(e.allocation_id, e.occurred_at)
            containers.setdefault((e.allocation_id, e.container), e.occurred_at)
    if firsts:
        await driver.fetch(
            conn, _ASSIGN, list(firsts), list(firsts.values()), _BEFORE_ASSIGNED, AllocationState.ASSIGNED.value
        )
        await driver.fetch(
            conn,
            _ASSIGN_PARTS,
            [a for a, _ in containers],
            [c for _, c in containers],
            list(containers.values()),
        )
    return answers


async def apply_terminating(conn: AsyncConnection, event: TerminatingEvent) -> bool:
    """Record when an allocation's pod began terminating (the first time only); True when recorded.

    The share stays held: a terminating pod's containers may still use the GPU. Only a stamp, so it applies
    whatever the state, and a replay that meets it after the release ends with the same row.
    """
    result = await conn.execute(
        update(allocations)
        .where(and_(allocations.c.id == event.allocation_id, allocations.c.terminating_at.is_(None)))
        .values(terminating_at=event.occurred_at)
    )
    return bool(result.rowcount)


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
    """Ids (with pod UID, node and `terminating_at`) of live allocations, optionally on one node or of one pod."""
    query = select(allocations.c.id, allocations.c.pod_uid, allocations.c.node, allocations.c.terminating_at).where(
        allocations.c.state.in_(LIVE_STATE_VALUES)
    )
    if node is not None:
        query = query.where(allocations.c.node == node)
    if pod_uid is not None:
        query = query.where(allocations.c.pod_uid == pod_uid)
    return list((await conn.execute(query)).all())


async def apply_exchange(conn: AsyncConnection, event: ExchangedEvent) -> ExchangedEvent:
    """Swap two live containers' equal-sized shares (see `ExchangedEvent`); returns the event with its result
    (every part's move and both allocations' new versions), which is what the outbox must carry.

    Raises `ExchangeRefused` (the caller rolls back) when the shares differ, a container would exchange with
    itself, or either allocation is not live on the event's node.
    """
    if (event.first_allocation_id, event.first_container) == (event.second_allocation_id, event.second_container):
        raise ExchangeRefused("a container cannot exchange its share with itself")
    ids = sorted({event.first_allocation_id, event.second_allocation_id}, key=str)
    await locks.lock_gpus_of(conn, ids)  # GPUs before allocation rows (`locks`): the two give back and charge
    rows = {
        r.id: r
        for r in (
            await conn.execute(
                select(allocations.c.id, allocations.c.state, allocations.c.node)
                .where(allocations.c.id.in_(ids))
                .order_by(allocations.c.id)
                .with_for_update()
            )
        ).all()
    }
    if len(rows) != len(ids) or any(not is_live(r.state) or r.node != event.node for r in rows.values()):
        raise ExchangeRefused("both allocations must be live on the event's node")
    parts = (await conn.execute(select(allocation_parts).where(allocation_parts.c.allocation_id.in_(ids)))).all()
    first = [p for p in parts if p.allocation_id == event.first_allocation_id and p.container == event.first_container]
    second = [
        p for p in parts if p.allocation_id == event.second_allocation_id and p.container == event.second_container
    ]
    plan = exchange_plan(first, second)
    by_alloc = {i: [p for p in parts if p.allocation_id == i] for i in ids}
    for i in ids:
        await _give_back(conn, i, event.occurred_at)
    # move the first container's parts out of the way, then write both sides
    for part, new_uuid, new_index, old_uuid, _ in plan:
        await conn.execute(
            update(allocation_parts)
            .where(
                and_(
                    allocation_parts.c.allocation_id == part.allocation_id,
                    allocation_parts.c.container_index == part.container_index,
                    allocation_parts.c.init == part.init,
                    allocation_parts.c.gpu_uuid == old_uuid,
                )
            )
            .values(gpu_uuid=f"~{new_uuid}", gpu_index=new_index)
        )
    await conn.execute(
        update(allocation_parts)
        .where(and_(allocation_parts.c.allocation_id.in_(ids), allocation_parts.c.gpu_uuid.like("~%")))
        .values(gpu_uuid=func.substr(allocation_parts.c.gpu_uuid, 2))
    )
    for i in ids:
        moved = [part_from_row(p) for p in by_alloc[i] if not any(p is q for q, *_ in plan)] + [
            part_from_row(q).model_copy(update={"gpu_uuid": new_uuid})
            for q, new_uuid, *_ in plan
            if q.allocation_id == i
        ]
        for gpu_uuid, (memory, compute) in gpu_charges(moved).items():
            done = await conn.execute(
                update(gpus)
                .where(
                    and_(
                        gpus.c.uuid == gpu_uuid,
                        gpus.c.allocated_memory_mib + memory <= gpus.c.memory_mib,
                        gpus.c.allocated_compute + compute <= gpus.c.compute_units,
                    )
                )
                .values(
                    allocated_memory_mib=gpus.c.allocated_memory_mib + memory,
                    allocated_compute=gpus.c.allocated_compute + compute,
                )
                .returning(gpus.c.uuid)
            )
            if done.first() is None:
                raise ExchangeRefused(f"swapping would overcommit GPU {gpu_uuid}")
    versions = {
        str(i): int(
            (
                await conn.execute(
                    update(allocations)
                    .where(allocations.c.id == i)
                    .values(version=allocations.c.version + 1)
                    .returning(allocations.c.version)
                )
            ).scalar_one()
        )
        for i in ids
    }
    moves = [
        PartMove(
            allocation_id=part.allocation_id,
            container=part.container,
            from_gpu_uuid=old_uuid,
            to_gpu_uuid=new_uuid,
            to_gpu_index=new_index,
        )
        for part, new_uuid, new_index, old_uuid, _ in plan
    ]
    return event.model_copy(update={"moves": moves, "versions": versions})
