"""The pure placement core: gpushare's worked examples, multi-GPU, multi-container, init containers."""

from __future__ import annotations

import pytest

from shared.ledger.rules import gpu_charges
from shared.placement import (
    DemandError,
    GpuView,
    NodeView,
    NoFit,
    Policy,
    evaluate,
    filter_nodes,
    parse_pod,
    pick,
    quota_refusal,
    score_node,
)
from shared.settings import MemoryUnit

MIB = MemoryUnit.MIB


def container(name: str, mem: int | None = None, core: int | None = None, count: int | None = None, *, key="limits"):
    res = {}
    if mem is not None:
        res["aliyun.com/gpu-mem"] = str(mem)
    if core is not None:
        res["aliyun.com/gpu-core"] = str(core)
    if count is not None:
        res["aliyun.com/gpu-count"] = str(count)
    return {"name": name, "image": "x", "resources": {key: res}}


def pod(*containers, init=(), annotations=None, uid="u1"):
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": uid, "annotations": annotations},
        "spec": {"containers": list(containers), "initContainers": list(init) or None},
    }


def node(name: str, free: list[int], capacity: int = 16276, **kw) -> NodeView:
    return NodeView(
        name,
        tuple(
            GpuView(f"{name}-gpu{i}", i, capacity, capacity - f, model=kw.get("model", "Tesla T4"))
            for i, f in enumerate(free)
        ),
        cuda_version=kw.get("cuda", "12.2"),
    )


def test_gpushare_best_fit_example_picks_gpu_1() -> None:
    n = node("n1", [12207, 8138, 4069, 16276])
    placement = pick(n, parse_pod(pod(container("main", 8138)), MIB))
    assert [(p.gpu_index, p.memory_mib) for p in placement.parts] == [(1, 8138)]


def test_gpushare_filter_example_rejects_split_memory_unless_two_gpus_asked() -> None:
    n = node("n1", [4069, 4069], capacity=8138)
    verdict = evaluate(n, parse_pod(pod(container("main", 8138)), MIB))
    assert not verdict.fits and verdict.resolvable
    assert "8138 MiB" in verdict.reason and "4069" in verdict.reason
    two = parse_pod(pod(container("main", 8138, count=2)), MIB)
    assert evaluate(n, two).fits
    parts = pick(n, two).parts
    assert sorted((p.gpu_index, p.memory_mib) for p in parts) == [(0, 4069), (1, 4069)]
    assert evaluate(node("n2", [8138, 0]), parse_pod(pod(container("main", 8138)), MIB)).fits


def test_gib_is_the_default_unit() -> None:
    d = parse_pod(pod(container("main", 3)))
    assert d.containers[0].memory_mib == 3 * 1024


def test_requests_are_read_when_limits_are_absent() -> None:
    d = parse_pod(pod(container("main", 2, key="requests")))
    assert d.memory_mib == 2048


def test_never_fits_is_unresolvable_and_names_the_largest_gpu() -> None:
    v = evaluate(node("n1", [16276]), parse_pod(pod(container("main", 20000)), MIB))
    assert not v.fits and not v.resolvable and "16276" in v.reason
    assert not evaluate(NodeView("empty"), parse_pod(pod(container("main", 1)), MIB)).resolvable


def test_multi_container_pods_get_their_own_gpu_each_on_one_node() -> None:
    n = node("n1", [6000, 6000])
    d = parse_pod(pod(container("a", 5000), container("b", 5000)), MIB)
    parts = pick(n, d).parts
    assert {p.container for p in parts} == {"a", "b"}
    assert {p.gpu_index for p in parts} == {0, 1}
    assert not evaluate(node("n2", [6000, 4000]), d).fits


def test_compute_is_checked_per_gpu() -> None:
    n = NodeView("n1", (GpuView("g0", 0, 16000, 0, 100, 80), GpuView("g1", 1, 16000, 8000, 100, 0)))
    parts = pick(n, parse_pod(pod(container("main", 1000, core=30)), MIB)).parts
    assert [(p.gpu_index, p.compute) for p in parts] == [(1, 30)]


def test_uneven_split_is_rejected_with_a_reason() -> None:
    with pytest.raises(DemandError, match="evenly"):
        parse_pod(pod(container("main", 3, count=2)))


@pytest.mark.parametrize("bad", ["-1", "1.5", "abc", True, "99999999999"])
def test_bad_quantities_are_rejected(bad) -> None:
    spec = pod({"name": "m", "resources": {"limits": {"aliyun.com/gpu-mem": bad}}})
    with pytest.raises(DemandError):
        parse_pod(spec)


def test_core_over_100_and_count_zero_are_rejected() -> None:
    with pytest.raises(DemandError):
        parse_pod(pod(container("main", 1, core=101)))
    with pytest.raises(DemandError):
        parse_pod(pod(container("main", 1, count=0)))


def test_init_containers_follow_the_effective_request_rule() -> None:
    d = parse_pod(pod(container("a", 2000), container("b", 1000), init=[container("setup", 5000)]), MIB)
    assert d.memory_mib == 5000
    n = node("n1", [6000, 3000])
    placement = pick(n, d)
    charges = gpu_charges(placement.parts)
    for g in n.gpus:
        m, _ = charges.get(g.uuid, (0, 0))
        assert m <= g.free_memory_mib
    init_parts = [p for p in placement.parts if p.init]
    assert len(init_parts) == 1 and init_parts[0].gpu_index == 0
    # the init container reuses the app share: 5000 on GPU0 where the app holds 2000, not 7000
    assert sum(m for m, _ in charges.values()) <= 6000 + 3000


def test_init_container_too_big_for_any_gpu_fails() -> None:
    d = parse_pod(pod(container("a", 1000), init=[container("setup", 7000)]), MIB)
    assert not evaluate(node("n1", [6000, 6000], capacity=6000), d).fits


def test_hints_select_models_uuids_and_cuda() -> None:
    n = NodeView(
        "n1",
        (GpuView("GPU-a", 0, 16000, 0, model="Tesla T4"), GpuView("GPU-b", 1, 40000, 0, model="A100-SXM4")),
        cuda_version="11.4",
    )
    want_a100 = parse_pod(pod(container("m", 1000), annotations={"gpushare.io/gpu-model-include": "a100"}), MIB)
    assert pick(n, want_a100).parts[0].gpu_uuid == "GPU-b"
    not_b = parse_pod(pod(container("m", 1000), annotations={"gpushare.io/gpu-uuid-exclude": "GPU-b"}), MIB)
    assert pick(n, not_b).parts[0].gpu_uuid == "GPU-a"
    h100 = parse_pod(pod(container("m", 1000), annotations={"gpushare.io/gpu-model-include": "H100"}), MIB)
    v = evaluate(n, h100)
    assert not v.fits and not v.resolvable and "hints" in v.reason
    cuda = parse_pod(pod(container("m", 1000), annotations={"gpushare.io/min-cuda-version": "12.0"}), MIB)
    v = evaluate(n, cuda)
    assert not v.fits and not v.resolvable and "11.4" in v.reason
    with pytest.raises(DemandError):
        parse_pod(pod(container("m", 1), annotations={"gpushare.io/policy": "random"}))


def test_spread_picks_most_free_and_binpack_least_free() -> None:
    n = node("n1", [12207, 8138, 4069, 16276])
    d = parse_pod(pod(container("main", 4000)), MIB)
    assert pick(n, d).parts[0].gpu_index == 2
    assert pick(n, d, Policy.SPREAD).parts[0].gpu_index == 3
    spread = parse_pod(pod(container("main", 4000), annotations={"gpushare.io/policy": "spread"}), MIB)
    assert pick(n, spread).parts[0].gpu_index == 3


def test_unhealthy_gpus_are_skipped_but_not_unresolvable() -> None:
    n = NodeView("n1", (GpuView("g0", 0, 16000, 0, healthy=False),))
    v = evaluate(n, parse_pod(pod(container("m", 1000)), MIB))
    assert not v.fits and v.resolvable


def test_scores_binpack_and_spread() -> None:
    full = node("full", [4000, 4000], capacity=16000)
    empty = node("empty", [16000, 16000], capacity=16000)
    d = parse_pod(pod(container("m", 2000)), MIB)
    assert score_node(full, d) > score_node(empty, d)
    assert score_node(full, d, Policy.SPREAD) < score_node(empty, d, Policy.SPREAD)
    assert all(0 <= score_node(n, d, p) <= 10 for n in (full, empty) for p in Policy)


def test_filter_nodes_sorts_nodes_into_three_groups() -> None:
    d = parse_pod(pod(container("m", 8000)), MIB)
    ok, failed, never = filter_nodes([node("a", [9000]), node("b", [1000]), node("c", [1000], capacity=4000)], d)
    assert ok == ["a"] and set(failed) == {"b"} and set(never) == {"c"}


def test_pods_without_gpu_requests_fit_everywhere() -> None:
    d = parse_pod(pod({"name": "m", "resources": {"limits": {"cpu": "1"}}}), MIB)
    assert not d.wants_gpu and evaluate(NodeView("x"), d).fits


def test_quota_refusal_names_the_quota() -> None:
    d = parse_pod(pod(container("m", 4)))
    assert quota_refusal(d, (0, 0), None) is None
    reason = quota_refusal(d, (8192, 0), (10240, None))
    assert reason is not None and "quota 10240 MiB" in reason


def test_pick_raises_nofit_with_a_reason() -> None:
    with pytest.raises(NoFit, match="needs 9000 MiB"):
        pick(node("n1", [1000]), parse_pod(pod(container("m", 9000)), MIB))
