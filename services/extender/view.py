"""The extender's in-memory view of the ledger: nodes, GPUs, live allocations and quotas.

Loaded from the ledger tables, kept fresh by ledger events, and reloaded periodically and after any
reservation conflict. It only steers decisions: the reservation in the ledger is authoritative.
Applying an event is idempotent (a reservation is counted once per allocation id, an end once).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import (
    AllocationPart,
    AssignedEvent,
    BoundEvent,
    FailedEvent,
    HealthEvent,
    InventoryEvent,
    NodeRetiredEvent,
    QuotaEvent,
    ReleasedEvent,
    ReservedEvent,
)
from shared.ledger.models import allocation_parts, allocations, gpus, nodes, part_from_row, quotas
from shared.ledger.rules import gpu_charges
from shared.placement import GpuView, NodeView


@dataclass
class LiveAllocation:
    """A live allocation as the view knows it."""

    allocation_id: uuid.UUID
    pod_uid: str
    namespace: str
    pod_name: str
    node: str
    state: str
    parts: tuple[AllocationPart, ...]
    charges: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.charges = gpu_charges(self.parts)

    @property
    def memory_mib(self) -> int:
        """Memory the allocation holds across its GPUs."""
        return sum(m for m, _ in self.charges.values())

    @property
    def compute(self) -> int:
        """Compute the allocation holds across its GPUs."""
        return sum(c for _, c in self.charges.values())


@dataclass
class _Gpu:
    uuid: str
    node: str
    index: int
    model: str
    memory_mib: int
    compute_units: int
    allocated_memory_mib: int = 0
    allocated_compute: int = 0
    healthy: bool = True


class ClusterView:
    """Mutable state with immutable per-node snapshots (`nodes`) for the placement core."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeView] = {}
        self.allocations: dict[str, LiveAllocation] = {}
        self.quotas: dict[str, tuple[int | None, int | None]] = {}
        self.loaded = False
        self._gpus: dict[str, _Gpu] = {}
        self._cuda: dict[str, str] = {}

    # ---- queries -------------------------------------------------------------------------------
    def namespace_usage(self, namespace: str) -> tuple[int, int]:
        """(memory MiB, compute) held by the namespace's live allocations."""
        m = c = 0
        for a in self.allocations.values():
            if a.namespace == namespace:
                m += a.memory_mib
                c += a.compute
        return m, c

    def pods_on(self, node: str, gpu_uuid: str) -> list[LiveAllocation]:
        """Live allocations holding a share of a GPU."""
        return [a for a in self.allocations.values() if a.node == node and gpu_uuid in a.charges]

    # ---- loading -------------------------------------------------------------------------------
    async def reload(self, engine: AsyncEngine) -> None:
        """Replace the whole view with the ledger's current content."""
        async with engine.connect() as conn:
            node_rows = (await conn.execute(select(nodes).where(nodes.c.retired_at.is_(None)))).all()
            gpu_rows = (await conn.execute(select(gpus).where(gpus.c.retired_at.is_(None)))).all()
            alloc_rows = (
                await conn.execute(
                    select(allocations).where(allocations.c.state.in_(("reserved", "bound", "assigned")))
                )
            ).all()
            part_rows = (
                await conn.execute(
                    select(allocation_parts)
                    .join(allocations, allocations.c.id == allocation_parts.c.allocation_id)
                    .where(allocations.c.state.in_(("reserved", "bound", "assigned")))
                )
            ).all()
            quota_rows = (await conn.execute(select(quotas))).all()
        parts: dict[uuid.UUID, list[AllocationPart]] = {}
        for p in part_rows:
            parts.setdefault(p.allocation_id, []).append(part_from_row(p))
        live_nodes = {r.name for r in node_rows}
        self._cuda = {r.name: r.cuda_version for r in node_rows}
        self._gpus = {
            r.uuid: _Gpu(
                r.uuid,
                r.node,
                r.index,
                r.model,
                r.memory_mib,
                r.compute_units,
                r.allocated_memory_mib,
                r.allocated_compute,
                r.healthy,
            )
            for r in gpu_rows
            if r.node in live_nodes
        }
        self.allocations = {
            r.pod_uid: LiveAllocation(
                r.id, r.pod_uid, r.namespace, r.pod_name, r.node, r.state, tuple(parts.get(r.id, ()))
            )
            for r in alloc_rows
        }
        self.quotas = {r.namespace: (r.memory_mib, r.compute) for r in quota_rows}
        self.nodes = {}
        for name in live_nodes:
            self._rebuild(name)
        self.loaded = True

    def _rebuild(self, node: str) -> None:
        if node not in self._cuda:
            self.nodes.pop(node, None)
            return
        self.nodes[node] = NodeView(
            node,
            tuple(
                GpuView(
                    g.uuid,
                    g.index,
                    g.memory_mib,
                    g.allocated_memory_mib,
                    g.compute_units,
                    g.allocated_compute,
                    g.model,
                    g.healthy,
                )
                for g in self._gpus.values()
                if g.node == node
            ),
            self._cuda[node],
        )

    # ---- events --------------------------------------------------------------------------------
    def add_reservation(
        self,
        allocation_id: uuid.UUID,
        pod_uid: str,
        namespace: str,
        pod_name: str,
        node: str,
        parts: tuple[AllocationPart, ...],
        state: str = "reserved",
    ) -> None:
        """Count a live allocation (no-op when this allocation is already counted)."""
        current = self.allocations.get(pod_uid)
        if current is not None and current.allocation_id == allocation_id:
            return
        if current is not None:
            self._end(current)
        alloc = LiveAllocation(allocation_id, pod_uid, namespace, pod_name, node, state, parts)
        self.allocations[pod_uid] = alloc
        for gpu_uuid, (m, c) in alloc.charges.items():
            g = self._gpus.get(gpu_uuid)
            if g is not None:
                g.allocated_memory_mib += m
                g.allocated_compute += c
        self._rebuild(node)

    def _end(self, alloc: LiveAllocation) -> None:
        self.allocations.pop(alloc.pod_uid, None)
        for gpu_uuid, (m, c) in alloc.charges.items():
            g = self._gpus.get(gpu_uuid)
            if g is not None:
                g.allocated_memory_mib = max(0, g.allocated_memory_mib - m)
                g.allocated_compute = max(0, g.allocated_compute - c)
        self._rebuild(alloc.node)

    def apply(self, event: object) -> None:
        """Apply one ledger event to the view."""
        match event:
            case ReservedEvent():
                self.add_reservation(
                    event.allocation_id, event.pod_uid, event.namespace, event.pod_name, event.node, tuple(event.parts)
                )
            case BoundEvent() | AssignedEvent():
                a = self.allocations.get(event.pod_uid)
                if a is not None and a.allocation_id == event.allocation_id:
                    a.state = event.kind
            case FailedEvent() | ReleasedEvent():
                a = self.allocations.get(event.pod_uid)
                if a is not None and a.allocation_id == event.allocation_id:
                    self._end(a)
            case InventoryEvent():
                self._cuda[event.node] = event.cuda_version
                reported = {g.uuid for g in event.gpus}
                for old in [u for u, g in self._gpus.items() if g.node == event.node and u not in reported]:
                    del self._gpus[old]
                for info in event.gpus:
                    prev = self._gpus.get(info.uuid)
                    self._gpus[info.uuid] = _Gpu(
                        info.uuid,
                        event.node,
                        info.index,
                        info.model,
                        max(info.memory_mib, prev.allocated_memory_mib if prev else 0),
                        info.compute_units,
                        prev.allocated_memory_mib if prev else 0,
                        prev.allocated_compute if prev else 0,
                        info.healthy,
                    )
                self._rebuild(event.node)
            case HealthEvent():
                g = self._gpus.get(event.gpu_uuid)
                if g is not None:
                    g.healthy = event.healthy
                    self._rebuild(g.node)
            case NodeRetiredEvent():
                self._cuda.pop(event.node, None)
                for u in [u for u, g in self._gpus.items() if g.node == event.node]:
                    del self._gpus[u]
                for a in [a for a in self.allocations.values() if a.node == event.node]:
                    self.allocations.pop(a.pod_uid, None)
                self._rebuild(event.node)
            case QuotaEvent():
                if event.memory_mib is None and event.compute is None:
                    self.quotas.pop(event.namespace, None)
                else:
                    self.quotas[event.namespace] = (event.memory_mib, event.compute)
