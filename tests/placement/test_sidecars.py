"""Today's pod rules in the placement core: sidecar containers (init containers with `restartPolicy: Always`)
and scheduling gates.

Kubernetes (component-helpers `PodRequests`, 1.29+) sums a sidecar with the app containers and with every
regular init container that starts after it. `kubernetes_request` below is that Go function transcribed line
by line; the ledger's rule (`effective_request`, applied per GPU by `gpu_charges`) must agree with it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.ledger.rules import effective_request, gpu_charges
from shared.placement import DemandError, GpuView, NodeView, NoFit, Policy, evaluate, parse_pod, pick
from shared.settings import MemoryUnit

GIB = MemoryUnit.GIB


def kubernetes_request(apps: list[int], inits: list[tuple[int, bool]]) -> int:
    """`aggregateContainerResourcesByFn` (k8s.io/component-helpers/resource/helpers.go, v0.37.2), one resource."""
    result = sum(apps)
    restartable_init_resources = 0
    init_container_resources = 0
    for amount, restartable in inits:
        if restartable:
            result += amount
            restartable_init_resources += amount
            container_resources = restartable_init_resources
        else:
            container_resources = amount + restartable_init_resources
        init_container_resources = max(init_container_resources, container_resources)
    return max(result, init_container_resources)


def gpu_container(name: str, gib: int, *, core: int = 0, count: int = 1, sidecar: bool = False) -> dict:
    limits = {"aliyun.com/gpu-mem": str(gib * count)}
    if core:
        limits["aliyun.com/gpu-core"] = str(core * count)
    if count > 1:
        limits["aliyun.com/gpu-count"] = str(count)
    c = {"name": name, "image": "x", "resources": {"limits": limits}}
    if sidecar:
        c["restartPolicy"] = "Always"
    return c


def pod(apps: list[dict], inits: list[dict] | None = None, *, uid: str = "u1", **spec: object) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": uid},
        "spec": {"containers": apps, "initContainers": inits or None, **spec},
    }


def one_gpu(free_gib: int, capacity_gib: int = 16) -> NodeView:
    cap = capacity_gib * 1024
    return NodeView("n1", (GpuView("g0", 0, cap, cap - free_gib * 1024),), cuda_version="12.2")


amounts = st.integers(0, 40)
init_lists = st.lists(st.tuples(amounts, st.booleans()), max_size=6)


@settings(max_examples=500, deadline=None)
@given(st.lists(amounts, max_size=5), init_lists)
def test_effective_request_is_kubernetes_pod_request(apps: list[int], inits: list[tuple[int, bool]]) -> None:
    assert effective_request(sum(apps), inits) == kubernetes_request(apps, inits)


@st.composite
def sidecar_pods(draw: st.DrawFn) -> dict:
    def one(name: str, init: bool) -> dict:
        return gpu_container(
            name,
            draw(st.integers(1, 8)),
            core=draw(st.sampled_from([0, 0, 10, 30])),
            count=draw(st.sampled_from([1, 1, 2])),
            sidecar=init and draw(st.booleans()),
        )

    apps = [one(f"c{i}", False) for i in range(draw(st.integers(1, 3)))]
    inits = [one(f"i{i}", True) for i in range(draw(st.integers(0, 4)))]
    return pod(apps, inits)


@settings(max_examples=300, deadline=None)
@given(sidecar_pods())
def test_a_pods_effective_request_is_kubernetes_pod_request(spec: dict) -> None:
    demand = parse_pod(spec, GIB)
    inits = [(c.total_memory_mib, c.sidecar) for c in demand.init_containers]
    assert demand.memory_mib == kubernetes_request([c.total_memory_mib for c in demand.containers], inits)
    inits = [(c.total_compute, c.sidecar) for c in demand.init_containers]
    assert demand.compute == kubernetes_request([c.total_compute for c in demand.containers], inits)


@settings(max_examples=300, deadline=None)
@given(sidecar_pods(), st.sampled_from(list(Policy)))
def test_a_gpu_is_charged_what_kubernetes_counts_and_never_less_overall(spec: dict, policy: Policy) -> None:
    # on a single GPU the ledger's per-GPU charge is exactly Kubernetes' pod request
    single = pod(
        [{**c, "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}} for c in spec["spec"]["containers"]],
        [{**c, "resources": {"limits": {"aliyun.com/gpu-mem": "2"}}} for c in spec["spec"]["initContainers"] or []],
    )
    demand = parse_pod(single, GIB)
    placed = pick(one_gpu(80, 80), demand, policy)
    assert gpu_charges(placed.parts) == {"g0": (demand.memory_mib, demand.compute)}
    # over several GPUs the charges add up to at least what kubelet counts for the pod
    demand = parse_pod(spec, GIB)
    gpus = tuple(GpuView(f"g{i}", i, 40 * 1024, 0) for i in range(4))
    try:
        placed = pick(NodeView("n4", gpus), demand, policy)
    except NoFit:
        return
    charges = gpu_charges(placed.parts)
    assert sum(m for m, _ in charges.values()) >= demand.memory_mib
    assert all(m <= 40 * 1024 and k <= 100 for m, k in charges.values())
    sidecar = {c.name: c.sidecar for c in demand.init_containers}
    assert all(p.sidecar == sidecar[p.container] for p in placed.parts if p.init)
    assert not any(p.sidecar for p in placed.parts if not p.init)


def test_a_sidecar_holds_its_share_beside_the_app_so_the_gpu_is_not_overcommitted() -> None:
    # the task's example: a 4 GiB sidecar and an 8 GiB app container on a 16 GiB GPU hold 12 GiB ...
    first = parse_pod(pod([gpu_container("app", 8)], [gpu_container("proxy", 4, sidecar=True)]), GIB)
    assert first.memory_mib == 12 * 1024
    placed = pick(one_gpu(16), first)
    assert gpu_charges(placed.parts) == {"g0": (12 * 1024, 0)}
    proxy = next(p for p in placed.parts if p.container == "proxy")
    assert proxy.init and proxy.sidecar
    # ... so a second pod needing 6 GiB does not fit there (counted as a plain init container, the old rule,
    # the first pod held max(8, 4) = 8 GiB and the second would have been placed on top of the sidecar)
    second = parse_pod(pod([gpu_container("main", 6)], uid="u2"), GIB)
    verdict = evaluate(one_gpu(4), second)
    assert not verdict.fits and verdict.resolvable
    assert "6144 MiB" in verdict.reason


def test_a_regular_init_container_runs_beside_the_sidecars_started_before_it() -> None:
    after = pod([gpu_container("app", 2)], [gpu_container("proxy", 4, sidecar=True), gpu_container("setup", 14)])
    demand = parse_pod(after, GIB)
    assert demand.memory_mib == 18 * 1024  # max(14 + 4, 4 + 2)
    with pytest.raises(NoFit) as refused:
        pick(one_gpu(16), demand)
    assert not refused.value.resolvable
    assert "init container setup needs 14336 MiB on one GPU beside the sidecars started before it" in str(refused.value)
    # the same containers with the init container first: it ends before the sidecar starts
    before = pod([gpu_container("app", 2)], [gpu_container("setup", 14), gpu_container("proxy", 4, sidecar=True)])
    demand = parse_pod(before, GIB)
    assert demand.memory_mib == 14 * 1024
    assert gpu_charges(pick(one_gpu(16), demand).parts) == {"g0": (14 * 1024, 0)}


def test_a_regular_init_container_goes_where_no_sidecar_runs_when_that_costs_less() -> None:
    # GPU 0 holds the app (8 of 8), GPU 1 the sidecar (4 of 16): the 8 GiB init container fits on GPU 0 inside
    # the app's share (charge stays 8), while on GPU 1 it would raise the charge from 4 to 12
    n = NodeView("n2", (GpuView("g0", 0, 8 * 1024, 0), GpuView("g1", 1, 16 * 1024, 0)))
    spec = pod([gpu_container("app", 8)], [gpu_container("proxy", 4, sidecar=True), gpu_container("setup", 8)])
    placed = pick(n, parse_pod(spec, GIB))
    where = {p.container: p.gpu_uuid for p in placed.parts}
    assert where == {"app": "g0", "proxy": "g1", "setup": "g0"}
    assert gpu_charges(placed.parts) == {"g0": (8 * 1024, 0), "g1": (4 * 1024, 0)}


def test_only_restart_policy_always_on_an_init_container_makes_a_sidecar() -> None:
    app_always = {**gpu_container("app", 2), "restartPolicy": "Always"}
    init_never = {**gpu_container("setup", 4), "restartPolicy": "Never"}
    demand = parse_pod(pod([app_always], [init_never]), GIB)
    assert not demand.containers[0].sidecar and not demand.init_containers[0].sidecar
    assert demand.memory_mib == 4 * 1024
    with pytest.raises(DemandError, match="restartPolicy must be a string"):
        parse_pod(pod([gpu_container("app", 2)], [{**gpu_container("proxy", 1), "restartPolicy": True}]), GIB)


def test_scheduling_gates_are_read_and_bad_ones_refused() -> None:
    demand = parse_pod(pod([gpu_container("app", 2)], schedulingGates=[{"name": "example.com/quota"}]), GIB)
    assert demand.gated and demand.gates == ("example.com/quota",)
    assert "schedulingGates (example.com/quota)" in demand.gated_reason()
    assert not parse_pod(pod([gpu_container("app", 2)], schedulingGates=[]), GIB).gated
    for bad in ("x", [{"nom": "x"}], [3]):
        with pytest.raises(DemandError, match="schedulingGates"):
            parse_pod(pod([gpu_container("app", 2)], schedulingGates=bad), GIB)
