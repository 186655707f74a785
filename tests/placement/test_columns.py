"""The column fast path (`shared.placement.columns`) gives exactly the placement core's answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.annotations import POLICY
from shared.placement import GpuView, NodeView, Policy, filter_nodes, parse_pod, score_nodes
from shared.placement.columns import NodeColumns, columns_apply, score_list, split_fitting
from shared.settings import MemoryUnit

gpu_st = st.tuples(st.integers(0, 32), st.integers(0, 32), st.booleans())  # capacity GiB, used GiB, healthy


@st.composite
def clusters(draw) -> list[NodeView]:
    count = draw(st.integers(0, 12))
    out = []
    for n in range(count):
        raw = draw(st.lists(gpu_st, min_size=0, max_size=6))
        gpus = tuple(
            GpuView(f"n{n}-g{i}", i, cap * 1024, min(used, cap) * 1024, 100, 0, healthy=healthy)
            for i, (cap, used, healthy) in enumerate(raw)
        )
        out.append(NodeView(f"node-{n}", gpus))
    return out


def simple_pod(gib: int, *, policy: str | None = None) -> dict:
    annotations = {POLICY: policy} if policy else {}
    limits = {"aliyun.com/gpu-mem": gib}
    return {
        "metadata": {"uid": "u", "annotations": annotations},
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
    }


@settings(max_examples=300, deadline=None)
@given(
    clusters(),
    st.integers(1, 33),
    st.sampled_from(list(Policy)),
    st.sampled_from([None, "binpack", "spread"]),
    st.lists(st.integers(0, 14), max_size=16),
)
def test_columns_filter_and_score_like_the_placement_core(nodes, gib, policy, hint, picks) -> None:
    demand = parse_pod(simple_pod(gib, policy=hint), MemoryUnit.GIB)
    assert columns_apply(demand)
    by_name = {n.name: n for n in nodes}
    columns = NodeColumns(nodes)
    names = [f"node-{i}" for i in picks]  # repeats and names with no node included, in any order

    passed, rest = split_fitting(columns, names, demand.containers[0].memory_mib)

    known = [by_name[n] for n in names if n in by_name]
    expected_passed, failed, never = filter_nodes(known, demand, policy)
    assert passed == expected_passed
    assert sorted(rest) == sorted(
        [n for n in names if n not in by_name] + [n for n in names if n in {**failed, **never}]
    )
    expected = dict(score_nodes([by_name[n] for n in passed], demand, policy))
    assert score_list(columns, by_name, passed, demand, policy) == [expected[n] for n in passed]
    scored = dict(score_nodes([by_name[n] for n in names if n in by_name], demand, policy))
    assert score_list(columns, by_name, names, demand, policy) == [scored.get(n, 0) for n in names]


@settings(max_examples=100, deadline=None)
@given(clusters(), clusters(), st.integers(1, 16))
def test_columns_follow_replaced_and_dropped_nodes(before, after, gib) -> None:
    columns = NodeColumns(before)
    for node in after:
        columns.put(node)
    kept = {n.name: n for n in after}
    for node in before:
        if node.name not in kept:
            columns.drop(node.name)
    demand = parse_pod(simple_pod(gib), MemoryUnit.GIB)
    names = sorted(kept)
    passed, _ = split_fitting(columns, names, demand.memory_mib)
    assert passed == filter_nodes([kept[n] for n in names], demand)[0]
    assert set(columns.max_free) == set(kept)


def test_multi_gpu_and_compute_pods_take_the_per_node_path() -> None:
    two = {
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": 2, "aliyun.com/gpu-count": 2}}}]
        }
    }
    core = {
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": 2, "aliyun.com/gpu-core": 30}}}]
        }
    }
    assert not columns_apply(parse_pod(two, MemoryUnit.GIB))
    assert not columns_apply(parse_pod(core, MemoryUnit.GIB))
    assert columns_apply(parse_pod(simple_pod(2), MemoryUnit.GIB))
