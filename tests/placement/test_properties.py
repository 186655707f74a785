"""Property tests: whatever the pod and the node, a pick never exceeds any GPU's free capacity."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.ledger.rules import gpu_charges
from shared.placement import GpuView, NodeView, NoFit, Policy, evaluate, parse_pod, pick
from shared.settings import MemoryUnit

gpu_st = st.tuples(st.integers(1, 32), st.integers(0, 32), st.integers(0, 100))  # cap GiB, used GiB, used compute


@st.composite
def nodes(draw):
    raw = draw(st.lists(gpu_st, min_size=1, max_size=8))
    gpus = tuple(
        GpuView(f"g{i}", i, cap * 1024, min(used, cap) * 1024, 100, comp, healthy=draw(st.booleans()) or i == 0)
        for i, (cap, used, comp) in enumerate(raw)
    )
    return NodeView("n", gpus)


@st.composite
def pods(draw):
    def one(name):
        count = draw(st.sampled_from([1, 1, 1, 2, 4]))
        mem = draw(st.integers(1, 12)) * count
        core = draw(st.sampled_from([0, 0, 10, 50])) * count
        return {
            "name": name,
            "resources": {
                "limits": {"aliyun.com/gpu-mem": mem, "aliyun.com/gpu-core": core, "aliyun.com/gpu-count": count}
            },
        }

    apps = [one(f"c{i}") for i in range(draw(st.integers(1, 3)))]
    inits = [one(f"i{i}") for i in range(draw(st.integers(0, 3)))]
    for c in inits:
        if draw(st.booleans()):
            c["restartPolicy"] = "Always"  # a sidecar
    return {"metadata": {"uid": "u"}, "spec": {"containers": apps, "initContainers": inits}}


@settings(max_examples=300, deadline=None)
@given(nodes(), pods(), st.sampled_from(list(Policy)))
def test_a_pick_never_exceeds_free_capacity_and_agrees_with_filter(node, spec, policy) -> None:
    demand = parse_pod(spec, MemoryUnit.GIB)
    verdict = evaluate(node, demand, policy)
    try:
        placement = pick(node, demand, policy)
    except NoFit:
        assert not verdict.fits
        return
    assert verdict.fits
    by_uuid = {g.uuid: g for g in node.gpus}
    for uuid, (mem, comp) in gpu_charges(placement.parts).items():
        g = by_uuid[uuid]
        assert g.healthy
        assert mem <= g.free_memory_mib and comp <= g.free_compute
    # every container got exactly `count` distinct GPUs
    for c in (*demand.containers, *demand.init_containers):
        gpus = [p.gpu_uuid for p in placement.parts if p.container == c.name and p.init == c.init]
        assert len(gpus) == len(set(gpus)) == c.count
