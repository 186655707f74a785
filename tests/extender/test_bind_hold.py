"""While the ledger decides a bind, the extender's view holds the picked shares (as kube-scheduler assumes a pod);
whatever the ledger answers, the view must then say what the ledger holds, not what the bind hoped for."""

from __future__ import annotations

import uuid

import httpx

from services.extender.service import ExtenderService
from services.extender.view import ClusterView
from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent, ReservedEvent
from shared.ledger.ledger import Ledger
from shared.ledger.reservations import ReservationRequest
from tests.extender.conftest import PREFIX, add_node, bind_args, gpu_pod, names_args
from tests.waiting import eventually


def _used(view: ClusterView) -> dict[str, tuple[int, int]]:
    return {g.uuid: (g.allocated_memory_mib, g.allocated_compute) for n in view.nodes.values() for g in n.gpus}


def _part(node: str, mib: int) -> AllocationPart:
    return AllocationPart(container="main", container_index=0, gpu_uuid=f"GPU-{node}-0", gpu_index=0, memory_mib=mib)


async def test_a_bind_that_finds_the_pod_reserved_on_another_node_leaves_the_view_as_the_ledger(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService
) -> None:
    """Before: the hold on n1 replaced the pod's real allocation on n2 in the view and stayed there when the bind
    was refused, so n1 showed 4 GiB nobody holds and n2 missed 4 GiB until the next resync (30 s)."""
    await add_node(ledger, "n1", [16])
    await add_node(ledger, "n2", [16])
    await service.resync("test")
    pod = gpu_pod("p", 4)
    uid = pod["metadata"]["uid"]
    real = await ledger.reserve(ReservationRequest(uid, "default", "p", "n2", (_part("n2", 4096),)))  # another replica
    await eventually(lambda: uid in service.view.allocations, what="the view to count the reservation on n2")
    assert _used(service.view) == {"GPU-n1-0": (0, 0), "GPU-n2-0": (4096, 0)}
    await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    answer = (await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json()["Error"]
    assert answer == "pod already holds a reservation on node n2, not n1"
    assert _used(service.view) == {"GPU-n1-0": (0, 0), "GPU-n2-0": (4096, 0)}
    held = service.view.allocations[uid]
    assert (held.allocation_id, held.node, held.charges) == (real.allocation_id, "n2", {"GPU-n2-0": (4096, 0)})
    assert service.view.namespace_usage("default") == (4096, 0)


def test_a_hold_counts_beside_the_pods_allocation_until_the_ledger_settles_it() -> None:
    view = ClusterView()
    view.apply(
        InventoryEvent(node="n1", gpus=[GpuInfo(uuid="GPU-n1-0", index=0, memory_mib=8192, memory_total_mib=8192)])
    )
    first, second = uuid.uuid4(), uuid.uuid4()
    view.hold(first, "p", "team", "p", "n1", (_part("n1", 2048),))
    assert _used(view) == {"GPU-n1-0": (2048, 0)} and view.namespace_usage("team") == (2048, 0)
    assert "p" not in view.allocations  # not the pod's allocation until the ledger says so
    view.apply(
        ReservedEvent(
            allocation_id=first, pod_uid="p", namespace="team", pod_name="p", node="n1", parts=[_part("n1", 2048)]
        )
    )
    assert _used(view) == {"GPU-n1-0": (2048, 0)} and view.allocations["p"].allocation_id == first
    view.hold(second, "p", "team", "p", "n1", (_part("n1", 4096),))  # a retried bind: counted beside it
    assert _used(view) == {"GPU-n1-0": (6144, 0)} and view.namespace_usage("team") == (6144, 0)
    view.release_hold(second)  # the ledger answered with `first`
    view.release_hold(second)
    assert _used(view) == {"GPU-n1-0": (2048, 0)} and view.namespace_usage("team") == (2048, 0)
    assert view.allocations["p"].allocation_id == first
