"""Differential tests: the solver, with its fast paths and caches, against an exhaustive search (`_reference`).

Two ways of being right: the solver places containers greedily (largest share first, by policy) and `_reference`
tries every assignment of every container share to GPUs on small nodes. For every node and pod:

- a pick is a placement: each container on `count` distinct healthy GPUs its hints allow, and what the pod then
  holds on each GPU (the ledger's rule, `gpu_charges`) fits the GPU's free memory and compute;
- pick finds a placement exactly when one exists, and says "can never fit" (not resolvable) exactly when none
  exists even on the node's empty GPUs, healthy or not;
- filter (`filter_nodes`, `evaluate`, with their fast paths and per-shape verdict cache) says what pick does,
  with the same reason, naming the right node;
- what plan.py promises of the choice: a regular init container goes where it raises the pod's charge least
  (given the long-running shares and the init containers before it), and the node's score is the documented
  formula of its memory utilisation.

Nodes (up to 4 GPUs, so that the search stays exhaustive) are drawn from a few shapes so the verdict cache is hit
under different names, with unhealthy GPUs, GPUs of different sizes and compute units, models and CUDA versions
(GPU UUIDs are unique, as the ledger's key makes them); pods mix app, init and sidecar containers, counts, compute,
hints and policies.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.placement import (
    GpuView,
    NodeView,
    NoFit,
    Placement,
    Policy,
    evaluate,
    filter_nodes,
    parse_pod,
    pick,
    reuse,
    score_node,
    score_nodes,
)
from shared.placement.demand import ContainerDemand, PodDemand
from shared.settings import MemoryUnit
from tests.placement import _reference as ref

MODELS = ["Tesla T4", "A100-SXM4", "H100"]


@st.composite
def gpu_layouts(draw):  # type: ignore[no-untyped-def]
    """Per GPU: (capacity GiB, used GiB, compute units, used compute, healthy, model)."""
    n = draw(st.integers(0, 4))
    return [
        (
            draw(st.sampled_from([8, 16, 16, 24])),
            draw(st.integers(0, 24)),
            draw(st.sampled_from([100, 100, 100, 50])),
            draw(st.sampled_from([0, 0, 0, 30, 60, 100])),
            draw(st.booleans()) or draw(st.booleans()),
            draw(st.sampled_from(MODELS)),
        )
        for _ in range(n)
    ]


def make_node(name: str, layout, cuda: str) -> NodeView:  # type: ignore[no-untyped-def]
    gpus = tuple(
        GpuView(
            f"{name}-g{i}",
            i,
            cap * 1024,
            min(used, cap + 1) * 1024,
            units,
            min(comp, units + 10),
            model,
            healthy,
        )
        for i, (cap, used, units, comp, healthy, model) in enumerate(layout)
    )
    return NodeView(name, gpus, cuda)


@st.composite
def clusters(draw):  # type: ignore[no-untyped-def]
    layouts = draw(st.lists(gpu_layouts(), min_size=1, max_size=4))
    nodes = []
    for i in range(draw(st.integers(1, 8))):
        layout = draw(st.sampled_from(layouts))
        cuda = draw(st.sampled_from(["12.2", "12.2", "11.4", "", "bogus"]))
        nodes.append(make_node(f"node-{i}x", layout, cuda))
    return nodes


@st.composite
def pods(draw):  # type: ignore[no-untyped-def]
    def one(name: str) -> dict:
        count = draw(st.sampled_from([1, 1, 1, 2, 3]))
        limits = {"aliyun.com/gpu-mem": draw(st.integers(0, 12)) * count}
        core = draw(st.sampled_from([None, 0, 10, 50, 100]))
        if core is not None:
            limits["aliyun.com/gpu-core"] = core * count
        if count > 1 or draw(st.booleans()):
            limits["aliyun.com/gpu-count"] = count
        if limits["aliyun.com/gpu-mem"] == 0 and not limits.get("aliyun.com/gpu-core"):
            limits["aliyun.com/gpu-mem"] = count
        return {"name": name, "resources": {"limits": limits}}

    names = st.sampled_from(["a", "b", "main", "node-1x", "x\x00y"])
    apps = [one(draw(names) + str(i)) for i in range(draw(st.sampled_from([1, 1, 2, 3, 0])))]
    inits = [one(f"init{i}") for i in range(draw(st.sampled_from([0, 0, 1, 2])))]
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
            annotations[key] = draw(st.sampled_from(["node-0x-g0,node-1x-g1", "node-0x-g0,node-0x-g1,node-2x-g3"]))
    return {
        "metadata": {"uid": "u", "name": "p", "namespace": "ns", "annotations": annotations},
        "spec": {"containers": apps, "initContainers": inits},
    }


def _pick(node: NodeView, demand: PodDemand, policy: Policy) -> Placement | NoFit:
    try:
        return pick(node, demand, policy)
    except NoFit as exc:
        return exc


def _shares(placement: Placement) -> list[ref.Share]:
    return [
        ref.Share(p.container, p.container_index, p.init, p.sidecar, p.gpu_uuid, p.memory_mib, p.compute)
        for p in placement.parts
    ]


def assert_is_a_placement(node: NodeView, demand: PodDemand, placement: Placement) -> None:
    """Every container on `count` distinct usable GPUs with its own share, and the pod's charges fit."""
    usable = ref.usable(node, demand)
    allowed = {g.uuid for g in usable}
    for c in ref.containers(demand):
        mine = [p for p in placement.parts if (p.container, p.container_index, p.init) == (c.name, c.index, c.init)]
        on = [p.gpu_uuid for p in mine]
        assert len(on) == len(set(on)) == c.count, f"{c.name} is on {on}, wants {c.count} distinct GPUs"
        assert set(on) <= allowed, f"{c.name} is on a GPU it may not use: {on}"
        assert all((p.memory_mib, p.compute, p.sidecar) == (c.memory_mib, c.compute, c.sidecar) for p in mine)
        assert all(p.gpu_index == node.gpu(p.gpu_uuid).index for p in mine)  # type: ignore[union-attr]
    assert len(placement.parts) == sum(c.count for c in ref.containers(demand))
    assert ref.fits(_shares(placement), usable), f"overcommits a GPU: {ref.charges(_shares(placement))}"


def _growth(placed: list[ref.Share], usable: list[GpuView], c: ContainerDemand, uuid: str) -> tuple[int, int] | None:
    """How much putting init container `c` on GPU `uuid` raises the pod's charge there (memory, compute), or None
    when it does not fit there beside the shares `placed`."""
    trial = [*placed, ref.Share(c.name, c.index, True, False, uuid, c.memory_mib, c.compute)]
    if not ref.fits([s for s in trial if s.gpu_uuid == uuid], usable):
        return None
    after, before = ref.charges(trial)[uuid], ref.charges(placed).get(uuid, (0, 0))
    return after[0] - before[0], after[1] - before[1]


def assert_inits_raise_the_charge_least(node: NodeView, demand: PodDemand, placement: Placement) -> None:
    """Each regular init container (in spec order) is on GPUs where it raises the pod's charge least, given the
    long-running shares and the init containers placed before it: no GPU it could use instead would have
    raised the charge (memory, then compute) less than one it is on. An init container whose devices kubelet hands
    on (a reuse group) is only held to sharing its group's GPUs, which the reference already requires."""
    usable = ref.usable(node, demand)
    shares = _shares(placement)
    placed = [s for s in shares if not s.init or s.sidecar]
    grouped = {(c.name, c.index, c.init) for group in reuse.reuse_groups(demand) for c in group}
    for c in demand.init_containers:
        if c.sidecar:
            continue
        if (c.name, c.index, c.init) in grouped:  # it goes where its reuse group goes (kubelet's device reuse)
            placed += [s for s in shares if s.init and s.container_index == c.index and not s.sidecar]
            continue
        mine = [s for s in shares if s.init and s.container_index == c.index and not s.sidecar]
        chosen = {s.gpu_uuid for s in mine}
        worst = max(_growth(placed, usable, c, u) or (0, 0) for u in chosen)
        better = [
            g.uuid
            for g in usable
            if g.uuid not in chosen and (grow := _growth(placed, usable, c, g.uuid)) is not None and grow < worst
        ]
        assert not better, f"init container {c.name} on {sorted(chosen)}; {better} would have raised the charge less"
        placed += mine


def check_node(node: NodeView, demand: PodDemand, policy: Policy) -> None:
    """One node against the exhaustive reference."""
    got = _pick(node, demand, policy)
    verdict = evaluate(node, demand, policy)
    assert score_node(node, demand, policy) == ref.score(node, demand, policy)
    if not demand.wants_gpu:
        assert verdict.fits and isinstance(got, NoFit) and not got.resolvable
        return
    if isinstance(got, Placement):
        assert verdict.fits and verdict.reason == ""
        assert got.node == node.name
    else:
        assert not verdict.fits and verdict.resolvable == got.resolvable, (verdict, got)
        assert got.reason and verdict.reason
        if demand.simple:  # the simple path words its reasons on its own, naming the node
            assert node.name in verdict.reason
        else:
            assert verdict.reason == got.reason
    now, ever = ref.exists(node, demand), ref.exists(node, demand, capacity=True)
    if isinstance(got, Placement):
        assert_is_a_placement(node, demand, got)
        assert_inits_raise_the_charge_least(node, demand, got)
    else:
        assert not now, f"pick found no placement on {node.name} but one exists: {next(ref.assignments(node, demand))}"
        assert got.resolvable == ever, f"resolvable={got.resolvable}, yet a placement on the empty node exists={ever}"


@settings(max_examples=400, deadline=None)
@given(clusters(), pods(), st.sampled_from(list(Policy)))
def test_filter_score_and_pick_against_an_exhaustive_search(nodes, spec, policy) -> None:  # type: ignore[no-untyped-def]
    demand = parse_pod(spec, MemoryUnit.GIB)
    for node in nodes:
        check_node(node, demand, policy)
    for _ in range(2):  # the second round is served from the verdict cache
        ok, failed, never = filter_nodes(nodes, demand, policy)
        expected: tuple[list, dict, dict] = ([], {}, {})
        for node in nodes:
            v = evaluate(node, demand, policy)
            if v.fits:
                expected[0].append(node.name)
            else:
                (expected[1] if v.resolvable else expected[2])[node.name] = v.reason
        assert (ok, failed, never) == expected
        assert score_nodes(nodes, demand, policy) == [(n.name, ref.score(n, demand, policy)) for n in nodes]


def _pod(containers: list[tuple[str, int, int]], inits: list[tuple[str, int, int]] = (), **annotations) -> PodDemand:  # type: ignore[assignment]
    def spec(name: str, gib: int, count: int) -> dict:
        return {
            "name": name,
            "resources": {"limits": {"aliyun.com/gpu-mem": gib * count, "aliyun.com/gpu-count": count}},
        }

    return parse_pod(
        {
            "metadata": {"uid": "u", "annotations": annotations},
            "spec": {"containers": [spec(*c) for c in containers], "initContainers": [spec(*c) for c in inits]},
        },
        MemoryUnit.GIB,
    )


@pytest.mark.parametrize("policy", list(Policy))
def test_a_placement_is_found_where_largest_first_by_policy_is_not_enough(policy: Policy) -> None:
    """8, 7 and 4 GiB on GPUs with 8 and 11 GiB free: only 8 | 7 + 4 fits. Largest first, spread puts 8 GiB on the
    11 GiB GPU; on 7 and 5 GiB free, 4 + 3 | 3 + 2 fits and best fit puts 4 GiB on the 5 GiB GPU."""
    for free, sizes in (([8, 11], [8, 7, 4]), ([7, 5], [4, 3, 3, 2])):
        node = make_node("tight", [(16, 16 - f, 100, 0, True, "Tesla T4") for f in free], "12.2")
        demand = _pod([(f"c{i}", gib, 1) for i, gib in enumerate(sizes)])
        placement = pick(node, demand, policy)
        assert_is_a_placement(node, demand, placement)
        assert evaluate(node, demand, policy).fits
        assert filter_nodes([node], demand, policy)[0] == ["tight"]


def test_the_verdict_cache_names_each_node_in_its_reason() -> None:
    layout = [(16, 12, 100, 0, True, "Tesla T4"), (16, 12, 100, 0, True, "Tesla T4")]
    nodes = [make_node(f"n{i}", layout, "12.2") for i in range(3)]
    assert len({n.shape for n in nodes}) == 1  # one interned shape shared by the three nodes
    demand = _pod([("a", 6, 1), ("b", 6, 1)])
    ok, failed, never = filter_nodes(nodes, demand)
    assert ok == [] and never == {} and list(failed) == ["n0", "n1", "n2"]
    for node in nodes:
        assert failed[node.name] == _pick(node, demand, Policy.BINPACK).reason  # type: ignore[union-attr]
        assert not ref.exists(node, demand) and ref.exists(node, demand, capacity=True)
    hole = [(16, 12, 100, 0, False, "Tesla T4")]
    v = evaluate(make_node("sick", hole, "12.2"), demand)
    assert not v.fits and "on sick are unhealthy" in v.reason


@pytest.mark.parametrize("policy", list(Policy))
def test_fast_path_agrees_on_a_large_half_full_cluster(policy: Policy) -> None:
    import random

    rnd = random.Random(7)
    nodes = [
        make_node(
            f"n{i}", [(16, rnd.randint(0, 16), 100, rnd.choice([0, 50]), True, "Tesla T4") for _ in range(4)], "12.2"
        )
        for i in range(150)
    ]
    for containers, inits in [
        ([("a", 4, 1), ("b", 4, 1)], []),
        ([("m", 8, 2)], []),
        ([("m", 4, 1)], [("setup", 6, 1)]),
        ([("m", 6, 3), ("side", 10, 1)], [("setup", 14, 2)]),
    ]:
        demand = _pod(containers, inits)
        ok, failed, never = filter_nodes(nodes, demand, policy)
        assert ok == [n.name for n in nodes if ref.exists(n, demand)]
        assert set(never) == {n.name for n in nodes if not ref.exists(n, demand, capacity=True)}
        assert set(failed) == {n.name for n in nodes} - set(ok) - set(never)
        assert score_nodes(nodes, demand, policy) == [(n.name, ref.score(n, demand, policy)) for n in nodes]
