"""One set of ledger rules: the same random event sequences, fed to every view of the ledger, make each say
the same about every GPU as the ledger's tables (real PostgreSQL).

A hypothesis state machine drives the real ledger (`Ledger` methods, each applying `apply_event` and staging
its event) through inventories that add, drop and shrink GPUs (memory and compute below what is allocated),
health reports (from the right node and from another), reservations (app, init and sidecar containers, some
refused), bound, assigned, failed (also after bound), released, terminating, exchanged (some refused) and
retired nodes. After every step the events the ledger staged are applied, in stream order, to

- `LedgerState` (the ledger rebuilt from the stream),
- the extender's `ClusterView` (fed the events; and, after a resync step, also reloaded from the tables),
- each node agent's `NodeView` (fed its node's events; and, after a resync step, also loaded from the binder's
  snapshot of the node),

and each view's word on every GPU is compared with the tables: capacity, allocated memory and compute,
health and whether placement may use it (the node agent speaks of what its node's allocations hold only).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, NamedTuple

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from services.binder.reads import node_snapshot
from services.extender.view import ClusterView
from services.node_agent.view import NodeView, charges_by_gpu
from shared.events.catalogue import AllocationPart, GpuInfo, HealthEvent, InventoryEvent
from shared.ledger.gpu_rules import schedulable
from shared.ledger.ledger import Ledger
from shared.ledger.replay import differences
from shared.ledger.reservations import ReservationError, ReservationRequest
from shared.ledger.rules import ExchangeRefused, is_live
from shared.ledger.state import LedgerState
from tests.reliability.loop import LoopThread, empty_ledger, ledger_env, ledger_tables, machine_settings, staged_events
from tests.reliability.profile import PROFILE

NODES = ("node-a", "node-b")
GIB = 1024
INDICES = (0, 1, 2)
MEMORY_GIB = (2, 4, 8, 16, 24)
COMPUTE_UNITS = (10, 40, 100)
SHARES_MIB = (0, 512, 1024, 2048, 4096)
SHARE_COMPUTE = (0, 0, 0, 10, 30)


def _uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


class Says(NamedTuple):
    """What a view says about one GPU (None where the view does not speak of it)."""

    node: str
    capacity: tuple[int, int] | None  # (MiB, compute units); None for a retired GPU
    allocated: tuple[int, int]  # (MiB, compute) its live allocations hold
    healthy: bool | None  # None for a retired GPU
    schedulable: bool


def ledger_says(state: LedgerState) -> dict[str, Says]:
    """Every GPU as the tables (or `LedgerState`) hold it."""
    out = {}
    for u, g in state.gpus.items():
        retired = g.retired or state.nodes[g.node].retired
        out[u] = Says(
            g.node,
            None if retired else (g.memory_mib, g.compute_units),
            (g.allocated_memory_mib, g.allocated_compute),
            None if retired else g.healthy,
            schedulable(g.healthy, retired),
        )
    return out


def extender_says(view: ClusterView, known: dict[str, Says]) -> dict[str, Says]:
    """Every GPU as the extender's view holds it: offered to placement (`nodes`), or retired with its counters
    (a retired GPU that holds nothing need not be remembered)."""
    out = {}
    for name, node in view.nodes.items():
        for g in node.gpus:
            out[g.uuid] = Says(
                name,
                (g.memory_mib, g.compute_units),
                (g.allocated_memory_mib, g.allocated_compute),
                g.healthy,
                schedulable(g.healthy, False),
            )
    retired = view.retired_counters()
    for u, says in known.items():
        if u not in out and says.capacity is None:
            out[u] = Says(says.node, None, retired.get(u, (0, 0)), None, False)
    return out


def agent_says(view: NodeView) -> dict[str, tuple[int, int]]:
    """What the node agent's view says its node's live allocations hold on each GPU (those holding anything)."""
    return {u: c for u, c in charges_by_gpu(view.containers()).items() if c != (0, 0)}


class ViewsMachine(RuleBasedStateMachine):
    """The real ledger, and every view of it fed the events it staged."""

    runner: LoopThread
    engine: AsyncEngine
    seen: Counter[str] = Counter()  # the cases the run reached, over all examples (the test asserts each)

    def __init__(self) -> None:
        super().__init__()
        self.runner.run(empty_ledger(self.engine))
        self.ledger = Ledger(self.engine, prefix="gsviews", source="views")
        self.last_seq = 0
        self.replayed = LedgerState()
        self.extender = ClusterView()
        self.agents = {node: NodeView(node) for node in NODES}
        self.reloaded: ClusterView | None = None
        self.snapshots: dict[str, NodeView] = {}
        self._next_id = 0

    def _new_id(self) -> uuid.UUID:
        self._next_id += 1
        return uuid.UUID(int=self._next_id)

    def _run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    def _feed(self) -> None:
        """Every view gets the events staged since the last step, in stream order (a node agent, its node's)."""
        for seq, event in self._run(staged_events(self.engine, self.last_seq)):
            self.replayed.apply(event)
            for view in (self.extender, self.reloaded):
                if view is not None:
                    view.apply(event)
            node = getattr(event, "node", None)
            for views in (self.agents, self.snapshots):
                if node in views:
                    views[node].apply(event)
            self.last_seq = seq

    def _allocations(self) -> list[tuple[uuid.UUID, Any]]:
        return sorted(self.replayed.allocations.items(), key=lambda kv: str(kv[0]))

    def _gpus(self, node: str, *, retired: bool) -> list[str]:
        """The node's GPUs (with `retired`, also those it no longer reports: reservations there are refused)."""
        gpus = [u for u, g in sorted(self.replayed.gpus.items()) if g.node == node and (retired or not g.retired)]
        return gpus or [u for u, g in sorted(self.replayed.gpus.items()) if g.node == node]

    # -- steps -----------------------------------------------------------------------------------

    @initialize()
    def inventories(self) -> None:
        for node in NODES:
            gpus = [
                GpuInfo(uuid=_uuid(node, i), index=i, memory_mib=16 * GIB, memory_total_mib=16 * GIB) for i in (0, 1)
            ]
            self._run(self.ledger.record(InventoryEvent(node=node, cuda_version="12.4", gpus=gpus)))

    @rule(
        data=st.data(),
        node=st.sampled_from(NODES),
        keep=st.sets(st.sampled_from(INDICES), min_size=1),
        retire=st.integers(0, 7),
    )
    def inventory(self, data: st.DataObject, node: str, keep: set[int], retire: int) -> None:
        """A node reports its GPUs: some dropped, some new, memory and compute shrunk or grown, some unhealthy.
        One time in eight the node is deleted instead: its allocations released, its GPUs retired."""
        if not retire:
            self._run(self.ledger.retire_node(node))
            self.seen["node retired"] += 1
            return
        gpus = []
        for i in sorted(keep):
            memory = data.draw(st.sampled_from(MEMORY_GIB)) * GIB
            gpus.append(
                GpuInfo(
                    uuid=_uuid(node, i),
                    index=i,
                    memory_mib=memory,
                    memory_total_mib=memory,
                    compute_units=data.draw(st.sampled_from(COMPUTE_UNITS)),
                    healthy=data.draw(st.integers(0, 7)) > 0,
                )
            )
        for info in gpus:
            before = self.replayed.gpus.get(info.uuid)
            if before is not None and (before.allocated_memory_mib, before.allocated_compute) != (0, 0):
                if before.retired:
                    self.seen["a retired GPU holding shares reported again"] += 1
                if before.allocated_memory_mib > info.memory_mib or before.allocated_compute > info.compute_units:
                    self.seen["reported below allocated"] += 1
        self._run(self.ledger.record(InventoryEvent(node=node, cuda_version="12.4", gpus=gpus)))

    @rule(
        node=st.sampled_from(NODES),
        from_node=st.sampled_from(NODES),
        index=st.sampled_from(INDICES),
        healthy=st.sampled_from((True, True, False)),
    )
    def health(self, node: str, from_node: str, index: int, healthy: bool) -> None:
        """A health report, sometimes from a node that does not hold the GPU (the ledger ignores it)."""
        self.seen["health from another node" if node != from_node else "health"] += 1
        event = HealthEvent(node=from_node, gpu_uuid=_uuid(node, index), healthy=healthy, reason="XID 79")
        self._run(self.ledger.record(event))

    @rule(
        data=st.data(),
        node=st.sampled_from(NODES),
        containers=st.integers(1, 2),
        with_init=st.booleans(),
        with_sidecar=st.booleans(),
    )
    def reserve(self, data: st.DataObject, node: str, containers: int, with_init: bool, with_sidecar: bool) -> None:
        """A new pod's reservation: each container asks one share on each of 1-2 of the node's GPUs (now and
        then on GPUs the node no longer reports: refused)."""
        if not self._gpus(node, retired=False) and data.draw(st.integers(0, 3)):  # a retired node: mostly the other
            node = next(n for n in NODES if n != node)
        gpus = self._gpus(node, retired=data.draw(st.integers(0, 7)) == 0)
        specs = [(f"c{i}", i, False, False) for i in range(containers)]
        if with_sidecar:
            specs.append(("side", 0, True, True))
        if with_init:
            specs.append(("init", 1, True, False))
        parts = []
        for name, index, init, sidecar in specs:
            memory, compute = data.draw(st.sampled_from(SHARES_MIB)), data.draw(st.sampled_from(SHARE_COMPUTE))
            for gpu in data.draw(st.permutations(gpus))[: data.draw(st.integers(1, 2))]:
                parts.append(
                    AllocationPart(
                        container=name,
                        container_index=index,
                        init=init,
                        sidecar=sidecar,
                        gpu_uuid=gpu,
                        gpu_index=int(gpu.rsplit("-", 1)[1]),
                        memory_mib=memory,
                        compute=compute,
                    )
                )
        pod = str(self._new_id())
        request = ReservationRequest(pod, "team", f"pod-{pod[-4:]}", node, tuple(parts), allocation_id=self._new_id())
        try:
            self._run(self.ledger.reserve(request))
            self.seen["reserved" + (" with init containers" if with_init else "")] += 1
        except ReservationError:
            self.seen["reservation refused"] += 1

    def _pick(self, data: st.DataObject) -> tuple[uuid.UUID, Any]:
        """An allocation: mostly a live one, one time in five any (one that ended, too)."""
        live = [(a_id, a) for a_id, a in self._allocations() if is_live(a.state)]
        return data.draw(st.sampled_from(live if live and data.draw(st.integers(0, 4)) else self._allocations()))

    @precondition(lambda self: bool(self.replayed.allocations))
    @rule(data=st.data(), step=st.sampled_from(["bound", "assigned", "terminating"]))
    def progress(self, data: st.DataObject, step: str) -> None:
        """An allocation is bound, a container assigned, or its pod terminating (any order, any repeat: the
        ledger moves states only forward, and so must every view)."""
        a_id, a = self._pick(data)
        self.seen[f"{step} after {a.state.value}"] += 1
        self.seen[step] += 1
        if step == "bound":
            self._run(self.ledger.mark_bound(a_id, a.pod_uid, a.node))
        elif step == "assigned":
            container = data.draw(st.sampled_from(sorted({p.container for p in a.parts})))
            gpus = sorted({p.gpu_uuid for p in a.parts if p.container == container})
            self._run(self.ledger.mark_assigned(a_id, a.pod_uid, a.node, container, gpus))
        else:
            self._run(self.ledger.mark_terminating(a.pod_uid))

    @precondition(lambda self: bool(self.replayed.allocations))
    @rule(data=st.data(), step=st.sampled_from(["failed", "released"]))
    def end(self, data: st.DataObject, step: str) -> None:
        """An allocation fails or is released: the views give its shares back only where the ledger does (a
        failure after the Binding, or a second end, changes nothing)."""
        a_id, a = self._pick(data)
        self.seen[f"{step} after {a.state.value}"] += 1
        self.seen[step] += 1
        if step == "failed":
            self._run(self.ledger.mark_failed(a_id, a.pod_uid, a.node, "binding refused"))
        else:
            self._run(self.ledger.release(a_id, a.pod_uid, a.node, "pod deleted"))

    @precondition(lambda self: any(is_live(a.state) for a in self.replayed.allocations.values()))
    @rule(data=st.data(), alike=st.integers(0, 3))
    def exchange(self, data: st.DataObject, alike: int) -> None:
        """Two live containers swap shares. Mostly a new pod's container shaped like a live one (same shares, on
        other GPUs of its node) is reserved first and the two swap, as the node agent swaps a pod kubelet started
        on the other's devices; otherwise any two (the ledger refuses shares of another size or kind, or on two
        nodes)."""
        containers = [
            (a_id, a, c)
            for a_id, a in self._allocations()
            if is_live(a.state)
            for c in sorted({p.container for p in a.parts})
        ]
        a_id, a, first = data.draw(st.sampled_from(containers))
        if alike:
            mine = sorted((p for p in a.parts if p.container == first), key=lambda p: p.gpu_index)
            gpus = data.draw(st.permutations(self._gpus(a.node, retired=False)))[: len(mine)]
            if len(gpus) < len(mine):
                return
            pod = str(self._new_id())
            parts = tuple(
                p.model_copy(update={"gpu_uuid": u, "gpu_index": int(u.rsplit("-", 1)[1])})
                for p, u in zip(mine, sorted(gpus, key=lambda u: int(u.rsplit("-", 1)[1])), strict=True)
            )
            request = ReservationRequest(pod, "team", "alike", a.node, parts, allocation_id=self._new_id())
            try:
                self._run(self.ledger.reserve(request))
            except ReservationError:
                return
            b_id, second = request.allocation_id, first
        else:
            b_id, _, second = data.draw(st.sampled_from(containers))
        try:
            self._run(self.ledger.exchange(a.node, (a_id, first), (b_id, second)))
            self.seen["exchanged"] += 1
        except ExchangeRefused:
            self.seen["exchange refused"] += 1

    @rule(now=st.integers(0, 2))
    def resync(self, now: int) -> None:
        """The extender reloads from the tables and each agent loads the binder's snapshot of its node (one time
        in three); from here on, these copies are fed the same events as the ones built from the stream."""
        if now:
            return
        self._feed()
        self.reloaded = ClusterView()
        self._run(self.reloaded.reload(self.engine))
        now = datetime.now(UTC)
        for node in NODES:
            view = NodeView(node)
            view.load(self._run(node_snapshot(self.engine, node, self.last_seq, now=now)))
            self.snapshots[node] = view
        self.seen["resync"] += 1

    # -- the check -------------------------------------------------------------------------------

    @invariant()
    def every_view_says_what_the_ledger_says(self) -> None:
        self._feed()
        live = self._run(ledger_tables(self.engine))
        diffs = differences(live, self.replayed)
        assert not diffs, "the ledger rebuilt from its events differs from its tables:\n" + "\n".join(diffs)
        says = ledger_says(live)
        assert ledger_says(self.replayed) == says
        for name, view in (("extender (events)", self.extender), ("extender (reloaded)", self.reloaded)):
            if view is not None:
                got = extender_says(view, says)
                wrong = {u: (got.get(u), s) for u, s in says.items() if got.get(u) != s}
                assert not wrong, f"{name} differs from the ledger (view, ledger): {wrong}"
                assert set(got) <= set(says)
        for node in NODES:
            held = {u: s.allocated for u, s in says.items() if s.node == node and s.allocated != (0, 0)}
            for name, views in (("agent (events)", self.agents), ("agent (snapshot)", self.snapshots)):
                if node in views:
                    assert agent_says(views[node]) == held, f"{name} on {node} differs from the ledger"


@pytest.fixture(scope="module")
def machine_env(database_url: str) -> Iterator[tuple[LoopThread, AsyncEngine]]:
    yield from ledger_env(database_url)


REACHED = (  # single steps any run of this size reaches (the scripted test walks the rarer histories)
    "reserved",
    "reserved with init containers",
    "reservation refused",
    "bound",
    "assigned",
    "terminating",
    "failed",
    "released",
    "exchanged",
    "exchange refused",
    "reported below allocated",
    "health",
    "health from another node",
    "node retired",
    "resync",
)


def test_every_view_says_what_the_ledger_says_about_every_gpu(machine_env: tuple[LoopThread, AsyncEngine]) -> None:
    runner, engine = machine_env
    ViewsMachine.runner, ViewsMachine.engine = runner, engine
    ViewsMachine.seen = Counter()
    run_state_machine_as_test(
        ViewsMachine, settings=machine_settings(2 * PROFILE.stateful_examples, 2 * PROFILE.stateful_steps)
    )
    missed = [case for case in REACHED if not ViewsMachine.seen[case]]
    assert not missed, f"the random runs never reached {missed}: {dict(ViewsMachine.seen)}"


def test_the_histories_the_views_once_told_apart(machine_env: tuple[LoopThread, AsyncEngine]) -> None:
    """The rarer histories, walked once each and checked after every step: a GPU holding shares that leaves the
    inventory and comes back (the extender's view forgot its counters), a failure after the Binding (the views
    gave the shares back, the ledger keeps them), memory and compute reported below what is held (the extender
    took the report and the agent's health flag), a health report from another node, an exchange onto the
    shrunken GPU, and a node retired and reported again."""
    runner, engine = machine_env
    ViewsMachine.runner, ViewsMachine.engine = runner, engine
    machine = ViewsMachine()
    machine.inventories()
    run, ledger, check = machine._run, machine.ledger, machine.every_view_says_what_the_ledger_says

    def reserve(pod: str, gpu: str, memory_gib: int, compute: int) -> Any:
        part = AllocationPart(
            container="main",
            container_index=0,
            gpu_uuid=gpu,
            gpu_index=int(gpu[-1]),
            memory_mib=memory_gib * GIB,
            compute=compute,
        )
        return run(ledger.reserve(ReservationRequest(pod, "team", pod, gpu[4:10], (part,))))

    def report(node: str, *gpus: tuple[int, int, int]) -> None:
        infos = [
            GpuInfo(uuid=_uuid(node, i), index=i, memory_mib=m * GIB, memory_total_mib=m * GIB, compute_units=c)
            for i, m, c in gpus
        ]
        run(ledger.record(InventoryEvent(node=node, cuda_version="12.4", gpus=infos)))

    one = reserve("one", _uuid("node-a", 1), 4, 30)
    check()
    report("node-a", (0, 16, 100))  # GPU 1 leaves the inventory with 4 GiB and 30 % held
    check()
    machine.resync(0)
    report("node-a", (0, 16, 100), (1, 16, 100))  # ... and comes back holding them
    check()
    run(ledger.mark_bound(one.allocation_id, "one", "node-a"))
    run(ledger.mark_failed(one.allocation_id, "one", "node-a", "late failure"))  # the Binding exists: no-op
    check()
    report("node-a", (0, 16, 100), (1, 2, 10))  # below what GPU 1 holds, in both dimensions
    check()
    run(ledger.record(HealthEvent(node="node-b", gpu_uuid=_uuid("node-a", 0), healthy=False, reason="XID 79")))
    check()
    two = reserve("two", _uuid("node-a", 0), 4, 30)
    run(ledger.exchange("node-a", (one.allocation_id, "main"), (two.allocation_id, "main")))
    machine.resync(0)
    check()
    three = reserve("three", _uuid("node-b", 0), 2, 0)
    run(ledger.retire_node("node-b"))
    check()
    report("node-b", (0, 16, 100), (1, 16, 100))
    check()
    assert machine.replayed.allocations[three.allocation_id].state.value == "released"
    assert machine.replayed.gpus[_uuid("node-a", 1)].health_reason == (
        "reported memory below allocated memory; reported compute below allocated compute"
    )
