"""Differential tests: the fast paths and caches of filter / score give exactly what the plain solver gives.

`_reference` is the solver as it was before the optimisation (every node solved from scratch). Nodes are
drawn from a few shapes so the per-shape verdict cache is hit under different node names, with unhealthy
GPUs, compute, models, CUDA versions and duplicate UUIDs; pods mix app, init and sidecar containers, counts,
compute, hints and policies.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.placement import (
    GpuView,
    NodeView,
    NoFit,
    Policy,
    evaluate,
    filter_nodes,
    parse_pod,
    pick,
    score_node,
    score_nodes,
)
from shared.settings import MemoryUnit
from tests.placement import _reference as ref

MODELS = ["Tesla T4", "A100-SXM4", "H100"]


@st.composite
def gpu_layouts(draw):
    """Per GPU: (capacity GiB, used GiB, used compute, healthy, model)."""
    n = draw(st.integers(0, 8))
    return [
        (
            draw(st.sampled_from([8, 16, 16, 24])),
            draw(st.integers(0, 24)),
            draw(st.sampled_from([0, 0, 0, 30, 60, 100])),
            draw(st.booleans()) or draw(st.booleans()),
            draw(st.sampled_from(MODELS)),
        )
        for _ in range(n)
    ]


def make_node(name: str, layout, cuda: str, dup_uuid: bool = False) -> NodeView:
    gpus = tuple(
        GpuView(
            f"{name}-g{0 if dup_uuid and i == 1 else i}",
            i,
            cap * 1024,
            min(used, cap + 1) * 1024,
            100,
            comp,
            model,
            healthy,
        )
        for i, (cap, used, comp, healthy, model) in enumerate(layout)
    )
    return NodeView(name, gpus, cuda)


@st.composite
def clusters(draw):
    layouts = draw(st.lists(gpu_layouts(), min_size=1, max_size=4))
    nodes = []
    for i in range(draw(st.integers(1, 12))):
        layout = draw(st.sampled_from(layouts))
        cuda = draw(st.sampled_from(["12.2", "12.2", "11.4", "", "bogus"]))
        nodes.append(make_node(f"node-{i}", layout, cuda, dup_uuid=draw(st.integers(0, 9)) == 0))
    return nodes


@st.composite
def pods(draw):
    def one(name: str) -> dict:
        count = draw(st.sampled_from([1, 1, 1, 2, 3, 4]))
        limits = {"aliyun.com/gpu-mem": draw(st.integers(0, 16)) * count}
        core = draw(st.sampled_from([None, 0, 10, 50, 100]))
        if core is not None:
            limits["aliyun.com/gpu-core"] = core * count
        if count > 1 or draw(st.booleans()):
            limits["aliyun.com/gpu-count"] = count
        if limits["aliyun.com/gpu-mem"] == 0 and not limits.get("aliyun.com/gpu-core"):
            limits["aliyun.com/gpu-mem"] = count
        return {"name": name, "resources": {"limits": limits}}

    names = st.sampled_from(["a", "b", "main", "node-1", "x\x00y"])
    apps = [one(draw(names) + str(i)) for i in range(draw(st.sampled_from([1, 1, 2, 3, 0])))]
    inits = [one(f"init{i}") for i in range(draw(st.sampled_from([0, 0, 1, 2, 3])))]
    for c in inits:  # some are sidecars (restartPolicy Always), before or after regular ones
        if draw(st.integers(0, 2)) == 0:
            c["restartPolicy"] = "Always"
    annotations = {}
    for kind in draw(st.sampled_from([(), (), (), ("cuda",), ("policy",), ("model",), ("uuid",), ("model", "cuda")])):
        if kind == "cuda":
            annotations["gpushare.io/min-cuda-version"] = draw(st.sampled_from(["12.0", "11.0"]))
        elif kind == "policy":
            annotations["gpushare.io/policy"] = draw(st.sampled_from(["binpack", "spread"]))
        elif kind == "model":
            key = draw(st.sampled_from(["gpushare.io/gpu-model-include", "gpushare.io/gpu-model-exclude"]))
            annotations[key] = draw(st.sampled_from(["a100", "t4,h100", "v100"]))
        else:
            key = draw(st.sampled_from(["gpushare.io/gpu-uuid-include", "gpushare.io/gpu-uuid-exclude"]))
            annotations[key] = draw(st.sampled_from(["node-0-g0,node-1-g1", "node-0-g0,node-0-g1,node-2-g3"]))
    return {
        "metadata": {"uid": "u", "name": "p", "namespace": "ns", "annotations": annotations},
        "spec": {"containers": apps, "initContainers": inits},
    }


def _pick(fn, node, demand, policy):
    try:
        placement = fn(node, demand, policy)
    except (NoFit, ref.NoFit) as exc:
        return ("nofit", exc.reason, exc.resolvable)
    return (placement.node, placement.parts)


def _v(v) -> tuple[bool, bool, str]:
    return (v.fits, v.resolvable, v.reason)


@settings(max_examples=400, deadline=None)
@given(clusters(), pods(), st.sampled_from(list(Policy)))
def test_filter_score_and_pick_match_the_reference_solver(nodes, spec, policy) -> None:
    demand = parse_pod(spec, MemoryUnit.GIB)
    for _ in range(2):  # the second round is served from the verdict cache
        assert filter_nodes(nodes, demand, policy) == ref.filter_nodes(nodes, demand, policy)
        assert score_nodes(nodes, demand, policy) == ref.score_nodes(nodes, demand, policy)
        for node in nodes:
            assert _v(evaluate(node, demand, policy)) == _v(ref.evaluate(node, demand, policy))
            assert score_node(node, demand, policy) == ref.score_node(node, demand, policy)
    for node in nodes:
        assert _pick(pick, node, demand, policy) == _pick(ref.pick, node, demand, policy)


def test_the_verdict_cache_names_each_node_in_its_reason() -> None:
    layout = [(16, 12, 0, True, "Tesla T4"), (16, 12, 0, True, "Tesla T4")]
    nodes = [make_node(f"n{i}", layout, "12.2") for i in range(3)]
    assert len({n.shape for n in nodes}) == 1  # one interned shape shared by the three nodes
    spec = {
        "metadata": {"uid": "u"},
        "spec": {
            "containers": [
                {"name": "a", "resources": {"limits": {"aliyun.com/gpu-mem": 6}}},
                {"name": "b", "resources": {"limits": {"aliyun.com/gpu-mem": 6}}},
            ]
        },
    }
    demand = parse_pod(spec, MemoryUnit.GIB)
    ok, failed, never = filter_nodes(nodes, demand)
    assert ok == [] and never == {} and list(failed) == ["n0", "n1", "n2"]
    assert (ok, failed, never) == ref.filter_nodes(nodes, demand)
    hole = [(16, 12, 0, False, "Tesla T4")]
    v = evaluate(make_node("sick", hole, "12.2"), demand)
    assert _v(v) == _v(ref.evaluate(make_node("sick", hole, "12.2"), demand))
    assert "on sick are unhealthy" in v.reason


@pytest.mark.parametrize("policy", list(Policy))
def test_fast_path_agrees_on_a_large_half_full_cluster(policy) -> None:
    import random

    rnd = random.Random(7)
    nodes = [
        make_node(f"n{i}", [(16, rnd.randint(0, 16), rnd.choice([0, 50]), True, "Tesla T4") for _ in range(8)], "12.2")
        for i in range(300)
    ]
    for spec_containers, inits in [
        ([("a", 4, 1), ("b", 4, 1)], []),
        ([("m", 8, 2)], []),
        ([("m", 4, 1)], [("setup", 6, 1)]),
        ([("m", 24, 4), ("side", 10, 1)], [("setup", 14, 2)]),
    ]:
        spec = {
            "metadata": {"uid": "u"},
            "spec": {
                "containers": [
                    {"name": n, "resources": {"limits": {"aliyun.com/gpu-mem": m, "aliyun.com/gpu-count": k}}}
                    for n, m, k in spec_containers
                ],
                "initContainers": [
                    {"name": n, "resources": {"limits": {"aliyun.com/gpu-mem": m, "aliyun.com/gpu-count": k}}}
                    for n, m, k in inits
                ],
            },
        }
        demand = parse_pod(spec, MemoryUnit.GIB)
        got = filter_nodes(nodes, demand, policy)
        assert got == ref.filter_nodes(nodes, demand, policy)
        assert score_nodes(nodes, demand, policy) == ref.score_nodes(nodes, demand, policy)
