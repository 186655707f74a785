"""What the binder reads from the ledger (writes go through `shared.ledger.ledger.Ledger`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import AllocationPart
from shared.ledger.models import allocation_parts, allocations, gpus, nodes, part_from_row
from shared.ledger.rules import LIVE_STATE_VALUES


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


async def allocation_state(engine: AsyncEngine, allocation_id: uuid.UUID) -> str | None:
    """The allocation's current state, or None when the ledger has no such allocation."""
    async with engine.connect() as conn:
        return (await conn.execute(select(allocations.c.state).where(allocations.c.id == allocation_id))).scalar()


@dataclass(frozen=True)
class BindFacts:
    """What binding one allocation needs from the ledger, read in one query."""

    state: str | None  # None: the ledger has no such allocation
    gpu_memory: dict[str, int]  # schedulable MiB of each GPU asked about that the ledger knows


async def bind_facts(engine: AsyncEngine, allocation_id: uuid.UUID, uuids: list[str]) -> BindFacts:
    """The allocation's state and the memory of the named GPUs, in one round trip."""
    query = (
        select(allocations.c.state, gpus.c.uuid, gpus.c.memory_mib)
        .select_from(allocations.outerjoin(gpus, gpus.c.uuid.in_(uuids)))
        .where(allocations.c.id == allocation_id)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    if not rows:
        return BindFacts(None, {})
    return BindFacts(rows[0].state, {r.uuid: int(r.memory_mib) for r in rows if r.uuid is not None})


async def allocation_exists(engine: AsyncEngine, allocation_id: uuid.UUID) -> bool:
    """True when an allocation with this id exists in any state."""
    return await allocation_state(engine, allocation_id) is not None


async def gpu_memory(engine: AsyncEngine, uuids: list[str]) -> dict[str, int]:
    """Schedulable memory (MiB) of each GPU named."""
    async with engine.connect() as conn:
        rows = (await conn.execute(select(gpus.c.uuid, gpus.c.memory_mib).where(gpus.c.uuid.in_(uuids)))).all()
    return {r.uuid: int(r.memory_mib) for r in rows}


async def gpus_by_index(engine: AsyncEngine, node: str) -> dict[int, tuple[str, int]]:
    """The node's current (not retired) GPUs: index -> (UUID, schedulable MiB)."""
    async with engine.connect() as conn:
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
    async with engine.connect() as conn:
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
                ).where(allocations.c.state.in_(LIVE_STATE_VALUES))
            )
        ).all()
    return [LiveAllocation(*r) for r in rows]


async def active_node(engine: AsyncEngine, name: str) -> bool:
    """True when the ledger knows the node and has not retired it."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(select(nodes.c.name).where(and_(nodes.c.name == name, nodes.c.retired_at.is_(None))))
        ).first()
    return row is not None


async def reservation_parts(engine: AsyncEngine, allocation_id: uuid.UUID) -> list[AllocationPart]:
    """The parts of one allocation, in container order."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(allocation_parts)
                .where(allocation_parts.c.allocation_id == allocation_id)
                .order_by(
                    allocation_parts.c.init.desc(), allocation_parts.c.container_index, allocation_parts.c.gpu_index
                )
            )
        ).all()
    return [part_from_row(r) for r in rows]
