"""The extender's in-memory view of the ledger: nodes, GPUs, live allocations and quotas.

Loaded from the ledger tables, kept fresh by ledger events, and reloaded periodically and after any
reservation conflict. It only steers decisions: the reservation in the ledger is authoritative.
Applying an event is idempotent (a reservation is counted once per allocation id, an end once, an
exchange once per event id).

The view is compact: a live allocation keeps only what decisions need (identity, node, state, its parts
and per-GPU charges as plain tuples), GPUs are indexed by node, and per-namespace usage is kept as running
totals. `version` grows on every change that can alter a placement decision (capacity, allocations, health,
quotas), so callers can cache answers computed from one state.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterable
from typing import Any, NamedTuple

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
    ExchangedEvent,
    FailedEvent,
    HealthEvent,
    InventoryEvent,
    NodeRetiredEvent,
    QuotaEvent,
    ReleasedEvent,
    ReservedEvent,
)
from shared.events.streams import LEDGER_KINDS
from shared.ledger.gpu_rules import health_applies, recorded
from shared.ledger.models import allocation_parts, allocations, gpus, nodes, quotas
from shared.ledger.rules import (
    FORWARD,
    LIVE_STATE_VALUES,
    AllocationState,
    ExchangeRefused,
    gpu_charges,
    moved_to,
    swap_shares,
)
from shared.placement import GpuView, NodeView
from shared.placement.columns import NodeColumns

_STREAM_ROWS = 2_000  # rows per fetch of the streamed reload (server-side cursor)
_EXCHANGES_KEPT = 4_096  # ids of the latest exchanges applied (a re-published one must not swap back)
_ENDED_KEPT = 16_384  # ids of the latest allocations that ended (a late copy of their reservation is not counted)
_APPLIED_KEPT = 65_536  # ids of the latest events applied (a copy republished later is skipped)


def _remember(ids: dict[uuid.UUID, None], key: uuid.UUID, limit: int) -> None:
    """Add `key` to an insertion-ordered set of at most `limit` ids (the oldest is dropped first)."""
    ids[key] = None
    if len(ids) > limit:
        del ids[next(iter(ids))]


_STATES = {s.value: s.value for s in AllocationState}  # one string object per state name
NO_INVENTORY = "node has no gpushare inventory (no node agent reported GPUs)"
DRA_NODE = (
    "node is a DRA node (its node agent runs --dra): kube-scheduler allocates its GPUs from ResourceClaims, so "
    "aliyun.com/* pods go to device-plugin nodes only (docs/dra.md)"
)

Charges = tuple[tuple[str, int, int], ...]  # (gpu uuid, MiB, compute) per GPU, sorted by uuid


class HeldPart(NamedTuple):
    """One container's share of one GPU, as the view keeps it (what an exchange needs to move it, and what
    `gpu_charges` needs to count it)."""

    container: str
    gpu_uuid: str
    gpu_index: int
    memory_mib: int
    compute: int
    init: bool
    container_index: int = 0
    sidecar: bool = False

    def relocated(self, gpu_uuid: str, gpu_index: int) -> HeldPart:
        """The same share on another GPU."""
        return self._replace(gpu_uuid=gpu_uuid, gpu_index=gpu_index)


Held = tuple[HeldPart, ...]


def _held(parts: Iterable[Any], gpus: dict[str, _Gpu]) -> tuple[Held, Charges]:
    """An allocation's parts and its per-GPU charges (Kubernetes' effective-request rule, see `gpu_charges`),
    with GPU UUIDs shared with the view's GPUs."""
    held = tuple(
        HeldPart(
            sys.intern(p.container),
            g.uuid if (g := gpus.get(p.gpu_uuid)) is not None else p.gpu_uuid,
            p.gpu_index,
            p.memory_mib,
            p.compute,
            p.init,
            p.container_index,
            p.sidecar,
        )
        for p in parts
    )
    return held, tuple((u, m, c) for u, (m, c) in gpu_charges(held).items())


class LiveAllocation:
    """A live allocation as the view knows it (slotted: tens of thousands are held)."""

    __slots__ = (
        "_charges",
        "_parts",
        "allocation_id",
        "namespace",
        "node",
        "pod_name",
        "pod_uid",
        "state",
        "version",
    )

    def __init__(
        self,
        allocation_id: uuid.UUID,
        pod_uid: str,
        namespace: str,
        pod_name: str,
        node: str,
        state: str,
        held: tuple[Held, Charges],
        version: int = 1,
    ) -> None:
        self.allocation_id = allocation_id
        self.pod_uid = pod_uid
        self.namespace = namespace
        self.pod_name = pod_name
        self.node = node
        self.state = state
        self.version = version  # the ledger's, raised by every exchange
        self._parts, self._charges = held

    @property
    def parts(self) -> Held:
        """Each container's share of each GPU."""
        return self._parts

    @property
    def charges(self) -> dict[str, tuple[int, int]]:
        """What the allocation holds per GPU: uuid -> (MiB, compute)."""
        return {u: (m, c) for u, m, c in self._charges}

    def holds(self, gpu_uuid: str) -> bool:
        """True when the allocation holds a share of this GPU."""
        return any(u == gpu_uuid for u, _, _ in self._charges)

    def charge_on(self, gpu_uuid: str) -> tuple[int, int]:
        """(MiB, compute) held on this GPU, (0, 0) when none."""
        for u, m, c in self._charges:
            if u == gpu_uuid:
                return m, c
        return 0, 0

    @property
    def memory_mib(self) -> int:
        """Memory the allocation holds across its GPUs."""
        return sum(m for _, m, _ in self._charges)

    @property
    def compute(self) -> int:
        """Compute the allocation holds across its GPUs."""
        return sum(c for _, _, c in self._charges)


class _Gpu:
    __slots__ = (
        "allocated_compute",
        "allocated_memory_mib",
        "compute_units",
        "healthy",
        "index",
        "memory_mib",
        "memory_total_mib",
        "model",
        "node",
        "uuid",
    )

    def __init__(
        self,
        uuid: str,
        node: str,
        index: int,
        model: str,
        memory_mib: int,
        compute_units: int,
        allocated_memory_mib: int = 0,
        allocated_compute: int = 0,
        healthy: bool = True,
        memory_total_mib: int = 0,
    ) -> None:
        self.uuid = uuid
        self.node = node
        self.index = index
        self.model = model
        self.memory_mib = memory_mib
        self.compute_units = compute_units
        self.allocated_memory_mib = allocated_memory_mib
        self.allocated_compute = allocated_compute
        self.healthy = healthy
        self.memory_total_mib = memory_total_mib


class _State:
    """Everything a reload replaces at once (built aside, then swapped in)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeView] = {}
        self.allocations: dict[str, LiveAllocation] = {}
        self.quotas: dict[str, tuple[int | None, int | None]] = {}
        self.cuda: dict[str, str] = {}
        self.dra_nodes: set[str] = set()  # nodes whose shares kube-scheduler places (DRA): never the extender's
        self.gpus: dict[str, _Gpu] = {}  # uuid -> GPU
        self.retired: dict[str, _Gpu] = {}  # uuid -> a GPU the ledger retired (its counters kept until allocations end)
        self.node_gpus: dict[str, dict[str, _Gpu]] = {}  # node -> uuid -> GPU
        self.node_allocs: dict[str, set[str]] = {}  # node -> pod UIDs of live allocations there
        self.ns_usage: dict[str, list[int]] = {}  # namespace -> [MiB, compute] of live allocations and holds
        self.holds: dict[uuid.UUID, LiveAllocation] = {}  # placements a bind awaits the ledger's answer for


class ClusterView:
    """Mutable state with immutable per-node snapshots (`nodes`) for the placement core."""

    def __init__(self) -> None:
        self.loaded = False
        self.version = 0
        self._exchanged: dict[uuid.UUID, None] = {}  # insertion-ordered: the oldest is dropped first
        self._ended: dict[uuid.UUID, None] = {}  # allocations whose release or failure the view applied
        self._applied: dict[uuid.UUID, None] = {}  # events applied (both survive reloads: copies come any time)
        self._swap(_State())

    def _swap(self, state: _State) -> None:
        self.nodes = state.nodes
        self.columns = NodeColumns(state.nodes.values())
        self.allocations = state.allocations
        self.quotas = state.quotas
        self._cuda = state.cuda
        self.dra_nodes = state.dra_nodes
        self._gpus = state.gpus
        self._retired = state.retired
        self._node_gpus = state.node_gpus
        self._node_allocs = state.node_allocs
        self._ns_usage = state.ns_usage
        self._holds = state.holds
        self.version += 1

    # ---- queries -------------------------------------------------------------------------------
    def namespace_usage(self, namespace: str) -> tuple[int, int]:
        """(memory MiB, compute) held by the namespace's live allocations."""
        m, c = self._ns_usage.get(namespace, (0, 0))
        return m, c

    def pods_on(self, node: str, gpu_uuid: str) -> list[LiveAllocation]:
        """Live allocations holding a share of a GPU."""
        out = []
        for uid in self._node_allocs.get(node, ()):
            a = self.allocations.get(uid)
            if a is not None and a.node == node and a.holds(gpu_uuid):
                out.append(a)
        return out

    def retired_counters(self) -> dict[str, tuple[int, int]]:
        """(MiB, compute) that live allocations still hold on GPUs the ledger retired (until their release)."""
        return {u: (g.allocated_memory_mib, g.allocated_compute) for u, g in self._retired.items()}

    # ---- loading -------------------------------------------------------------------------------
    async def reload(self, engine: AsyncEngine) -> None:
        """Replace the whole view with the ledger's current content.

        Rows are streamed (server-side cursor) and folded straight into the compact new state, so only
        the old view, the new one and one batch of rows are held at a time.
        """
        new = _State()
        intern = sys.intern
        async with engine.connect() as conn:
            async for r in await conn.stream(
                select(nodes.c.name, nodes.c.cuda_version, nodes.c.allocator).where(nodes.c.retired_at.is_(None))
            ):
                new.cuda[intern(r.name)] = r.cuda_version
                if r.allocator == "dra":
                    new.dra_nodes.add(r.name)
            gpu_query = select(
                gpus.c.uuid,
                gpus.c.node,
                gpus.c.index,
                gpus.c.model,
                gpus.c.memory_mib,
                gpus.c.memory_total_mib,
                gpus.c.compute_units,
                gpus.c.allocated_memory_mib,
                gpus.c.allocated_compute,
                gpus.c.healthy,
                gpus.c.retired_at,
            ).where(or_(gpus.c.retired_at.is_(None), gpus.c.allocated_memory_mib > 0, gpus.c.allocated_compute > 0))
            models: dict[str, str] = {}
            async for r in await conn.stream(gpu_query.execution_options(yield_per=_STREAM_ROWS)):
                node = intern(r.node)
                g = _Gpu(
                    r.uuid,
                    node,
                    r.index,
                    models.setdefault(r.model, r.model),
                    r.memory_mib,
                    r.compute_units,
                    r.allocated_memory_mib,
                    r.allocated_compute,
                    r.healthy,
                    r.memory_total_mib,
                )
                if r.retired_at is not None or node not in new.cuda:  # kept for its counters only
                    new.retired[r.uuid] = g
                    continue
                new.gpus[r.uuid] = g
                new.node_gpus.setdefault(node, {})[r.uuid] = g
            # one row per part (or one with no part), grouped by allocation: only one group is held at a time
            alloc_query = (
                select(
                    allocations.c.id,
                    allocations.c.pod_uid,
                    allocations.c.namespace,
                    allocations.c.pod_name,
                    allocations.c.node,
                    allocations.c.state,
                    allocations.c.version,
                    allocation_parts.c.container,
                    allocation_parts.c.gpu_uuid,
                    allocation_parts.c.gpu_index,
                    allocation_parts.c.memory_mib,
                    allocation_parts.c.compute,
                    allocation_parts.c.container_index,
                    allocation_parts.c.init,
                    allocation_parts.c.sidecar,
                )
                .select_from(
                    allocations.outerjoin(allocation_parts, allocation_parts.c.allocation_id == allocations.c.id)
                )
                .where(allocations.c.state.in_(LIVE_STATE_VALUES))
                .order_by(allocations.c.id)
            )
            current: Any = None
            parts: list[Any] = []
            async for r in await conn.stream(alloc_query.execution_options(yield_per=_STREAM_ROWS)):
                if current is None or r.id != current.id:
                    if current is not None:
                        self._load_allocation(new, current, parts)
                    current, parts = r, []
                if r.gpu_uuid is not None:
                    parts.append(r)
            if current is not None:
                self._load_allocation(new, current, parts)
            async for r in await conn.stream(select(quotas)):
                new.quotas[r.namespace] = (r.memory_mib, r.compute)
        for name in new.cuda:
            new.nodes[name] = _node_view(new.node_gpus, new.cuda, name)
        self._swap(new)
        self.loaded = True

    @staticmethod
    def _load_allocation(state: _State, row: Any, parts: list[Any]) -> None:
        alloc = LiveAllocation(
            row.id,
            row.pod_uid,
            sys.intern(row.namespace),
            row.pod_name,
            sys.intern(row.node),
            _STATES.get(row.state, row.state),
            _held(parts, state.gpus),
            row.version,
        )
        prev = state.allocations.get(alloc.pod_uid)
        if prev is not None:  # at most one live allocation per pod; keep the last, as a dict build would
            _unindex(state.node_allocs, state.ns_usage, prev)
        state.allocations[alloc.pod_uid] = alloc
        _index(state.node_allocs, state.ns_usage, alloc)

    def _rebuild(self, node: str) -> None:
        self.version += 1
        if node not in self._cuda:
            self.nodes.pop(node, None)
            self.columns.drop(node)
            return
        view = self.nodes[node] = _node_view(self._node_gpus, self._cuda, node)
        self.columns.put(view)

    # ---- events --------------------------------------------------------------------------------
    def add_reservation(
        self,
        allocation_id: uuid.UUID,
        pod_uid: str,
        namespace: str,
        pod_name: str,
        node: str,
        parts: Iterable[Any],
        state: str = AllocationState.RESERVED.value,
    ) -> None:
        """Count a live allocation (no-op when this allocation is already counted); a hold of the same id becomes it."""
        current = self.allocations.get(pod_uid)
        if current is not None and current.allocation_id == allocation_id:
            return
        self._unhold(allocation_id)
        if current is not None:
            self._end(current)
        alloc = self._live(allocation_id, pod_uid, namespace, pod_name, node, state, parts)
        self.allocations[pod_uid] = alloc
        self._count(alloc, +1)
        self._rebuild(node)

    def hold(
        self, allocation_id: uuid.UUID, pod_uid: str, namespace: str, pod_name: str, node: str, parts: Iterable[Any]
    ) -> None:
        """Count shares a bind asks the ledger for, while it decides (as kube-scheduler assumes a pod), beside the
        pod's live allocation if the view holds one: concurrent binds then pick around each other. The ledger's
        answer settles it: `add_reservation` of this id (or its `reserved` event) makes it the pod's allocation,
        `release_hold` takes it out (an answer with another allocation, a refusal, no answer). A reload drops it."""
        alloc = self._live(allocation_id, pod_uid, namespace, pod_name, node, AllocationState.RESERVED.value, parts)
        self._holds[allocation_id] = alloc
        self._charge(alloc, +1)
        _use(self._ns_usage, alloc, +1)
        self._rebuild(alloc.node)

    def release_hold(self, allocation_id: uuid.UUID) -> None:
        """Take out a hold the ledger did not turn into this allocation (no-op when there is none)."""
        held = self._unhold(allocation_id)
        if held is not None:
            self._rebuild(held.node)

    def _unhold(self, allocation_id: uuid.UUID) -> LiveAllocation | None:
        held = self._holds.pop(allocation_id, None)
        if held is not None:
            self._charge(held, -1)
            _use(self._ns_usage, held, -1)
        return held

    def _live(
        self, allocation_id: uuid.UUID, pod_uid: str, namespace: str, pod_name: str, node: str, state: str, parts: Any
    ) -> LiveAllocation:
        return LiveAllocation(
            allocation_id,
            pod_uid,
            sys.intern(namespace),
            pod_name,
            sys.intern(node),
            _STATES.get(state, state),
            _held(parts, self._gpus),
        )

    def _end(self, alloc: LiveAllocation) -> None:
        self.allocations.pop(alloc.pod_uid, None)
        self._count(alloc, -1)
        self._rebuild(alloc.node)

    def _count(self, alloc: LiveAllocation, sign: int) -> None:
        """Add (+1) or take out (-1) what the allocation holds: per-node and per-namespace indexes, GPU counters."""
        if sign > 0:
            _index(self._node_allocs, self._ns_usage, alloc)
        else:
            _unindex(self._node_allocs, self._ns_usage, alloc)
        self._charge(alloc, sign)

    def _charge(self, alloc: LiveAllocation, sign: int) -> None:
        """Add (+1) or take out (-1) what the allocation holds on each GPU."""
        for gpu_uuid, m, c in alloc._charges:
            g = self._gpus.get(gpu_uuid)
            if g is None:
                g = self._retired.get(gpu_uuid)
                if g is None:
                    continue
            g.allocated_memory_mib = max(0, g.allocated_memory_mib + sign * m)
            g.allocated_compute = max(0, g.allocated_compute + sign * c)

    def _exchange(self, event: ExchangedEvent) -> None:
        """Move two containers' shares as the ledger did: by the event's result when it carries one (only
        into an allocation older than the result's version, so a repeat or a copy the last reload already
        holds changes nothing), else by swapping them (`swap_shares`, see `apply_exchange`) once per event id.

        Both allocations are live in the ledger when it exchanges; when one has already left the view (its
        release overtook the exchange on the bus), the shares cannot be moved here and the next reload settles it.
        """
        on_node = (self.allocations.get(uid) for uid in self._node_allocs.get(event.node, ()))
        by_id = {x.allocation_id: x for x in on_node if x is not None}
        if event.moves:
            self._apply_moves(event, by_id)
            return
        a, b = by_id.get(event.first_allocation_id), by_id.get(event.second_allocation_id)
        if a is None or b is None or event.event_id in self._exchanged:
            return
        _remember(self._exchanged, event.event_id, _EXCHANGES_KEPT)
        try:
            first, second = swap_shares(
                a.parts, event.first_container, b.parts, event.second_container, HeldPart.relocated
            )
        except ExchangeRefused:  # the ledger refused it too, so it never published it
            return
        involved = {id(a): a, id(b): b}.values()
        for alloc in involved:
            self._count(alloc, -1)
        a._parts, a._charges = _held(first, self._gpus)
        b._parts, b._charges = _held(second, self._gpus)  # one allocation (a is b): the same new parts
        for alloc in involved:
            self._count(alloc, +1)
        self._rebuild(event.node)

    def _apply_moves(self, event: ExchangedEvent, by_id: dict[uuid.UUID, LiveAllocation]) -> None:
        for alloc_id in dict.fromkeys((event.first_allocation_id, event.second_allocation_id)):
            alloc, version = by_id.get(alloc_id), event.version_of(alloc_id)
            if alloc is None or version is None or version <= alloc.version:
                continue
            self._count(alloc, -1)
            moved = []
            for p in alloc.parts:
                target = moved_to(alloc_id, p, event.moves)
                moved.append(p if target is None else p.relocated(*target))
            alloc._parts, alloc._charges = _held(moved, self._gpus)
            alloc.version = version
            self._count(alloc, +1)
        self._rebuild(event.node)

    def _retire(self, gpu_uuid: str, g: _Gpu) -> None:
        if self._gpus.get(gpu_uuid) is g:
            del self._gpus[gpu_uuid]
            self._retired[gpu_uuid] = g

    def _inventory(self, event: InventoryEvent) -> None:
        """A node's GPUs as it reports them, recorded as the ledger records them (`gpu_rules.recorded`); the GPUs
        it no longer reports are retired with their counters (a GPU reported again finds what it holds)."""
        node = sys.intern(event.node)
        self._cuda[node] = event.cuda_version
        (self.dra_nodes.add if event.allocator == "dra" else self.dra_nodes.discard)(node)
        on_node = self._node_gpus.setdefault(node, {})
        reported = {g.uuid for g in event.gpus}
        for old in [u for u in on_node if u not in reported]:
            self._retire(old, on_node.pop(old))
        for info in event.gpus:
            prev = self._gpus.get(info.uuid)
            if prev is None:
                prev = self._retired.pop(info.uuid, None)
            elif prev.node != node and self._node_gpus.get(prev.node, {}).pop(info.uuid, None) is not None:
                self._rebuild(prev.node)  # the GPU moved: forget it on its old node
            rec = recorded(info, prev)
            g = _Gpu(
                info.uuid,
                node,
                info.index,
                info.model,
                rec.memory_mib,
                rec.compute_units,
                prev.allocated_memory_mib if prev else 0,
                prev.allocated_compute if prev else 0,
                rec.healthy,
                rec.memory_total_mib,
            )
            self._gpus[info.uuid] = g
            on_node[info.uuid] = g
        self._rebuild(node)

    def apply(self, event: object) -> None:
        """Apply one ledger event to the view, once per event id: a copy the outbox relay republished after
        the stream's dedup window (an old inventory, a reservation after its release) would undo what later
        events did until the next reload. Past the ids remembered, the reload every `--resync` seconds repairs."""
        if getattr(event, "kind", None) not in LEDGER_KINDS:  # usage and refusals: nothing here, nothing to remember
            return
        event_id = event.event_id  # type: ignore[attr-defined]
        if event_id in self._applied:
            return
        _remember(self._applied, event_id, _APPLIED_KEPT)
        match event:
            case ReservedEvent():
                if event.allocation_id in self._ended:  # a copy republished after the allocation ended
                    return
                self.add_reservation(
                    event.allocation_id, event.pod_uid, event.namespace, event.pod_name, event.node, event.parts
                )
            case BoundEvent() | AssignedEvent():
                a = self.allocations.get(event.pod_uid)
                if a is not None and a.allocation_id == event.allocation_id and (a.state, event.kind) in FORWARD:
                    a.state = _STATES[event.kind]  # no placement input changes: `version` stays
            case ExchangedEvent():
                self._exchange(event)
            case FailedEvent() | ReleasedEvent():
                a = self.allocations.get(event.pod_uid)
                if a is None or a.allocation_id != event.allocation_id:
                    _remember(self._ended, event.allocation_id, _ENDED_KEPT)
                elif (a.state, event.kind) in FORWARD:  # a failure after the Binding changes nothing
                    _remember(self._ended, event.allocation_id, _ENDED_KEPT)
                    self._end(a)
            case InventoryEvent():
                self._inventory(event)
            case HealthEvent():
                g = self._gpus.get(event.gpu_uuid)
                if g is not None and health_applies(g.node, event.node):
                    g.healthy = event.healthy
                    self._rebuild(g.node)
            case NodeRetiredEvent():
                # as the ledger does: the node's GPUs are retired with their counters, its allocations stay
                # counted until their own release events (`Ledger.retire_node` releases them first)
                self._cuda.pop(event.node, None)
                self.dra_nodes.discard(event.node)
                for u, g in self._node_gpus.pop(event.node, {}).items():
                    self._retire(u, g)
                self._rebuild(event.node)
            case QuotaEvent():
                if event.memory_mib is None and event.compute is None:
                    self.quotas.pop(event.namespace, None)
                else:
                    self.quotas[event.namespace] = (event.memory_mib, event.compute)
                self.version += 1


def _index(node_allocs: dict[str, set[str]], ns_usage: dict[str, list[int]], alloc: LiveAllocation) -> None:
    node_allocs.setdefault(alloc.node, set()).add(alloc.pod_uid)
    _use(ns_usage, alloc, +1)


def _unindex(node_allocs: dict[str, set[str]], ns_usage: dict[str, list[int]], alloc: LiveAllocation) -> None:
    on_node = node_allocs.get(alloc.node)
    if on_node is not None:
        on_node.discard(alloc.pod_uid)
        if not on_node:
            del node_allocs[alloc.node]
    _use(ns_usage, alloc, -1)


def _use(ns_usage: dict[str, list[int]], alloc: LiveAllocation, sign: int) -> None:
    """Add (+1) or take out (-1) what the allocation holds from its namespace's running totals."""
    usage = ns_usage.setdefault(alloc.namespace, [0, 0]) if sign > 0 else ns_usage.get(alloc.namespace)
    if usage is None:
        return
    usage[0] += sign * alloc.memory_mib
    usage[1] += sign * alloc.compute
    if usage == [0, 0]:
        del ns_usage[alloc.namespace]


def _node_view(node_gpus: dict[str, dict[str, _Gpu]], cuda: dict[str, str], node: str) -> NodeView:
    return NodeView(
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
            for g in node_gpus.get(node, {}).values()
        ),
        cuda[node],
    )
