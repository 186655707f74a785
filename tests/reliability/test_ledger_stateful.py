"""Races and life cycles: a hypothesis state machine drives the real ledger (PostgreSQL) through random
reserve / DRA claim / bind / assign / release / fail / exchange / inventory / health / quota steps.

After every step: no GPU is over capacity, each GPU's counters equal the charges of the live parts on it
(`gpu_charges`), a pod has at most one live allocation, and the database equals the pure model
(`LedgerState`) fed the events the ledger staged in its outbox. Reservation outcomes are also predicted
independently from the model (created / existing / quota exceeded / insufficient capacity; for a DRA claim, whose
quota was taken at its creation, also refused for its claim or pod, and a path conflict with an extender share)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from hypothesis import event as hypothesis_event
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

from shared.events.catalogue import (
    AllocationPart,
    ClaimReservedEvent,
    ClaimResult,
    GpuInfo,
    HealthEvent,
    InventoryEvent,
    QuotaEvent,
)
from shared.ledger.claims import ClaimAllocationEnded, PathConflict
from shared.ledger.ledger import Ledger
from shared.ledger.replay import differences
from shared.ledger.reservations import InsufficientCapacity, QuotaExceeded, ReservationError, ReservationRequest
from shared.ledger.rules import ExchangeRefused, gpu_charges, is_live
from shared.ledger.state import LedgerState
from tests.reliability.loop import LoopThread, empty_ledger, ledger_env, ledger_tables, machine_settings, staged_events
from tests.reliability.profile import PROFILE

NODES = ("node-a", "node-b")
DRA_NODE = "node-dra"  # its shares come from claims (Ledger.reserve_claim)
GPU_MIB = 16 * 1024
NAMESPACES = ("team-a", "team-b")
SIZES_MIB = (0, 512, 1024, 2048, 4096, 8192, 12288)
COMPUTE = (0, 10, 25, 50, 100)
# Flip to True once shared/ledger/inventory.py keeps a GPU whose reported memory fell below its allocations.
SHRINK_BELOW_ALLOCATED = True


def _gpu(node: str, index: int, memory_mib: int = GPU_MIB, healthy: bool = True) -> GpuInfo:
    return GpuInfo(
        uuid=f"GPU-{node}-{index}",
        index=index,
        model="Tesla-T4",
        memory_mib=memory_mib,
        memory_total_mib=max(memory_mib, GPU_MIB),
        healthy=healthy,
    )


class LedgerMachine(RuleBasedStateMachine):
    """The real ledger against its pure model."""

    runner: LoopThread
    engine: AsyncEngine
    invariant_checks = 0  # times `ledger_holds` compared the database with the model, over every run

    def __init__(self) -> None:
        super().__init__()
        self.runner.run(empty_ledger(self.engine))
        self.ledger = Ledger(self.engine, prefix="gsrel", source="stateful")
        self.model = LedgerState()
        self.last_seq = 0
        self.pods: list[str] = []
        # ids from a counter, not uuid4: what a step draws from may depend on their order (`_live` sorts by
        # id), and hypothesis needs the same choices to lead to the same state when it replays a run
        self._next_id = 0
        self.claims: list[ClaimReservedEvent] = []  # claim allocations recorded (to repeat or to reuse their ids)

    # -- helpers ---------------------------------------------------------------------------------

    async def _drain_outbox(self) -> int:
        staged = await staged_events(self.engine, self.last_seq)
        for seq, event in staged:
            self.model.apply(event)
            self.last_seq = seq
        return len(staged)

    def _staged(self) -> int:
        """Feed the model what the last step staged; returns how many events that was."""
        return self.runner.run(self._drain_outbox())

    def _new_id(self) -> uuid.UUID:
        self._next_id += 1
        return uuid.UUID(int=self._next_id)

    def _live(self) -> list[tuple[uuid.UUID, object]]:
        return [(a_id, a) for a_id, a in sorted(self.model.allocations.items(), key=lambda kv: str(kv[0]))]

    def _predict_reserve(
        self, pod_uid: str, namespace: str, node: str, parts: list[AllocationPart], *, quota_checked: bool = True
    ) -> str:
        if pod_uid in self.model.live_by_pod:
            return "existing"
        charges = gpu_charges(parts)
        memory = sum(m for m, _ in charges.values())
        compute = sum(c for _, c in charges.values())
        quota = self.model.quotas.get(namespace) if quota_checked else None
        if quota is not None:
            used_m = sum(
                a.memory_mib for a in self.model.allocations.values() if a.namespace == namespace and is_live(a.state)
            )
            used_c = sum(
                a.compute for a in self.model.allocations.values() if a.namespace == namespace and is_live(a.state)
            )
            if quota[0] is not None and used_m + memory > quota[0]:
                return "quota"
            if quota[1] is not None and used_c + compute > quota[1]:
                return "quota"
        for gpu_uuid, (m, c) in charges.items():
            gpu = self.model.gpus.get(gpu_uuid)
            if (
                gpu is None
                or gpu.node != node
                or not gpu.healthy
                or gpu.retired
                or gpu.allocated_memory_mib + m > gpu.memory_mib
                or gpu.allocated_compute + c > gpu.compute_units
            ):
                return "capacity"
        return "created"

    def _predict_claim(self, event: ClaimReservedEvent) -> str:
        known = self.model.allocations.get(event.allocation_id)
        if known is not None:
            return "existing" if is_live(known.state) else "ended"
        if any(a.claim_uid == event.claim_uid and is_live(a.state) for a in self.model.allocations.values()):
            return "refused"
        if event.pod_uid in self.model.live_by_pod:
            return "refused"
        # a claim took its namespace's quota when it was created (gpushare admission): its record checks capacity
        outcome = self._predict_reserve(
            event.pod_uid, event.namespace, event.node, list(event.parts), quota_checked=False
        )
        if outcome != "created":
            return outcome
        gpus = {p.gpu_uuid for p in event.parts}
        for a in self.model.allocations.values():
            if is_live(a.state) and a.claim_uid is None and any(p.gpu_uuid in gpus for p in a.parts):
                return "conflict"
        return "created"

    # -- rules -----------------------------------------------------------------------------------

    @initialize()
    def inventory(self) -> None:
        for node in NODES:
            self.runner.run(
                self.ledger.record(
                    InventoryEvent(node=node, driver_version="550", gpus=[_gpu(node, i) for i in range(2)])
                )
            )
        assert self._staged() == len(NODES)

    @initialize()
    def dra_inventory(self) -> None:
        gpus = [_gpu(DRA_NODE, i) for i in range(2)]
        self.runner.run(self.ledger.record(InventoryEvent(node=DRA_NODE, gpus=gpus, allocator="dra")))
        assert self._staged() == 1

    @rule(
        data=st.data(),
        namespace=st.sampled_from(NAMESPACES),
        reuse=st.sampled_from(("none", "pod", "claim", "event")),
        count=st.integers(1, 2),
        with_init=st.booleans(),
    )
    def reserve_claim(self, data: st.DataObject, namespace: str, reuse: str, count: int, with_init: bool) -> None:
        """What the binder records for a claim kube-scheduler allocated on the DRA node (shares of one container,
        `count` GPUs, and with an init container's share held beside it, as `shared.dra.claims` records it)."""
        if reuse == "event" and self.claims:
            event = data.draw(st.sampled_from(self.claims))
        else:
            previous = data.draw(st.sampled_from(self.claims)) if reuse in ("pod", "claim") and self.claims else None
            pod_uid = previous.pod_uid if previous is not None and reuse == "pod" else str(self._new_id())
            claim_uid = previous.claim_uid if previous is not None and reuse == "claim" else str(self._new_id())
            gpus = data.draw(st.permutations([f"GPU-{DRA_NODE}-0", f"GPU-{DRA_NODE}-1"]))[:count]
            parts = [
                AllocationPart(
                    container="main",
                    container_index=0,
                    gpu_uuid=g,
                    gpu_index=int(g.rsplit("-", 1)[1]),
                    memory_mib=data.draw(st.sampled_from(SIZES_MIB[1:])),
                    compute=data.draw(st.sampled_from(COMPUTE)),
                )
                for g in gpus
            ]
            if with_init:
                g = gpus[0]
                parts.append(
                    AllocationPart(
                        container="setup",
                        container_index=0,
                        init=True,
                        sidecar=True,
                        gpu_uuid=g,
                        gpu_index=int(g.rsplit("-", 1)[1]),
                        memory_mib=data.draw(st.sampled_from(SIZES_MIB[1:])),
                    )
                )
            event = ClaimReservedEvent(
                allocation_id=self._new_id(),
                pod_uid=pod_uid,
                namespace=namespace,
                pod_name=f"pod-{pod_uid[-6:]}",
                node=DRA_NODE,
                parts=parts,
                claim_uid=claim_uid,
                claim_name=f"claim-{claim_uid[-6:]}",
                results=[ClaimResult(request="r", device=f"dev-{i}", share_id=str(i)) for i in range(len(parts))],
            )
        expected = self._predict_claim(event)
        try:
            result = self.runner.run(self.ledger.reserve_claim(event))
            outcome = "created" if result.created else "existing"
        except QuotaExceeded:
            outcome = "quota"
        except InsufficientCapacity:
            outcome = "capacity"
        except PathConflict:
            outcome = "conflict"
        except ClaimAllocationEnded:
            outcome = "ended"
        except ReservationError:
            outcome = "refused"
        hypothesis_event(f"claim {outcome}")
        assert outcome == expected, f"claim {event.claim_uid}: ledger said {outcome}, model predicted {expected}"
        assert self._staged() == (1 if outcome == "created" else 0)
        if outcome == "created":
            self.claims.append(event)

    @rule(data=st.data(), memory=st.sampled_from(SIZES_MIB[1:4]))
    def stray_extender_share(self, data: st.DataObject, memory: int) -> None:
        """A share the extender path placed on a GPU of the DRA node (the extender refuses DRA nodes, but the ledger
        must stay exact, and claims must not join such a GPU)."""
        g = data.draw(st.sampled_from([f"GPU-{DRA_NODE}-0", f"GPU-{DRA_NODE}-1"]))
        part = AllocationPart(container="c0", container_index=0, gpu_uuid=g, gpu_index=int(g[-1]), memory_mib=memory)
        pod_uid = str(self._new_id())
        expected = self._predict_reserve(pod_uid, "team-a", DRA_NODE, [part])
        request = ReservationRequest(pod_uid, "team-a", "stray", DRA_NODE, (part,), allocation_id=self._new_id())
        try:
            self.runner.run(self.ledger.reserve(request))
            outcome = "created"
        except QuotaExceeded:
            outcome = "quota"
        except InsufficientCapacity:
            outcome = "capacity"
        assert outcome == expected
        self._staged()

    @rule(
        data=st.data(),
        node=st.sampled_from(NODES),
        namespace=st.sampled_from(NAMESPACES),
        reuse_pod=st.booleans(),
        containers=st.integers(1, 2),
        multi_gpu=st.booleans(),
        with_init=st.booleans(),
        with_sidecar=st.booleans(),
        sidecar_first=st.booleans(),
    )
    def reserve(
        self,
        data: st.DataObject,
        node: str,
        namespace: str,
        reuse_pod: bool,
        containers: int,
        multi_gpu: bool,
        with_init: bool,
        with_sidecar: bool,
        sidecar_first: bool,
    ) -> None:
        pod_uid = data.draw(st.sampled_from(self.pods)) if reuse_pod and self.pods else str(self._new_id())
        gpu_uuids = [u for u, g in sorted(self.model.gpus.items()) if g.node == node] or [f"GPU-{node}-0"]
        parts: list[AllocationPart] = []
        inits = [("init", False)] if with_init else []
        if with_sidecar:  # an init container with restartPolicy Always, before or after the regular one
            inits.insert(0 if sidecar_first else len(inits), ("side", True))
        specs = [(f"c{i}", i, False, False) for i in range(containers)]
        specs += [(name, index, True, sidecar) for index, (name, sidecar) in enumerate(inits)]
        for name, index, init, sidecar in specs:
            count = 2 if multi_gpu and len(gpu_uuids) > 1 else 1
            chosen = data.draw(st.permutations(gpu_uuids))[:count]
            for gpu_uuid in chosen:
                parts.append(
                    AllocationPart(
                        container=name,
                        container_index=index,
                        init=init,
                        sidecar=sidecar,
                        gpu_uuid=gpu_uuid,
                        gpu_index=int(gpu_uuid.rsplit("-", 1)[1]),
                        memory_mib=data.draw(st.sampled_from(SIZES_MIB)),
                        compute=data.draw(st.sampled_from(COMPUTE)),
                    )
                )
        expected = self._predict_reserve(pod_uid, namespace, node, parts)
        request = ReservationRequest(
            pod_uid=pod_uid,
            namespace=namespace,
            pod_name=f"pod-{pod_uid[-6:]}",
            node=node,
            parts=tuple(parts),
            allocation_id=self._new_id(),
        )
        try:
            result = self.runner.run(self.ledger.reserve(request))
            outcome = "created" if result.created else "existing"
        except QuotaExceeded:
            outcome = "quota"
        except InsufficientCapacity:
            outcome = "capacity"
        assert outcome == expected, f"reserve {pod_uid} on {node}: ledger said {outcome}, model predicted {expected}"
        staged = self._staged()
        assert staged == (1 if outcome == "created" else 0)
        if outcome == "created" and pod_uid not in self.pods:
            self.pods.append(pod_uid)

    def _pick(self, data: st.DataObject):  # type: ignore[no-untyped-def]
        a_id, alloc = data.draw(st.sampled_from(self._live()))
        return a_id, alloc

    @precondition(lambda self: bool(self.model.allocations))
    @rule(data=st.data())
    def bind(self, data: st.DataObject) -> None:
        a_id, alloc = self._pick(data)
        self.runner.run(self.ledger.mark_bound(a_id, alloc.pod_uid, alloc.node))
        assert self._staged() <= 1  # one event, or none when the write changed nothing (the replay check holds it)

    @precondition(lambda self: bool(self.model.allocations))
    @rule(data=st.data())
    def assign(self, data: st.DataObject) -> None:
        a_id, alloc = self._pick(data)
        part = data.draw(st.sampled_from(alloc.parts))
        gpus = sorted({p.gpu_uuid for p in alloc.parts if p.container == part.container})
        self.runner.run(self.ledger.mark_assigned(a_id, alloc.pod_uid, alloc.node, part.container, gpus))
        assert self._staged() == 1

    @precondition(lambda self: bool(self.model.allocations))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        a_id, alloc = self._pick(data)
        was_live = is_live(alloc.state)
        changed = self.runner.run(self.ledger.release(a_id, alloc.pod_uid, alloc.node, "pod deleted"))
        assert changed == was_live
        self._staged()

    @precondition(lambda self: bool(self.model.allocations))
    @rule(data=st.data())
    def terminating(self, data: st.DataObject) -> None:
        _, alloc = self._pick(data)
        expected = sum(
            1
            for a in self.model.allocations.values()
            if a.pod_uid == alloc.pod_uid and is_live(a.state) and a.terminating_at is None
        )
        marked = self.runner.run(self.ledger.mark_terminating(alloc.pod_uid))
        assert marked == expected, "a live allocation is marked once; its share stays held"
        assert self._staged() == expected

    @precondition(lambda self: bool(self.model.allocations))
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        a_id, alloc = self._pick(data)
        expected = alloc.state.value == "reserved"
        changed = self.runner.run(self.ledger.mark_failed(a_id, alloc.pod_uid, alloc.node, "binding refused"))
        assert changed == expected
        self._staged()

    @precondition(lambda self: len(self.model.allocations) >= 2)
    @rule(data=st.data())
    def exchange(self, data: st.DataObject) -> None:
        live = [(a_id, a) for a_id, a in self._live() if is_live(a.state)]
        if len(live) < 2:
            return
        (a_id, a), (b_id, b) = data.draw(st.permutations(live))[:2]
        first = data.draw(st.sampled_from(sorted({p.container for p in a.parts})))
        second = data.draw(st.sampled_from(sorted({p.container for p in b.parts})))
        before = self.model.copy().canonical()
        try:
            self.runner.run(self.ledger.exchange(a.node, (a_id, first), (b_id, second)))
        except ExchangeRefused:
            assert self._staged() == 0
            assert self.model.canonical() == before
            return
        assert a.node == b.node, "an exchange across nodes was accepted"
        assert self._staged() == 1

    @rule(node=st.sampled_from(NODES), keep=st.integers(1, 3), shrink=st.booleans(), data=st.data())
    def inventory_change(self, node: str, keep: int, shrink: bool, data: st.DataObject) -> None:
        gpus = [_gpu(node, i) for i in range(keep)]
        if shrink:
            memory = data.draw(st.sampled_from((2048, 8192)))
            current = self.model.gpus.get(gpus[0].uuid)
            allocated = current.allocated_memory_mib if current is not None else 0
            # Reporting less memory than is allocated crashes apply_inventory (see
            # test_inventory_shrinking_below_allocated_memory_keeps_the_gpu); only shrink above it.
            if allocated <= memory or SHRINK_BELOW_ALLOCATED:
                gpus[0] = _gpu(node, 0, memory_mib=memory)
        self.runner.run(self.ledger.record(InventoryEvent(node=node, driver_version="551", gpus=gpus)))
        assert self._staged() == 1

    @rule(node=st.sampled_from(NODES), index=st.integers(0, 2), healthy=st.booleans())
    def health_change(self, node: str, index: int, healthy: bool) -> None:
        event = HealthEvent(
            node=node, gpu_uuid=f"GPU-{node}-{index}", healthy=healthy, reason="" if healthy else "XID 79"
        )
        self.runner.run(self.ledger.record(event))
        assert self._staged() == 1

    @rule(
        namespace=st.sampled_from(NAMESPACES),
        memory=st.one_of(st.none(), st.sampled_from((0, 4096, 16384, 40960))),
        compute=st.one_of(st.none(), st.sampled_from((0, 50, 200))),
    )
    def quota_set(self, namespace: str, memory: int | None, compute: int | None) -> None:
        self.runner.run(self.ledger.record(QuotaEvent(namespace=namespace, memory_mib=memory, compute=compute)))
        assert self._staged() == 1

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def ledger_holds(self) -> None:
        live_state = self.runner.run(ledger_tables(self.engine))
        for gpu_uuid, gpu in live_state.gpus.items():
            assert 0 <= gpu.allocated_memory_mib <= gpu.memory_mib, f"GPU {gpu_uuid} memory overcommitted: {gpu}"
            assert 0 <= gpu.allocated_compute <= gpu.compute_units, f"GPU {gpu_uuid} compute overcommitted: {gpu}"
        expected: dict[str, list[int]] = {u: [0, 0] for u in live_state.gpus}
        live_pods: dict[str, int] = {}
        for alloc in live_state.allocations.values():
            if not is_live(alloc.state):
                continue
            live_pods[alloc.pod_uid] = live_pods.get(alloc.pod_uid, 0) + 1
            for gpu_uuid, (m, c) in gpu_charges(alloc.parts).items():
                expected[gpu_uuid][0] += m
                expected[gpu_uuid][1] += c
        for gpu_uuid, gpu in live_state.gpus.items():
            assert [gpu.allocated_memory_mib, gpu.allocated_compute] == expected[gpu_uuid], (
                f"GPU {gpu_uuid} counters {gpu.allocated_memory_mib}/{gpu.allocated_compute} "
                f"!= live parts {expected[gpu_uuid]}"
            )
        assert all(n == 1 for n in live_pods.values()), f"pods with several live allocations: {live_pods}"
        diffs = differences(live_state, self.model)
        assert not diffs, "database differs from the model:\n" + "\n".join(diffs)
        LedgerMachine.invariant_checks += 1


@pytest.fixture(scope="module")
def machine_env(database_url: str) -> Iterator[tuple[LoopThread, AsyncEngine]]:
    yield from ledger_env(database_url)


def test_ledger_matches_its_model_under_random_operations(machine_env: tuple[LoopThread, AsyncEngine]) -> None:
    runner, engine = machine_env
    LedgerMachine.runner, LedgerMachine.engine = runner, engine
    LedgerMachine.invariant_checks = 0
    run_state_machine_as_test(
        LedgerMachine, settings=machine_settings(PROFILE.stateful_examples, PROFILE.stateful_steps)
    )
    # each step's rule asserts what the ledger answered; `ledger_holds` compared the tables with the model after each
    assert LedgerMachine.invariant_checks > 0, "the ledger was never compared with its model"
