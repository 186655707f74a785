"""The agent's read-only view of live allocations on its node, loaded from the ledger tables."""

from __future__ import annotations

from sqlalchemy import and_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.node_agent.assignment import PendingContainer, Share
from shared.ledger.models import allocation_parts, allocations
from shared.ledger.rules import LIVE_STATE_VALUES, gpu_charges


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
            allocation_parts.c.gpu_uuid,
            allocation_parts.c.gpu_index,
            allocation_parts.c.memory_mib,
            allocation_parts.c.compute,
            allocation_parts.c.assigned_at,
        )
        .join(allocation_parts, allocation_parts.c.allocation_id == allocations.c.id)
        .where(and_(allocations.c.node == node, allocations.c.state.in_(LIVE_STATE_VALUES)))
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    grouped: dict[tuple, list] = {}
    for r in rows:
        grouped.setdefault((r.id, r.container, r.container_index, r.init), []).append(r)
    pod_memory: dict = {}
    for r in rows:
        if not r.init:
            pod_memory[r.id] = pod_memory.get(r.id, 0) + r.memory_mib
    out = []
    for (alloc_id, container, index, init), parts in grouped.items():
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
            _Part(s.gpu_uuid, s.memory_mib, s.compute, c.init) for s in c.shares
        )
    total: dict[str, int] = {}
    for parts in per_alloc.values():
        for gpu, (memory, _) in gpu_charges(parts).items():
            total[gpu] = total.get(gpu, 0) + memory
    return total


class _Part:
    __slots__ = ("compute", "gpu_uuid", "init", "memory_mib")

    def __init__(self, gpu_uuid: str, memory_mib: int, compute: int, init: bool) -> None:
        self.gpu_uuid, self.memory_mib, self.compute, self.init = gpu_uuid, memory_mib, compute, init
