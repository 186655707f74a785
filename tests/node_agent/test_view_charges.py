"""The GPU gauges' sum: `allocated_by_gpu` adds plain pods' shares directly and folds pods with init containers
through `gpu_charges`; both must give what `gpu_charges` gives for every pod (Kubernetes' effective request)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from services.node_agent.assignment import PendingContainer, Share
from services.node_agent.view import allocated_by_gpu
from shared.events.catalogue import AllocationPart
from shared.ledger.rules import gpu_charges

GPUS = ["GPU-a", "GPU-b", "GPU-c"]
# a container: (init, sidecar, [(gpu index, MiB)])
containers = st.tuples(
    st.booleans(), st.booleans(), st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8192)), min_size=1, max_size=3)
)
pods = st.lists(st.lists(containers, min_size=1, max_size=4), min_size=0, max_size=6)


def _view(spec: list[list[tuple[bool, bool, list[tuple[int, int]]]]]) -> list[PendingContainer]:
    view = []
    for p, pod in enumerate(spec):
        alloc = uuid.uuid4()
        for i, (init, sidecar, shares) in enumerate(pod):
            by_gpu: dict[int, int] = {}
            for gi, mib in shares:
                by_gpu[gi] = by_gpu.get(gi, 0) + mib
            view.append(
                PendingContainer(
                    allocation_id=alloc,
                    pod_uid=str(alloc),
                    namespace="ns",
                    pod_name=f"p{p}",
                    container=f"c{i}",
                    container_index=i,
                    init=init or sidecar,
                    sidecar=sidecar,
                    shares=tuple(Share(GPUS[gi], gi, mib, 0) for gi, mib in sorted(by_gpu.items())),
                    reserved_at=datetime.now(UTC),
                    pod_memory_mib=0,
                    pod_created_at=None,
                )
            )
    return view


@settings(max_examples=300, deadline=None)
@given(pods)
def test_allocated_by_gpu_is_the_sum_of_each_pods_effective_request(spec) -> None:  # type: ignore[no-untyped-def]
    view = _view(spec)
    expected: dict[str, int] = {}
    for alloc in {c.allocation_id for c in view}:
        parts = [
            AllocationPart(
                container=c.container,
                container_index=c.container_index,
                gpu_uuid=s.gpu_uuid,
                gpu_index=s.gpu_index,
                memory_mib=s.memory_mib,
                compute=s.compute,
                init=c.init,
                sidecar=c.sidecar,
            )
            for c in view
            if c.allocation_id == alloc
            for s in c.shares
        ]
        for gpu, (memory, _) in gpu_charges(parts).items():
            expected[gpu] = expected.get(gpu, 0) + memory
    assert allocated_by_gpu(view) == expected


def test_an_init_container_reuses_the_space_of_the_app_containers_after_it() -> None:
    """4 GiB init, then a 1 GiB app container on one GPU: Kubernetes charges max(4, 1) = 4 GiB, not 5."""
    view = _view([[(True, False, [(0, 4096)]), (False, False, [(0, 1024)])], [(False, False, [(0, 512)])]])
    assert allocated_by_gpu(view) == {"GPU-a": 4096 + 512}
