"""An exchange moves shares between GPUs: the extender's view must move them exactly as the ledger does.

The pair below makes the move visible per GPU: each pod holds an app share and an init share, and only the
init shares trade places, so Kubernetes' effective-request rule charges each GPU differently afterwards
(before: 4 GiB on each GPU; after: 8 GiB on GPU 0, 6 GiB on GPU 1).
"""

from __future__ import annotations

import asyncio
import uuid

from services.extender.service import ExtenderService
from services.extender.view import ClusterView
from shared.events.catalogue import AllocationPart, ExchangedEvent, GpuInfo, InventoryEvent, ReservedEvent
from shared.ledger.ledger import Ledger
from shared.ledger.replay import load_state
from shared.ledger.reservations import ReservationRequest
from shared.ledger.rules import gpu_charges
from shared.ledger.state import LedgerState
from tests.extender.conftest import add_node

NODE = "swap"
G0, G1 = f"GPU-{NODE}-0", f"GPU-{NODE}-1"


def _part(container: str, index: int, gpu: int, mib: int, *, init: bool = False) -> AllocationPart:
    return AllocationPart(
        container=container, container_index=index, gpu_uuid=(G0, G1)[gpu], gpu_index=gpu, memory_mib=mib, init=init
    )


# pod a: app 4 GiB + init 4 GiB on GPU 0; pod b: app 2 GiB + init 4 GiB on GPU 1
PARTS_A = (_part("a-main", 0, 0, 4096), _part("a-init", 0, 0, 4096, init=True))
PARTS_B = (_part("b-main", 0, 1, 2048), _part("b-init", 0, 1, 4096, init=True))


def _used(view: ClusterView) -> dict[str, int]:
    return {g.uuid: g.allocated_memory_mib for g in view.nodes[NODE].gpus}


def _ledger_used(state: LedgerState) -> dict[str, int]:
    return {u: g.allocated_memory_mib for u, g in state.gpus.items() if g.node == NODE and not g.retired}


def _charges(view: ClusterView) -> dict[str, dict[str, tuple[int, int]]]:
    return {uid: a.charges for uid, a in view.allocations.items() if a.node == NODE}


def _ledger_charges(state: LedgerState) -> dict[str, dict[str, tuple[int, int]]]:
    return {a.pod_uid: gpu_charges(a.parts) for a in state.allocations.values() if a.node == NODE}


def test_the_view_applies_an_exchange_as_a_ledger_replay_does() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    events = [
        InventoryEvent(
            node=NODE,
            cuda_version="12.2",
            gpus=[GpuInfo(uuid=u, index=i, memory_mib=16384, memory_total_mib=16384) for i, u in enumerate((G0, G1))],
        ),
        ReservedEvent(allocation_id=a, pod_uid="uid-a", namespace="team", pod_name="a", node=NODE, parts=PARTS_A),
        ReservedEvent(allocation_id=b, pod_uid="uid-b", namespace="team", pod_name="b", node=NODE, parts=PARTS_B),
        ExchangedEvent(
            node=NODE,
            first_allocation_id=a,
            first_container="a-init",
            second_allocation_id=b,
            second_container="b-init",
        ),
    ]
    view, state = ClusterView(), LedgerState()
    for event in events[:-1]:
        view.apply(event)
        state.apply(event)
    assert _used(view) == _ledger_used(state) == {G0: 4096, G1: 4096}
    version = view.version
    view.apply(events[-1])
    state.apply(events[-1])
    assert _used(view) == _ledger_used(state) == {G0: 8192, G1: 6144}
    assert _charges(view) == _ledger_charges(state)
    assert view.namespace_usage("team") == (8192 + 6144, 0)
    assert sorted(x.pod_uid for x in view.pods_on(NODE, G1)) == ["uid-a", "uid-b"]
    assert view.version > version  # cached scores of the old placement are not reused
    view.apply(events[-1])  # a re-published exchange (an outbox relay retried) was applied once in the ledger
    assert _used(view) == {G0: 8192, G1: 6144} and _charges(view) == _ledger_charges(state)


async def test_the_view_follows_an_exchange_through_the_bus_as_the_ledger_wrote_it(
    ledger: Ledger, service: ExtenderService
) -> None:
    await add_node(ledger, NODE, [16, 16])
    first = await ledger.reserve(ReservationRequest("uid-a", "team", "a", NODE, PARTS_A))
    second = await ledger.reserve(ReservationRequest("uid-b", "team", "b", NODE, PARTS_B))
    await ledger.exchange(NODE, (first.allocation_id, "a-init"), (second.allocation_id, "b-init"))
    async with service.engine.connect() as conn:
        written = await load_state(conn)
    assert _ledger_used(written) == {G0: 8192, G1: 6144}
    for _ in range(100):  # the running service follows the ledger's events on the bus
        if NODE in service.view.nodes and _used(service.view) == _ledger_used(written):
            break
        await asyncio.sleep(0.05)
    assert _used(service.view) == _ledger_used(written)
    assert _charges(service.view) == _ledger_charges(written)
    reloaded = ClusterView()
    await reloaded.reload(service.engine)
    assert _used(reloaded) == _used(service.view) and _charges(reloaded) == _charges(service.view)
