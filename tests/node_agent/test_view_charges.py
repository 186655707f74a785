"""The GPU gauges' sum: `allocated_by_gpu` adds plain pods' shares directly and folds pods with init containers
through `gpu_charges`; both must give what `gpu_charges` gives for every pod (Kubernetes' effective request)."""

from __future__ import annotations

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from services.node_agent.view import NodeView, allocated_by_gpu
from shared.events.catalogue import AllocationPart, ReservedEvent
from shared.ledger.rules import gpu_charges

NODE = "n1"
GPUS = ["GPU-a", "GPU-b", "GPU-c"]
# a container: (init, sidecar, [(gpu index, MiB)])
containers = st.tuples(
    st.booleans(), st.booleans(), st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8192)), min_size=1, max_size=3)
)
pods = st.lists(st.lists(containers, min_size=1, max_size=4), min_size=0, max_size=6)


def _reservations(spec: list[list[tuple[bool, bool, list[tuple[int, int]]]]]) -> list[ReservedEvent]:
    """One reservation per pod of `spec`; a container holds one share per GPU (its MiB there added up)."""
    events = []
    for p, pod in enumerate(spec):
        parts = []
        for i, (init, sidecar, shares) in enumerate(pod):
            by_gpu: dict[int, int] = {}
            for gi, mib in shares:
                by_gpu[gi] = by_gpu.get(gi, 0) + mib
            parts += [
                AllocationPart(
                    container=f"c{i}",
                    container_index=i,
                    gpu_uuid=GPUS[gi],
                    gpu_index=gi,
                    memory_mib=mib,
                    init=init or sidecar,
                    sidecar=sidecar,
                )
                for gi, mib in sorted(by_gpu.items())
            ]
        alloc = uuid.uuid4()
        events.append(
            ReservedEvent(
                allocation_id=alloc, pod_uid=str(alloc), namespace="ns", pod_name=f"p{p}", node=NODE, parts=parts
            )
        )
    return events


def _allocated(events: list[ReservedEvent]) -> dict[str, int]:
    """`allocated_by_gpu` over the node agent's view of these reservations."""
    view = NodeView(NODE)
    for event in events:
        view.apply(event)
    return allocated_by_gpu(view.containers())


@settings(max_examples=300, deadline=None)
@given(pods)
def test_allocated_by_gpu_is_the_sum_of_each_pods_effective_request(spec) -> None:  # type: ignore[no-untyped-def]
    events = _reservations(spec)
    expected: dict[str, int] = {}
    for event in events:
        for gpu, (memory, _) in gpu_charges(event.parts).items():
            expected[gpu] = expected.get(gpu, 0) + memory
    assert _allocated(events) == expected


def test_an_init_container_reuses_the_space_of_the_app_containers_after_it() -> None:
    """4 GiB init, then a 1 GiB app container on one GPU: Kubernetes charges max(4, 1) = 4 GiB, not 5."""
    events = _reservations([[(True, False, [(0, 4096)]), (False, False, [(0, 1024)])], [(False, False, [(0, 512)])]])
    assert _allocated(events) == {"GPU-a": 4096 + 512}
