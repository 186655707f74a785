"""Preemption as kube-scheduler's own would choose it with the GPU rule added (`shared.placement.preempt`), and
PodDisruptionBudgets as kube-scheduler counts them (`shared.placement.disruption`).

The expected answers are worked by hand from k8s.io/kubernetes v1.37.2: `SelectVictimsOnNode`
(plugins/defaultpreemption/default_preemption.go), `FilterVictimsWithPDBViolation` and `MoreImportantVictim`
(framework/preemption/util.go).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from shared.placement import GpuView, NodeView, parse_pod
from shared.placement.disruption import Budget, parse_budget, parse_selector, violating
from shared.placement.preempt import Victim, Victims, select_victims
from shared.settings import MemoryUnit

NOW = datetime(2026, 1, 1, tzinfo=UTC)
GIB = 1024


def wants(gib: int, *, priority: int = 1000):
    body = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "preemptor"},
        "spec": {
            "priority": priority,
            "containers": [{"name": "m", "resources": {"limits": {"aliyun.com/gpu-mem": str(gib)}}}],
        },
    }
    return parse_pod(body, MemoryUnit.GIB)


def node(*used_gib: int, capacity_gib: int = 8) -> NodeView:
    return NodeView("n1", tuple(GpuView(f"g{i}", i, capacity_gib * GIB, u * GIB) for i, u in enumerate(used_gib)))


def pod(uid: str, gpu: int | None, gib: int, priority: int = 10, *, age_s: int = 0, labels=None) -> Victim:
    charges = {f"g{gpu}": (gib * GIB, 0)} if gpu is not None else {}
    return Victim(uid, charges, priority, NOW - timedelta(seconds=age_s), "ns", uid, labels or {})


def guarded(allowed: int = 0, **match: str) -> Budget:
    return parse_budget(
        {
            "metadata": {"namespace": "ns"},
            "spec": {"selector": {"matchLabels": match or {"app": "guarded"}}},
            "status": {"disruptionsAllowed": allowed},
        }
    )


def choose(n: NodeView, gib: int, pods: list[Victim], required=(), budgets=()) -> Victims | None:
    return select_victims(n, wants(gib), pods, preemptor_priority=1000, required=required, budgets=budgets, now=NOW)


def test_kube_schedulers_victims_that_free_the_gpu_are_the_answer_with_its_count() -> None:
    # one 16 GiB GPU holding 12: kube-scheduler (counting gpu-mem per node) chose `old-small` alone; so do we
    n = node(12, capacity_gib=16)
    pods = [pod("old-big", 0, 8, age_s=30), pod("old-small", 0, 4, age_s=20)]
    assert choose(n, 8, pods, required={"old-small"}) == Victims(("old-small",), 0)


def test_the_gpu_holders_that_must_go_are_added_and_counted() -> None:
    # GPU 0: guarded (4, PDB allows none) + b (2); GPU 1: a pod of higher priority than the preemptor (6).
    # kube-scheduler, counting memory per node, chose b alone (free 6 on the node), which frees no GPU enough.
    n = node(6, 6)
    pods = [
        pod("guarded", 0, 4, age_s=30, labels={"app": "guarded"}),
        pod("b", 0, 2, age_s=20),
        pod("vip", 1, 6, priority=2000),
    ]
    chosen = choose(n, 6, pods, required={"b"}, budgets=[guarded()])
    assert chosen == Victims(("guarded", "b"), 1)  # reprieving the guarded pod leaves GPU 0 4 GiB short
    # without the budget nothing changes but the count
    assert choose(n, 6, pods, required={"b"}) == Victims(("guarded", "b"), 0)


def test_violating_pods_are_reprieved_first_and_the_most_important_first() -> None:
    # one 8 GiB GPU, full: the preemptor needs 4, so one of the 4 GiB pods must go
    n = node(8)
    first, second = pod("guarded", 0, 4, priority=5, labels={"app": "guarded"}), pod("plain", 0, 4, priority=50)
    # `guarded` violates its budget: it is tried first and stays, so `plain` goes although it is more important
    assert choose(n, 4, [first, second], budgets=[guarded()]) == Victims(("plain",), 0)
    # without a budget the more important pod is reprieved first
    assert choose(n, 4, [first, second]) == Victims(("guarded",), 0)
    # equal priorities: the pod that started earlier is the more important one
    older, newer = pod("older", 0, 4, age_s=60), pod("newer", 0, 4, age_s=5)
    assert choose(n, 4, [newer, older]) == Victims(("newer",), 0)


def test_victims_are_answered_most_important_first() -> None:
    # kube-scheduler's pickOneNodeForPreemption reads Pods[0] as the highest priority victim
    n = node(8)
    pods = [pod("low", 0, 2, priority=5), pod("mid", 0, 6, priority=500), pod("guarded", None, 0, priority=1)]
    chosen = choose(n, 8, pods, required={"guarded"})
    assert chosen is not None and chosen.uids == ("mid", "low", "guarded")
    guarded_pod = pod("g", 0, 4, priority=1, labels={"app": "guarded"})
    chosen = choose(node(8), 8, [guarded_pod, pod("x", 0, 4, priority=100)], budgets=[guarded()])
    assert chosen == Victims(("x", "g"), 1)  # violating victims found first, then sorted by importance again


def test_no_answer_where_no_eviction_frees_the_gpu_and_higher_priority_pods_never_go() -> None:
    n = node(8, 8)
    pods = [pod("vip0", 0, 8, priority=1000), pod("vip1", 1, 6, priority=5000), pod("low", 1, 2)]
    assert choose(n, 4, pods) is None  # `low` frees 2 GiB; the others are not lower than the preemptor
    assert choose(n, 2, pods) == Victims(("low",), 0)


def test_pdb_violations_are_counted_as_kube_scheduler_counts_them() -> None:
    pods = [pod(u, 0, 1, labels={"app": "guarded"}) for u in ("a", "b", "c")]
    # one disruption allowed: the first selected pod consumes it, the next ones violate
    assert violating(pods, [guarded(allowed=1)]) == [False, True, True]
    # a pod the budget already counts as disrupted consumes nothing
    counted = parse_budget(
        {
            "metadata": {"namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "guarded"}}},
            "status": {"disruptionsAllowed": 1, "disruptedPods": {"a": "2026-01-01T00:00:00Z"}},
        }
    )
    assert violating(pods, [counted]) == [False, False, True]
    # another namespace, an empty or missing selector, a pod without labels: no budget applies
    other = Budget("elsewhere", parse_selector({"matchLabels": {"app": "guarded"}}), 0)
    assert violating(pods, [other]) == [False] * 3
    assert parse_selector({}) is None and parse_selector(None) is None
    assert violating([pod("bare", 0, 1)], [Budget("ns", parse_selector({"matchExpressions": []}), 0)]) == [False]
    # kube-scheduler stops at the first budget a pod violates: the second budget is not decremented for it
    two = [guarded(allowed=0), guarded(allowed=1)]
    assert violating(pods[:2], two) == [True, True]


@pytest.mark.parametrize(
    ("expression", "labels", "matches"),
    [
        ({"key": "tier", "operator": "In", "values": ["db", "cache"]}, {"tier": "db"}, True),
        ({"key": "tier", "operator": "In", "values": ["db"]}, {"tier": "web"}, False),
        ({"key": "tier", "operator": "NotIn", "values": ["web"]}, {"app": "x"}, True),
        ({"key": "tier", "operator": "Exists"}, {"tier": ""}, True),
        ({"key": "tier", "operator": "DoesNotExist"}, {"tier": "db"}, False),
        ({"key": "tier", "operator": "In", "values": []}, {"tier": "db"}, False),  # invalid: matches nothing
        ({"key": "tier", "operator": "Exists", "values": ["x"]}, {"tier": "db"}, False),  # invalid
        ({"key": "tier", "operator": "Like", "values": ["d"]}, {"tier": "db"}, False),  # unknown operator
    ],
)
def test_label_selector_expressions(expression: dict, labels: dict, matches: bool) -> None:
    budget = Budget("ns", parse_selector({"matchExpressions": [expression]}), 5)
    assert budget.selects("ns", labels) is matches
