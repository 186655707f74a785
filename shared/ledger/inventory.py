"""What GPUs exist: nodes and GPUs as the node agents report them, their health, their retirement."""

from __future__ import annotations

import logging

from sqlalchemy import and_, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import HealthEvent, InventoryEvent, NodeRetiredEvent
from shared.ledger.gpu_rules import health_reason, recorded
from shared.ledger.models import gpus, nodes

log = logging.getLogger(__name__)


async def apply_inventory(conn: AsyncConnection, event: InventoryEvent) -> None:
    """Upsert the node and its GPUs; GPUs no longer reported are retired (their counters are kept
    until their allocations end). What a reported GPU's row becomes is `gpu_rules.recorded`: one whose
    reported memory or compute shrank below what is allocated keeps its old capacity in that dimension and
    is marked unhealthy instead of breaking the invariant."""
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
                select(
                    gpus.c.uuid,
                    gpus.c.node,
                    gpus.c.memory_mib,
                    gpus.c.memory_total_mib,
                    gpus.c.compute_units,
                    gpus.c.allocated_memory_mib,
                    gpus.c.allocated_compute,
                )
                .where(gpus.c.uuid.in_([g.uuid for g in event.gpus]) | (gpus.c.node == event.node))
                .order_by(gpus.c.uuid)
                .with_for_update()
            )
        ).all()
    }
    for gpu in event.gpus:
        old = existing.get(gpu.uuid)
        row = recorded(gpu, old)
        if old is not None and row.below_allocated:
            log.error(
                "GPU %s on %s now reports %d MiB and %d compute units but %d MiB and %d are allocated (%s); "
                "keeping its capacity and marking it unhealthy",
                gpu.uuid,
                event.node,
                gpu.memory_mib,
                gpu.compute_units,
                old.allocated_memory_mib,
                old.allocated_compute,
                row.health_reason,
            )
        values = {
            "node": event.node,
            "index": gpu.index,
            "model": gpu.model,
            "memory_mib": row.memory_mib,
            "memory_total_mib": row.memory_total_mib,
            "compute_units": row.compute_units,
            "healthy": row.healthy,
            "health_reason": row.health_reason,
            "mig_mode": gpu.mig_mode,
            "numa_node": gpu.numa_node,
            "pci_bus_id": gpu.pci_bus_id,
            "retired_at": None,
            "updated_at": at,
        }
        stmt = insert(gpus).values(uuid=gpu.uuid, **values)
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
            healthy=event.healthy,
            health_reason=health_reason(event.healthy, event.reason),
            updated_at=event.occurred_at,
        )
        .returning(gpus.c.uuid)
    )
    return result.first() is not None


async def apply_node_retired(conn: AsyncConnection, event: NodeRetiredEvent) -> None:
    """Retire a node and its GPUs (its allocations are released by separate events)."""
    at = event.occurred_at
    await conn.execute(update(nodes).where(nodes.c.name == event.node).values(retired_at=at, updated_at=at))
    # the GPU rows in UUID order, as every writer takes them (`locks`), before the UPDATE takes them in its own
    await conn.execute(select(gpus.c.uuid).where(gpus.c.node == event.node).order_by(gpus.c.uuid).with_for_update())
    await conn.execute(
        update(gpus).where(and_(gpus.c.node == event.node, gpus.c.retired_at.is_(None))).values(retired_at=at)
    )
