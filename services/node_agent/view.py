"""The agent's view of the live allocations on its node: a snapshot from the ledger's gateway, kept current by
the node's events from the stream (pure: no I/O).

Every event applies idempotently, so the events that follow the snapshot's stream sequence may repeat what
the snapshot already holds: a reservation known or recently ended is not added again, states only move
forward, and an exchange moves shares only when it is newer than the allocation's version.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict, namedtuple
from dataclasses import replace
from datetime import datetime
from typing import Any, cast

from services.node_agent.assignment import PendingContainer, Share
from shared.events.agent_rpc import ContainerRecord, NodeSnapshot
from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
    Event,
    ExchangedEvent,
    FailedEvent,
    ReleasedEvent,
    ReservedEvent,
)
from shared.ledger.rules import FORWARD, AllocationState, ChargeablePart, gpu_charges, long_running, moved_to

ENDED_REMEMBERED = 4096


class NodeView:
    """Live containers of one node, by (allocation id, container name)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._containers: dict[tuple[uuid.UUID, str], PendingContainer] = {}
        self._versions: dict[uuid.UUID, int] = {}
        self._states: dict[uuid.UUID, str] = {}  # the life-cycle state of each live allocation
        self._ended: OrderedDict[uuid.UUID, None] = OrderedDict()
        self.loaded = False
        self.stream_seq = 0

    def load(self, snapshot: NodeSnapshot) -> None:
        """Replace the view with a snapshot (events after `snapshot.stream_seq` are applied on top)."""
        self._containers = {}
        self._versions = {}
        self._states = {}
        for alloc_id in snapshot.ended:
            self._end(alloc_id)
        by_alloc: dict[uuid.UUID, list[ContainerRecord]] = {}
        for record in snapshot.containers:
            by_alloc.setdefault(record.allocation_id, []).append(record)
        for alloc_id, records in by_alloc.items():
            self._ended.pop(alloc_id, None)
            pod_memory = sum(s.memory_mib for r in records if not r.init or r.sidecar for s in r.shares)
            self._versions[alloc_id] = records[0].version
            self._states[alloc_id] = _snapshot_state(records)
            for r in records:
                self._containers[(alloc_id, r.container)] = PendingContainer(
                    allocation_id=alloc_id,
                    pod_uid=r.pod_uid,
                    namespace=r.namespace,
                    pod_name=r.pod_name,
                    container=r.container,
                    container_index=r.container_index,
                    init=r.init,
                    sidecar=r.sidecar,
                    shares=tuple(
                        Share(s.gpu_uuid, s.gpu_index, s.memory_mib, s.compute)
                        for s in sorted(r.shares, key=lambda s: s.gpu_index)
                    ),
                    reserved_at=r.reserved_at,
                    assigned=r.assigned,
                    pod_memory_mib=pod_memory,
                    pod_created_at=r.pod_created_at,
                    bound_at=r.bound_at,
                )
        self.loaded = True
        self.stream_seq = snapshot.stream_seq

    def containers(self) -> list[PendingContainer]:
        """Every container of a live allocation on the node."""
        return list(self._containers.values())

    def container(self, key: tuple[uuid.UUID, str]) -> PendingContainer | None:
        """One live container by (allocation id, container name)."""
        return self._containers.get(key)

    def containers_of(self, allocation_id: uuid.UUID) -> list[PendingContainer]:
        """The live containers of one allocation (none: not live here)."""
        if allocation_id not in self._versions:
            return []
        return [c for (alloc_id, _), c in self._containers.items() if alloc_id == allocation_id]

    def version(self, allocation_id: uuid.UUID) -> int | None:
        """The allocation's version as the view knows it (None: not live here)."""
        return self._versions.get(allocation_id)

    def apply(self, event: Event) -> bool:
        """Fold one of the node's events in; True when the view changed."""
        match event:
            case ReservedEvent():
                return self._reserved(event)
            case BoundEvent():
                self._advance(event.allocation_id, event.kind)
                return self._bound(event.allocation_id, event.occurred_at)
            case AssignedEvent():
                self._advance(event.allocation_id, event.kind)
                key = (event.allocation_id, event.container)
                current = self._containers.get(key)
                if current is None or current.assigned:
                    return False
                self._containers[key] = replace(current, assigned=True)
                return True
            case ExchangedEvent():
                return self._exchanged(event)
            case ReleasedEvent() | FailedEvent():
                state = self._states.get(event.allocation_id)
                if state is not None and (state, event.kind) not in FORWARD:  # a failure after the Binding
                    return False
                return self._end(event.allocation_id)
        return False

    def _advance(self, allocation_id: uuid.UUID, kind: str) -> None:
        state = self._states.get(allocation_id)
        if state is not None and (state, kind) in FORWARD:
            self._states[allocation_id] = kind

    def _reserved(self, event: ReservedEvent) -> bool:
        if event.node != self.node or event.allocation_id in self._ended or event.allocation_id in self._versions:
            return False
        pod_memory = sum(p.memory_mib for p in event.parts if long_running(p))
        grouped: dict[tuple[str, int, bool, bool], list[Share]] = {}
        for p in event.parts:
            grouped.setdefault((p.container, p.container_index, p.init, p.sidecar), []).append(
                Share(p.gpu_uuid, p.gpu_index, p.memory_mib, p.compute)
            )
        for (container, index, init, sidecar), shares in grouped.items():
            self._containers[(event.allocation_id, container)] = PendingContainer(
                allocation_id=event.allocation_id,
                pod_uid=event.pod_uid,
                namespace=event.namespace,
                pod_name=event.pod_name,
                container=container,
                container_index=index,
                init=init,
                sidecar=sidecar,
                shares=tuple(sorted(shares, key=lambda s: s.gpu_index)),
                reserved_at=event.occurred_at,
                pod_memory_mib=pod_memory,
                pod_created_at=event.pod_created_at,
            )
        self._versions[event.allocation_id] = 1
        self._states[event.allocation_id] = AllocationState.RESERVED.value
        return True

    def _bound(self, allocation_id: uuid.UUID, at: datetime) -> bool:
        changed = False
        for key, c in list(self._containers.items()):
            if key[0] == allocation_id and c.bound_at is None:
                self._containers[key] = replace(c, bound_at=at)
                changed = True
        return changed

    def _exchanged(self, event: ExchangedEvent) -> bool:
        """Apply an exchange's result to each allocation it makes newer (a stale or repeated copy: nothing)."""
        changed = False
        for alloc_id in dict.fromkeys((event.first_allocation_id, event.second_allocation_id)):
            version = event.version_of(alloc_id)
            if version is None or alloc_id not in self._versions or version <= self._versions[alloc_id]:
                continue
            for key, c in list(self._containers.items()):
                if key[0] != alloc_id:
                    continue
                shares = []
                for s in c.shares:
                    target = moved_to(alloc_id, _SharePart(c.container, s.gpu_uuid, s.gpu_index), event.moves)
                    shares.append(s if target is None else Share(target[0], target[1], s.memory_mib, s.compute))
                self._containers[key] = replace(c, shares=tuple(sorted(shares, key=lambda s: s.gpu_index)))
            self._versions[alloc_id] = version
            changed = True
        return changed

    def _end(self, allocation_id: uuid.UUID) -> bool:
        self._ended[allocation_id] = None
        self._ended.move_to_end(allocation_id)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        self._states.pop(allocation_id, None)
        if self._versions.pop(allocation_id, None) is None:
            return False
        for key in [k for k in self._containers if k[0] == allocation_id]:
            del self._containers[key]
        return True


def _snapshot_state(records: list[ContainerRecord]) -> str:
    """An allocation's state from its snapshot: an assigned container makes it `assigned`, a Binding `bound`."""
    if any(r.assigned for r in records):
        return AllocationState.ASSIGNED.value
    if records[0].bound_at is not None:
        return AllocationState.BOUND.value
    return AllocationState.RESERVED.value


class _SharePart:
    """A share seen as a movable part (what `rules.moved_to` reads)."""

    __slots__ = ("container", "gpu_index", "gpu_uuid")

    def __init__(self, container: str, gpu_uuid: str, gpu_index: int) -> None:
        self.container, self.gpu_uuid, self.gpu_index = container, gpu_uuid, gpu_index


_Charge: Any = cast(Any, namedtuple)(
    "_Charge", ["gpu_uuid", "container_index", "memory_mib", "compute", "init", "sidecar"]
)
"""A share as `gpu_charges` reads it: a plain tuple, since the gauges' refresh builds one per share on the node."""


def allocated_by_gpu(containers: list[PendingContainer]) -> dict[str, int]:
    """MiB charged on each GPU by these containers (init and sidecar shares count as Kubernetes counts them)."""
    return {gpu: memory for gpu, (memory, _) in charges_by_gpu(containers).items()}


def charges_by_gpu(containers: list[PendingContainer]) -> dict[str, tuple[int, int]]:
    """(MiB, compute) charged on each GPU by these containers: each pod's `gpu_charges`, added up (a pod of app
    containers only simply adds its shares)."""
    with_init = {c.allocation_id for c in containers if c.init}
    total: dict[str, tuple[int, int]] = {}
    per_alloc: dict[uuid.UUID, list[ChargeablePart]] = {}
    for c in containers:
        if c.allocation_id not in with_init:  # app containers only: their shares simply add up
            for s in c.shares:
                m, k = total.get(s.gpu_uuid, (0, 0))
                total[s.gpu_uuid] = (m + s.memory_mib, k + s.compute)
            continue
        per_alloc.setdefault(c.allocation_id, []).extend(
            _Charge(
                gpu_uuid=s.gpu_uuid,
                container_index=c.container_index,
                memory_mib=s.memory_mib,
                compute=s.compute,
                init=c.init,
                sidecar=c.sidecar,
            )
            for s in c.shares
        )
    for parts in per_alloc.values():
        for gpu, (memory, compute) in gpu_charges(parts).items():
            m, k = total.get(gpu, (0, 0))
            total[gpu] = (m + memory, k + compute)
    return total
