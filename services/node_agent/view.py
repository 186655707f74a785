"""The agent's read-only view of live allocations on its node, loaded from the ledger tables."""

from __future__ import annotations

from sqlalchemy import and_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.node_agent.assignment import PendingContainer, Share
from shared.events.catalogue import AllocationPart
from shared.ledger.models import allocation_parts, allocations
from shared.ledger.rules import gpu_charges, long_running

LIVE = ("reserved", "bound", "assigned")


async def load_containers(engine: AsyncEngine, node: str) -> list[PendingContainer]:
    """Every container with GPU shares in a live allocation on `node` (assigned ones flagged)."""
    query = (
        select(
            allocations.c.id,
            allocations.c.pod_uid,
            allocations.c.namespace,
            allocations.c.pod_name,
            allocations.c.reserved_at,
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
        .where(and_(allocations.c.node == node, allocations.c.state.in_(LIVE)))
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    grouped: dict[tuple, list] = {}
    for r in rows:
        grouped.setdefault((r.id, r.container, r.container_index, r.init, r.sidecar), []).append(r)
    pod_memory: dict = {}
    for r in rows:
        if long_running(r):  # what the pod holds for its whole life: app containers and sidecars
            pod_memory[r.id] = pod_memory.get(r.id, 0) + r.memory_mib
    out = []
    for (alloc_id, container, index, init, sidecar), parts in grouped.items():
        first = parts[0]
        out.append(
            PendingContainer(
                allocation_id=alloc_id,
                pod_uid=first.pod_uid,
                namespace=first.namespace,
                pod_name=first.pod_name,
                container=container,
                container_index=index,
                init=init,
                sidecar=sidecar,
                shares=tuple(
                    Share(p.gpu_uuid, p.gpu_index, p.memory_mib, p.compute)
                    for p in sorted(parts, key=lambda p: p.gpu_index)
                ),
                reserved_at=first.reserved_at,
                assigned=all(p.assigned_at is not None for p in parts),
                pod_memory_mib=pod_memory.get(alloc_id, 0),
            )
        )
    return out


def allocated_by_gpu(containers: list[PendingContainer]) -> dict[str, int]:
    """MiB charged on each GPU by these containers (init shares count as Kubernetes counts them)."""
    per_alloc: dict = {}
    for c in containers:
        per_alloc.setdefault(c.allocation_id, []).extend(
            AllocationPart(
                container=c.container,
                container_index=c.container_index,
                gpu_uuid=s.gpu_uuid,
                gpu_index=s.gpu_index,
                memory_mib=s.memory_mib,
                compute=s.compute,
                init=c.init,
                sidecar=c.sidecar,
            )
            for s in c.shares
        )
    total: dict[str, int] = {}
    for parts in per_alloc.values():
        for gpu, (memory, _) in gpu_charges(parts).items():
            total[gpu] = total.get(gpu, 0) + memory
    return total
