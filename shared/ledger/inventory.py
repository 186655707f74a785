"""What GPUs exist: nodes and GPUs as the node agents report them, their health, their retirement."""

from __future__ import annotations

import logging

from sqlalchemy import and_, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import HealthEvent, InventoryEvent, NodeRetiredEvent
from shared.ledger.models import gpus, nodes

log = logging.getLogger(__name__)


async def apply_inventory(conn: AsyncConnection, event: InventoryEvent) -> None:
    """Upsert the node and its GPUs; GPUs no longer reported are retired (their counters are kept
    until their allocations end). A GPU whose reported memory shrank below what is allocated keeps
    its old capacity and is marked unhealthy instead of breaking the invariant."""
    at = event.occurred_at
    stmt = insert(nodes).values(
        name=event.node,
        labels={"address": event.address},
        driver_version=event.driver_version,
        cuda_version=event.cuda_version,
        retired_at=None,
        updated_at=at,
        allocator=event.allocator,
    )
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[nodes.c.name],
            set_={
                "driver_version": stmt.excluded.driver_version,
                "cuda_version": stmt.excluded.cuda_version,
                "labels": stmt.excluded.labels,
                "allocator": stmt.excluded.allocator,
                "retired_at": None,
                "updated_at": at,
            },
        )
    )
    # The GPU rows are locked (in UUID order, as reservations lock them) before their counters are read: a
    # reservation committing between the read and the update would otherwise leave the new capacity below
    # what is allocated, and the CHECK would refuse the whole inventory. Locked, the reservation waits and
    # then sees the new capacity (and is refused if it no longer fits), or it went first and is read here.
    existing = {
        r.uuid: r
        for r in (
            await conn.execute(
                select(gpus.c.uuid, gpus.c.node, gpus.c.allocated_memory_mib)
                .where(gpus.c.uuid.in_([g.uuid for g in event.gpus]) | (gpus.c.node == event.node))
                .order_by(gpus.c.uuid)
                .with_for_update()
            )
        ).all()
    }
    for gpu in event.gpus:
        values = {
            "node": event.node,
            "index": gpu.index,
            "model": gpu.model,
            "memory_mib": gpu.memory_mib,
            "memory_total_mib": gpu.memory_total_mib,
            "compute_units": gpu.compute_units,
            "healthy": gpu.healthy,
            "health_reason": "" if gpu.healthy else "reported unhealthy by the node agent",
            "mig_mode": gpu.mig_mode,
            "numa_node": gpu.numa_node,
            "pci_bus_id": gpu.pci_bus_id,
            "retired_at": None,
            "updated_at": at,
        }
        inserted = {"uuid": gpu.uuid, **values}
        old = existing.get(gpu.uuid)
        if old is not None and old.allocated_memory_mib > gpu.memory_mib:
            log.error(
                "GPU %s on %s now reports %d MiB but %d MiB are allocated; keeping it unhealthy",
                gpu.uuid,
                event.node,
                gpu.memory_mib,
                old.allocated_memory_mib,
            )
            values.pop("memory_mib")
            values.pop("memory_total_mib")
            values["healthy"] = False
            values["health_reason"] = "reported memory below allocated memory"
        stmt = insert(gpus).values(**inserted)
        await conn.execute(stmt.on_conflict_do_update(index_elements=[gpus.c.uuid], set_=values))
    reported = {g.uuid for g in event.gpus}
    gone = [u for u, r in existing.items() if r.node == event.node and u not in reported]
    if gone:
        await conn.execute(
            update(gpus).where(and_(gpus.c.uuid.in_(gone), gpus.c.retired_at.is_(None))).values(retired_at=at)
        )


async def apply_health(conn: AsyncConnection, event: HealthEvent) -> bool:
    """Mark one GPU healthy or unhealthy. Returns False for a GPU the ledger does not know."""
    result = await conn.execute(
        update(gpus)
        .where(and_(gpus.c.uuid == event.gpu_uuid, gpus.c.node == event.node))
        .values(
            healthy=event.healthy, health_reason="" if event.healthy else event.reason, updated_at=event.occurred_at
        )
        .returning(gpus.c.uuid)
    )
    return result.first() is not None


async def apply_node_retired(conn: AsyncConnection, event: NodeRetiredEvent) -> None:
    """Retire a node and its GPUs (its allocations are released by separate events)."""
    at = event.occurred_at
    await conn.execute(update(nodes).where(nodes.c.name == event.node).values(retired_at=at, updated_at=at))
    await conn.execute(
        update(gpus).where(and_(gpus.c.node == event.node, gpus.c.retired_at.is_(None))).values(retired_at=at)
    )
