"""What the binder reads from the ledger (writes go through `shared.ledger.ledger.Ledger`)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import Select, Text, and_, any_, bindparam, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.agent_rpc import ContainerRecord, NodeSnapshot, ShareRecord
from shared.events.catalogue import AllocationPart
from shared.ledger import driver
from shared.ledger.db import reading
from shared.ledger.models import allocation_parts, allocations, gpus, nodes, part_from_row
from shared.ledger.rules import LIVE_STATE_VALUES, AllocationState


@dataclass(frozen=True)
class LiveAllocation:
    """A live allocation as reconciliation needs it."""

    id: uuid.UUID
    pod_uid: str
    namespace: str
    pod_name: str
    node: str
    state: str
    reserved_at: datetime
    terminating_at: datetime | None = None
    version: int = 1
    claim_uid: str | None = None  # a DRA allocation's claim (its gate reconciles it: services/binder/claims.py)


async def allocation_state(engine: AsyncEngine, allocation_id: uuid.UUID) -> str | None:
    """The allocation's current state, or None when the ledger has no such allocation."""
    async with reading(engine) as conn:
        return (await conn.execute(select(allocations.c.state).where(allocations.c.id == allocation_id))).scalar()


@dataclass(frozen=True)
class BindFacts:
    """What binding one allocation needs from the ledger, read in one query."""

    state: str | None  # None: the ledger has no such allocation
    gpu_memory: dict[str, int]  # schedulable MiB of each GPU asked about that the ledger knows


async def bind_facts_many(engine: AsyncEngine, asks: list[tuple[uuid.UUID, list[str]]]) -> list[BindFacts]:
    """`bind_facts` for many (allocation id, GPU UUIDs) in two statements on one connection (the binder reads
    them for the reservations it handles together, as it commits their `bound` writes together)."""
    ids = [a for a, _ in asks]
    uuids = sorted({u for _, us in asks for u in us})
    async with reading(engine) as conn:  # on asyncpg directly: it runs for every batch of bindings
        states = {r["id"]: r["state"] for r in await driver.fetch(conn, _STATES, ids)}
        memory = {r["uuid"]: int(r["memory_mib"]) for r in await driver.fetch(conn, _MEMORY, uuids)} if uuids else {}
    out = []
    for allocation_id, wanted in asks:
        state = states.get(allocation_id)
        out.append(BindFacts(state, {u: memory[u] for u in wanted if u in memory} if state is not None else {}))
    return out


_STATES = "SELECT id, state FROM allocations WHERE id = ANY($1::uuid[])"
_MEMORY = "SELECT uuid, memory_mib FROM gpus WHERE uuid = ANY($1::text[])"


@cache
def _memory_of() -> Select:
    """Schedulable memory of each GPU in `:uuids` (`= ANY(array)`: an IN list would be re-rendered for every
    length)."""
    return select(gpus.c.uuid, gpus.c.memory_mib).where(gpus.c.uuid == any_(bindparam("uuids", type_=ARRAY(Text))))


async def allocation_exists(engine: AsyncEngine, allocation_id: uuid.UUID) -> bool:
    """True when an allocation with this id exists in any state."""
    return await allocation_state(engine, allocation_id) is not None


async def gpu_memory(engine: AsyncEngine, uuids: list[str]) -> dict[str, int]:
    """Schedulable memory (MiB) of each GPU named."""
    async with reading(engine) as conn:
        rows = (await conn.execute(_memory_of(), {"uuids": list(uuids)})).all()
    return {r.uuid: int(r.memory_mib) for r in rows}


async def gpus_by_index(engine: AsyncEngine, node: str) -> dict[int, tuple[str, int]]:
    """The node's current (not retired) GPUs: index -> (UUID, schedulable MiB)."""
    async with reading(engine) as conn:
        rows = (
            await conn.execute(
                select(gpus.c.uuid, gpus.c.index, gpus.c.memory_mib).where(
                    and_(gpus.c.node == node, gpus.c.retired_at.is_(None))
                )
            )
        ).all()
    return {int(r.index): (r.uuid, int(r.memory_mib)) for r in rows}


async def live_allocations(engine: AsyncEngine) -> list[LiveAllocation]:
    """Every live allocation."""
    async with reading(engine) as conn:
        rows = (
            await conn.execute(
                select(
                    allocations.c.id,
                    allocations.c.pod_uid,
                    allocations.c.namespace,
                    allocations.c.pod_name,
                    allocations.c.node,
                    allocations.c.state,
                    allocations.c.reserved_at,
                    allocations.c.terminating_at,
                    allocations.c.version,
                    allocations.c.claim_uid,
                ).where(allocations.c.state.in_(LIVE_STATE_VALUES))
            )
        ).all()
    return [LiveAllocation(*r) for r in rows]


async def active_node(engine: AsyncEngine, name: str) -> bool:
    """True when the ledger knows the node and has not retired it."""
    async with reading(engine) as conn:
        row = (
            await conn.execute(select(nodes.c.name).where(and_(nodes.c.name == name, nodes.c.retired_at.is_(None))))
        ).first()
    return row is not None


def container_order(part: Any) -> tuple[bool, int, int]:
    """The order of a record's parts (a part or an `allocation_parts` row): init containers first, then by
    container and GPU index (pure)."""
    return (not part.init, part.container_index, part.gpu_index)


async def _part_rows(conn: Any, allocation_id: uuid.UUID) -> list[Any]:
    """The `allocation_parts` rows of one allocation, in container order."""
    query = select(allocation_parts).where(allocation_parts.c.allocation_id == allocation_id)
    return sorted((await conn.execute(query)).all(), key=container_order)


async def reservation_parts(engine: AsyncEngine, allocation_id: uuid.UUID) -> list[AllocationPart]:
    """The parts of one allocation, in container order."""
    async with reading(engine) as conn:
        rows = await _part_rows(conn, allocation_id)
    return [part_from_row(r) for r in rows]


@dataclass(frozen=True)
class PodRecord:
    """An allocation as its pod's annotations describe it."""

    allocation_id: uuid.UUID
    pod_uid: str
    namespace: str
    pod_name: str
    node: str
    state: str
    version: int
    parts: list[AllocationPart]
    assigned: bool  # a container has been handed its GPU
    gpu_memory: dict[str, int]  # schedulable MiB of the allocation's GPUs
    claim_uid: str | None = None  # the DRA claim it was recorded from (None: the device-plugin path)

    def assigned_now(self) -> PodRecord:
        """The same record once a container was handed its GPU (the `assigned` event's news)."""
        return replace(self, state=AllocationState.ASSIGNED.value, assigned=True)


def claim_record(
    allocation_id: uuid.UUID,
    *,
    pod_uid: str,
    namespace: str,
    pod_name: str,
    node: str,
    parts: Sequence[AllocationPart],
    gpu_memory: dict[str, int],
    claim_uid: str,
) -> PodRecord:
    """A claim allocation's record as `pod_record` reads it right after the claim was recorded (pure): reserved,
    version 1 (a claim's record is never exchanged), its parts in container order, the memory of its GPUs."""
    ordered = sorted(parts, key=container_order)
    uuids = {p.gpu_uuid for p in ordered}
    return PodRecord(
        allocation_id=allocation_id,
        pod_uid=pod_uid,
        namespace=namespace,
        pod_name=pod_name,
        node=node,
        state=AllocationState.RESERVED.value,
        version=1,
        parts=ordered,
        assigned=False,
        gpu_memory={u: m for u, m in gpu_memory.items() if u in uuids},
        claim_uid=claim_uid,
    )


async def pod_record(engine: AsyncEngine, allocation_id: uuid.UUID) -> PodRecord | None:
    """The allocation's current record (None when the ledger has no such allocation), read on one connection."""
    async with reading(engine) as conn:
        row = (await conn.execute(select(allocations).where(allocations.c.id == allocation_id))).first()
        if row is None:
            return None
        rows = await _part_rows(conn, allocation_id)
        uuids = sorted({r.gpu_uuid for r in rows})
        memory = (await conn.execute(_memory_of(), {"uuids": uuids})).all()
    return PodRecord(
        allocation_id=row.id,
        pod_uid=row.pod_uid,
        namespace=row.namespace,
        pod_name=row.pod_name,
        node=row.node,
        state=row.state,
        version=int(row.version),
        parts=[part_from_row(r) for r in rows],
        assigned=any(r.assigned_at is not None for r in rows),
        gpu_memory={r.uuid: int(r.memory_mib) for r in memory},
        claim_uid=row.claim_uid,
    )


ENDED_MEMORY = timedelta(minutes=10)


async def node_snapshot(engine: AsyncEngine, node: str, stream_seq: int, *, now: datetime) -> NodeSnapshot:
    """Every container of a live allocation on `node`, and the node's allocations that ended recently."""
    query = (
        select(
            allocations.c.id,
            allocations.c.pod_uid,
            allocations.c.namespace,
            allocations.c.pod_name,
            allocations.c.reserved_at,
            allocations.c.pod_created_at,
            allocations.c.bound_at,
            allocations.c.version,
            allocation_parts.c.container,
            allocation_parts.c.container_index,
            allocation_parts.c.init,
            allocation_parts.c.sidecar,
            allocation_parts.c.gpu_uuid,
            allocation_parts.c.gpu_index,
            allocation_parts.c.memory_mib,
            allocation_parts.c.compute,
            allocation_parts.c.assigned_at,
        )
        .join(allocation_parts, allocation_parts.c.allocation_id == allocations.c.id)
        .where(and_(allocations.c.node == node, allocations.c.state.in_(LIVE_STATE_VALUES)))
        .order_by(allocations.c.id, allocation_parts.c.container_index, allocation_parts.c.gpu_index)
    )
    ended_query = select(allocations.c.id).where(
        and_(
            allocations.c.node == node,
            allocations.c.state.not_in(LIVE_STATE_VALUES),
            allocations.c.ended_at >= now - ENDED_MEMORY,
        )
    )
    async with reading(engine) as conn:
        rows = (await conn.execute(query)).all()
        ended = [r.id for r in (await conn.execute(ended_query)).all()]
    grouped: dict[tuple[uuid.UUID, str, int, bool, bool], list[Any]] = {}
    for r in rows:
        grouped.setdefault((r.id, r.container, r.container_index, r.init, r.sidecar), []).append(r)
    containers = [
        ContainerRecord(
            allocation_id=alloc_id,
            pod_uid=parts[0].pod_uid,
            namespace=parts[0].namespace,
            pod_name=parts[0].pod_name,
            container=container,
            container_index=index,
            init=init,
            sidecar=sidecar,
            shares=[
                ShareRecord(gpu_uuid=p.gpu_uuid, gpu_index=p.gpu_index, memory_mib=p.memory_mib, compute=p.compute)
                for p in parts
            ],
            reserved_at=parts[0].reserved_at,
            pod_created_at=parts[0].pod_created_at,
            bound_at=parts[0].bound_at,
            assigned=all(p.assigned_at is not None for p in parts),
            version=int(parts[0].version),
        )
        for (alloc_id, container, index, init, sidecar), parts in grouped.items()
    ]
    return NodeSnapshot(node=node, stream_seq=stream_seq, containers=containers, ended=ended)


async def allocation_node_state(engine: AsyncEngine, allocation_id: uuid.UUID) -> tuple[str, str] | None:
    """(node, state) of an allocation, or None when the ledger has no such allocation."""
    async with reading(engine) as conn:
        row = (
            await conn.execute(select(allocations.c.node, allocations.c.state).where(allocations.c.id == allocation_id))
        ).first()
    return (row.node, row.state) if row is not None else None
