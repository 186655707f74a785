"""kubelet's device reuse in the placement core: a regular GPU init container and the containers kubelet hands its
devices on to share GPUs, or the pod is refused at filter time with a reason that says why.

kubelet's device manager (k8s.io/kubernetes v1.37.2, pkg/kubelet/cm/devicemanager/manager.go) allocates init
containers first, then app containers (`ManagerImpl.Allocate`); `devicesToAllocate` takes a container's devices from
the pod's `devicesToReuse` first; a regular init container's devices are added to that set
(`podDevices.addContainerAllocatedResources`, pod_devices.go), an app container's or a sidecar's taken out
(`removeContainerAllocatedResources`). `reuse_groups` below is checked against a transcription of that bookkeeping
(`kubelet_takes`), run over device counts.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.placement import GpuView, NodeView, NoFit, Policy, evaluate, filter_nodes, parse_pod, pick
from shared.placement.reuse import reuse_groups
from shared.settings import MemoryUnit

GIB = 1024


def container(name: str, gib: int, *, count: int = 1, sidecar: bool = False) -> dict:
    out: dict = {"name": name, "resources": {"limits": {"aliyun.com/gpu-mem": str(gib * count)}}}
    if count > 1:
        out["resources"]["limits"]["aliyun.com/gpu-count"] = str(count)
    if sidecar:
        out["restartPolicy"] = "Always"
    return out


def pod(inits: list[dict], apps: list[dict]) -> dict:
    return {
        "metadata": {"uid": "u", "name": "p", "namespace": "ns"},
        "spec": {"initContainers": inits, "containers": apps},
    }


def node(*free_gib: int, capacity: int = 16, name: str = "n") -> NodeView:
    return NodeView(
        name, tuple(GpuView(f"g{i}", i, capacity * GIB, (capacity - f) * GIB) for i, f in enumerate(free_gib)), "12.2"
    )


def gpus_of(placement, name: str) -> set[str]:
    return {p.gpu_uuid for p in placement.parts if p.container == name}


def kubelet_takes(spec: dict) -> dict[str, int]:
    """How many devices each container takes from the pod's reusable ones: `ManagerImpl.Allocate` and
    `devicesToAllocate`'s `allocateRemainingFrom(reusableDevices)`, over counts (one resource)."""
    reusable = 0
    taken: dict[str, int] = {}
    inits = spec["spec"]["initContainers"]
    for i, c in enumerate([*inits, *spec["spec"]["containers"]]):
        needed = int(c["resources"]["limits"]["aliyun.com/gpu-mem"])
        take = min(needed, reusable)
        taken[c["name"]] = take
        if i < len(inits) and c.get("restartPolicy") != "Always":
            reusable += needed - take  # addContainerAllocatedResources: its devices join the reusable set
        else:
            reusable -= take  # removeContainerAllocatedResources: its devices leave it
    return taken


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 8), st.booleans()), max_size=4),
    st.lists(st.integers(1, 8), min_size=1, max_size=3),
)
def test_reuse_groups_are_the_containers_kubelet_hands_devices_on_to(inits, apps) -> None:
    spec = pod(
        [container(f"i{k}", gib, sidecar=side) for k, (gib, side) in enumerate(inits)],
        [container(f"a{k}", gib) for k, gib in enumerate(apps)],
    )
    taken = kubelet_takes(spec)
    grouped = {c.name: n for n, group in enumerate(reuse_groups(parse_pod(spec, MemoryUnit.GIB))) for c in group}
    for name, take in taken.items():
        if take:  # it takes devices another container of its group held before
            assert name in grouped, (name, taken, grouped)
    for group in reuse_groups(parse_pod(spec, MemoryUnit.GIB)):
        assert group[0].init and not group[0].sidecar
        assert all(taken[c.name] > 0 for c in group[1:]), (group, taken)


def test_the_app_container_goes_where_the_init_container_is() -> None:
    """GPU 0 has 6 GiB free, GPU 1 10 GiB. Binpack put the 4 GiB app container on GPU 0 and the 8 GiB init container,
    which does not fit there, on GPU 1; kubelet then hands the app container the init container's devices on GPU 1,
    and the agent refuses its Allocate. Both go to GPU 1 now."""
    demand = parse_pod(pod([container("setup", 8)], [container("main", 4)]), MemoryUnit.GIB)
    placement = pick(node(6, 10), demand, Policy.BINPACK)
    assert gpus_of(placement, "setup") == gpus_of(placement, "main") == {"g1"}
    assert evaluate(node(6, 10), demand).fits


def test_a_pod_whose_reuse_group_fits_no_single_gpu_is_refused_with_the_reason() -> None:
    """init 8 GiB, then two app containers of 6: the first takes 6 of the init container's devices, the second the
    other 2, so all three share a GPU and need 12 GiB there. Two GPUs with 10 GiB free each held them split before."""
    demand = parse_pod(pod([container("setup", 8)], [container("a", 6), container("b", 6)]), MemoryUnit.GIB)
    verdict = evaluate(node(10, 10), demand)
    assert not verdict.fits and verdict.resolvable
    assert "kubelet hands the GPU memory devices of init container setup on to container a, container b" in (
        verdict.reason
    )
    assert "must share a GPU" in verdict.reason
    ok, full, never = filter_nodes([node(10, 10, name="split"), node(12, 4, name="one")], demand)
    assert ok == ["one"] and list(full) == ["split"] and not never
    assert evaluate(node(10, 10, capacity=10), demand).resolvable is False  # 10 GiB GPUs: never


def test_an_app_container_after_the_pool_drained_goes_anywhere() -> None:
    """init 2, app a 2 (takes both devices: the pool is empty), app b 8: only a shares the init container's GPU."""
    demand = parse_pod(pod([container("setup", 2)], [container("a", 2), container("b", 8)]), MemoryUnit.GIB)
    assert [[c.name for c in g] for g in reuse_groups(demand)] == [["setup", "a"]]
    placement = pick(node(4, 9), demand)
    assert gpus_of(placement, "setup") == gpus_of(placement, "a")


def test_sidecar_and_app_share_the_init_containers_gpu() -> None:
    demand = parse_pod(
        pod([container("setup", 6), container("proxy", 4, sidecar=True)], [container("main", 8)]), MemoryUnit.GIB
    )
    assert [[c.name for c in g] for g in reuse_groups(demand)] == [["setup", "proxy", "main"]]
    placement = pick(node(8, 16), demand, Policy.SPREAD)
    assert gpus_of(placement, "setup") == gpus_of(placement, "proxy") == gpus_of(placement, "main")


def test_multi_gpu_groups_are_exact_only_when_kubelet_takes_the_whole_pool() -> None:
    wide = parse_pod(pod([container("setup", 4, count=2)], [container("train", 4, count=2)]), MemoryUnit.GIB)
    placement = pick(node(4, 16, 8, 16), wide)
    assert gpus_of(placement, "setup") == gpus_of(placement, "train") and len(gpus_of(placement, "train")) == 2

    part = parse_pod(pod([container("setup", 8, count=2)], [container("train", 2, count=2)]), MemoryUnit.GIB)
    verdict = evaluate(node(16, 16), part)
    assert not verdict.fits and not verdict.resolvable
    assert "gpushare cannot place this pod exactly" in verdict.reason and "picked in no set order" in verdict.reason
    try:
        pick(node(16, 16), part)
        raise AssertionError("placed a pod kubelet cannot be predicted for")
    except NoFit as exc:
        assert not exc.resolvable

    mixed = parse_pod(pod([container("setup", 4)], [container("train", 4, count=2)]), MemoryUnit.GIB)
    verdict = evaluate(node(16, 16), mixed)
    assert not verdict.resolvable and "give them the same aliyun.com/gpu-count" in verdict.reason
