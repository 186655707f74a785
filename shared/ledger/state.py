"""The ledger as a pure value: what folding the event stream produces (no I/O).

`LedgerState.apply` mirrors, rule for rule, what `shared.ledger.ledger.apply_event` does to the tables,
so that replaying the stream yields the same ledger as the live database. Both sides are turned into
the same canonical form (`canonical()`) to compare them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from shared.events.catalogue import (
    AllocationPart,
    AssignedEvent,
    BoundEvent,
    ClaimReservedEvent,
    Event,
    ExchangedEvent,
    FailedEvent,
    HealthEvent,
    InventoryEvent,
    NodeRetiredEvent,
    QuotaEvent,
    ReleasedEvent,
    ReservedEvent,
    TerminatingEvent,
)
from shared.ledger.gpu_rules import health_applies, health_reason, recorded
from shared.ledger.rules import STAMPS, AllocationState, advances, exchange_plan, gpu_charges, is_live, moved_to


@dataclass
class NodeRow:
    """A node as the ledger holds it."""

    driver_version: str = ""
    cuda_version: str = ""
    retired: bool = False
    address: str = ""
    allocator: str = "extender"


@dataclass
class GpuRow:
    """A GPU as the ledger holds it."""

    node: str
    index: int
    model: str
    memory_mib: int
    memory_total_mib: int
    compute_units: int
    healthy: bool
    health_reason: str
    mig_mode: bool
    numa_node: int | None
    pci_bus_id: str
    retired: bool = False
    allocated_memory_mib: int = 0
    allocated_compute: int = 0


@dataclass
class AllocationRow:
    """An allocation with its parts."""

    pod_uid: str
    namespace: str
    pod_name: str
    owner_kind: str
    owner_name: str
    node: str
    state: AllocationState
    memory_mib: int
    compute: int
    reason: str
    reserved_at: datetime
    bound_at: datetime | None = None
    assigned_at: datetime | None = None
    ended_at: datetime | None = None
    terminating_at: datetime | None = None
    version: int = 1
    pod_created_at: datetime | None = None
    parts: tuple[AllocationPart, ...] = ()
    assigned_containers: dict[str, datetime] = field(default_factory=dict)
    claim_uid: str | None = None  # a DRA allocation: the ResourceClaim it records
    claim_name: str | None = None


def _relocated(part: AllocationPart, gpu_uuid: str, gpu_index: int) -> AllocationPart:
    return part.model_copy(update={"gpu_uuid": gpu_uuid, "gpu_index": gpu_index})


@dataclass
class LedgerState:
    """Nodes, GPUs, allocations and quotas, folded from events."""

    nodes: dict[str, NodeRow] = field(default_factory=dict)
    gpus: dict[str, GpuRow] = field(default_factory=dict)
    allocations: dict[uuid.UUID, AllocationRow] = field(default_factory=dict)
    quotas: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    live_by_pod: dict[str, uuid.UUID] = field(default_factory=dict)
    early: dict[uuid.UUID, list[Any]] = field(default_factory=dict)
    applied: int = 0
    seen: dict[uuid.UUID, datetime] = field(default_factory=dict)  # event id -> when it occurred
    duplicates: int = 0

    def apply(self, event: Event) -> None:
        """Fold one event in (events that do not change the ledger are ignored, and so is a second copy of an
        event: the outbox relay may republish a batch, and the stream drops copies only within its window)."""
        if event.event_id in self.seen:
            self.duplicates += 1
            return
        self.seen[event.event_id] = event.occurred_at
        match event:
            case InventoryEvent():
                self._inventory(event)
            case HealthEvent():
                gpu = self.gpus.get(event.gpu_uuid)
                if gpu is not None and health_applies(gpu.node, event.node):
                    gpu.healthy, gpu.health_reason = event.healthy, health_reason(event.healthy, event.reason)
            case NodeRetiredEvent():
                if event.node in self.nodes:
                    self.nodes[event.node].retired = True
                for gpu in self.gpus.values():
                    if gpu.node == event.node:
                        gpu.retired = True
            case QuotaEvent():
                if event.memory_mib is None and event.compute is None:
                    self.quotas.pop(event.namespace, None)
                else:
                    self.quotas[event.namespace] = (event.memory_mib, event.compute)
            case ReservedEvent():
                self._reserved(event)
            case ExchangedEvent():
                self._exchange(event)
            case BoundEvent() | AssignedEvent() | ReleasedEvent() | FailedEvent() | TerminatingEvent():
                if event.allocation_id not in self.allocations:
                    self.early.setdefault(event.allocation_id, []).append(event)
                else:
                    self._transition(event)
            case _:
                return
        self.applied += 1

    def _inventory(self, event: InventoryEvent) -> None:
        node = self.nodes.setdefault(event.node, NodeRow())
        node.driver_version, node.cuda_version, node.retired = event.driver_version, event.cuda_version, False
        node.address, node.allocator = event.address, event.allocator
        for info in event.gpus:
            old = self.gpus.get(info.uuid)
            rec = recorded(info, old)
            self.gpus[info.uuid] = GpuRow(
                node=event.node,
                index=info.index,
                model=info.model,
                memory_mib=rec.memory_mib,
                memory_total_mib=rec.memory_total_mib,
                compute_units=rec.compute_units,
                healthy=rec.healthy,
                health_reason=rec.health_reason,
                mig_mode=info.mig_mode,
                numa_node=info.numa_node,
                pci_bus_id=info.pci_bus_id,
                allocated_memory_mib=old.allocated_memory_mib if old is not None else 0,
                allocated_compute=old.allocated_compute if old is not None else 0,
            )
        reported = {g.uuid for g in event.gpus}
        for gpu_uuid, gpu in self.gpus.items():
            if gpu.node == event.node and gpu_uuid not in reported:
                gpu.retired = True

    def _reserved(self, event: ReservedEvent) -> None:
        if event.allocation_id in self.allocations or event.pod_uid in self.live_by_pod:
            return
        charges = gpu_charges(event.parts)
        self.allocations[event.allocation_id] = AllocationRow(
            pod_uid=event.pod_uid,
            namespace=event.namespace,
            pod_name=event.pod_name,
            owner_kind=event.owner_kind,
            owner_name=event.owner_name,
            node=event.node,
            state=AllocationState.RESERVED,
            memory_mib=sum(m for m, _ in charges.values()),
            compute=sum(c for _, c in charges.values()),
            reason="",
            reserved_at=event.occurred_at,
            pod_created_at=event.pod_created_at,
            parts=tuple(event.parts),
        )
        if isinstance(event, ClaimReservedEvent):
            row = self.allocations[event.allocation_id]
            row.claim_uid, row.claim_name = event.claim_uid, event.claim_name
        self.live_by_pod[event.pod_uid] = event.allocation_id
        self._charge(charges, +1)
        for early in self.early.pop(event.allocation_id, []):
            self._transition(early)

    def _transition(self, event: BoundEvent | AssignedEvent | ReleasedEvent | FailedEvent | TerminatingEvent) -> None:
        alloc = self.allocations[event.allocation_id]
        if isinstance(event, TerminatingEvent):  # a stamp only, in whatever order it arrives
            if alloc.terminating_at is None:
                alloc.terminating_at = event.occurred_at
            return
        new_state = AllocationState(event.kind)
        stamp = STAMPS[new_state]
        if getattr(alloc, stamp) is None:
            setattr(alloc, stamp, event.occurred_at)
        if isinstance(event, AssignedEvent):
            alloc.assigned_containers.setdefault(event.container, event.occurred_at)
        if advances(alloc.state, new_state):
            if isinstance(event, ReleasedEvent | FailedEvent):
                alloc.reason = event.reason
            if is_live(alloc.state) and not is_live(new_state):
                self._charge(gpu_charges(alloc.parts), -1)
                self.live_by_pod.pop(alloc.pod_uid, None)
            alloc.state = new_state

    def _exchange(self, event: ExchangedEvent) -> None:
        """Move two containers' shares as the event's result says (an allocation already at or past the
        event's version is left alone), or swap them for an event without a result. Only live allocations
        hold capacity, so a release that reached the stream before the exchange ends the same way."""
        a = self.allocations.get(event.first_allocation_id)
        b = self.allocations.get(event.second_allocation_id)
        if a is None or b is None:
            return
        if event.moves:
            targets = {}
            for a_id in {event.first_allocation_id, event.second_allocation_id}:
                alloc, version = self.allocations[a_id], event.version_of(a_id) or 0
                if version > alloc.version:
                    targets[a_id] = (alloc, version)
            for a_id, (alloc, version) in targets.items():
                self._move(alloc, version, lambda p, a_id=a_id: moved_to(a_id, p, event.moves))
            return
        first = [p for p in a.parts if p.container == event.first_container]
        second = [p for p in b.parts if p.container == event.second_container]
        plan = exchange_plan(first, second)
        moved = {id(part): (new_uuid, new_index) for part, new_uuid, new_index, _, _ in plan}
        for alloc in {id(a): a, id(b): b}.values():
            self._move(alloc, alloc.version, lambda p: moved.get(id(p)))  # the ledger did not count these

    def _move(self, alloc: AllocationRow, version: int, where: Any) -> None:
        """Re-seat an allocation's parts (`where(part)` -> (GPU UUID, index) or None) and set its version."""
        if is_live(alloc.state):
            self._charge(gpu_charges(alloc.parts), -1)
        new_parts = []
        for p in alloc.parts:
            target = where(p)
            new_parts.append(p if target is None else _relocated(p, *target))
        alloc.parts, alloc.version = tuple(new_parts), version
        if is_live(alloc.state):
            self._charge(gpu_charges(alloc.parts), +1)

    def _charge(self, charges: dict[str, tuple[int, int]], sign: int) -> None:
        for gpu_uuid, (memory, compute) in charges.items():
            gpu = self.gpus.get(gpu_uuid)
            if gpu is not None:
                gpu.allocated_memory_mib += sign * memory
                gpu.allocated_compute += sign * compute

    def forget_seen(self, horizon_s: float) -> int:
        """Forget the ids of events that occurred more than `horizon_s` before the newest one seen (what a
        snapshot keeps for recognising copies in the tail after it); returns how many were forgotten.

        Copies come from the outbox relay republishing rows it still holds, so a copy follows its original
        within one relay batch in the stream, however long the outage between them; the horizon (days by
        default) is far beyond that. Past it, life-cycle and exchange events are idempotent by themselves.
        """
        if not self.seen:
            return 0
        cutoff = max(self.seen.values()) - timedelta(seconds=horizon_s)
        before = len(self.seen)
        self.seen = {event_id: at for event_id, at in self.seen.items() if at >= cutoff}
        return before - len(self.seen)

    def canonical(self) -> dict[str, Any]:
        """A plain, order-independent form for comparing two ledgers."""
        return {
            "nodes": {
                name: (n.driver_version, n.cuda_version, n.retired, n.address, n.allocator)
                for name, n in sorted(self.nodes.items())
            },
            "gpus": {u: tuple(vars(g).values()) for u, g in sorted(self.gpus.items())},
            "allocations": {
                str(a_id): (
                    a.pod_uid,
                    a.namespace,
                    a.pod_name,
                    a.owner_kind,
                    a.owner_name,
                    a.node,
                    a.state.value,
                    a.memory_mib,
                    a.compute,
                    a.reason,
                    a.reserved_at,
                    a.bound_at,
                    a.assigned_at,
                    a.ended_at,
                    a.terminating_at,
                    a.version,
                    a.pod_created_at,
                    tuple(
                        sorted(
                            (
                                p.container_index,
                                p.init,
                                p.sidecar,
                                p.gpu_uuid,
                                p.container,
                                p.gpu_index,
                                p.memory_mib,
                                p.compute,
                            )
                            for p in a.parts
                        )
                    ),
                    tuple(sorted(a.assigned_containers.items())),
                    a.claim_uid,
                    a.claim_name,
                )
                for a_id, a in sorted(self.allocations.items(), key=lambda kv: str(kv[0]))
            },
            "quotas": dict(sorted(self.quotas.items())),
        }

    def copy(self) -> LedgerState:
        """A deep-enough copy for tests."""
        return replace(
            self,
            nodes={k: replace(v) for k, v in self.nodes.items()},
            gpus={k: replace(v) for k, v in self.gpus.items()},
            allocations={
                k: replace(v, assigned_containers=dict(v.assigned_containers)) for k, v in self.allocations.items()
            },
            quotas=dict(self.quotas),
            live_by_pod=dict(self.live_by_pod),
            early={k: list(v) for k, v in self.early.items()},
            seen=dict(self.seen),
        )
