"""Preemption for GPU shares through the real kube-scheduler (v1.37.2) with the shipped scheduler configuration, and
a PodDisruptionBudget.

kube-scheduler calls the extender's preempt verb only with victims of its own choosing. With the `aliyun.com/*`
resources left to the extender alone (`ignoredByScheduler: true`, what gpushare shipped before) its filters see
no shortage after removing the lower-priority pods, it reprieves them all and gives up ("preemption: expected at
least one victim pod on node"): the verb was never called for GPU pressure and this test failed (the preemptor
stayed pending). As shipped now kube-scheduler counts them per node (`ignoredByScheduler: false`,
docs/extender.md "Preemption"), so it finds victims by the node's total, and the extender makes them free one GPU.

Two nodes of two 8 GiB GPUs each, the same shape of load on both:
- a pod of higher priority than the preemptor holding 6 GiB of GPU 0 (never a victim);
- 4 GiB on GPU 1: on node X a pod a PodDisruptionBudget allows no disruption of, on node Y a pod of priority
  500; and 2 GiB on GPU 0, priority 10.
The preemptor (priority 1000) needs 6 GiB on one GPU. By the node's total kube-scheduler evicts only the 2 GiB pod
(6 GiB free), which frees no GPU enough: before, the extender dropped both nodes and the preemptor stayed
pending. Its own rule with the GPUs added evicts both pods of GPU 1's node too: on X that violates the budget
(1), on Y it evicts a priority-500 pod (0 violations). kube-scheduler picks the node with the fewest violations
first, so Y; answering X's count as kube-scheduler's own victims had it (0) would have made it pick X, whose
highest victim priority is lower, and evict the guarded pod.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from tests.e2e import helpers as h
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

STACK_NODES = 2
STACK_GPUS = "2x8GiB:Tesla-T4"


def placed(name: str, gib: int, priority_class: str, node: str | None, labels: dict[str, str] | None = None) -> dict:
    body: dict[str, Any] = h.gpu_pod(name, [gib])
    body["spec"]["priorityClassName"] = priority_class
    if node is not None:
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    body["metadata"]["labels"].update(labels or {})
    return body


async def test_preemption_frees_a_gpu_and_spares_the_pod_a_budget_protects(stack, api, namespace) -> None:
    x, y = stack.node_names
    tag = uuid.uuid4().hex[:6]
    classes = {name: f"e2e-{name}-{tag}" for name in ("low", "mid", "high", "vip")}
    scheduling = client.SchedulingV1Api(api)
    for name, value in (("low", 10), ("mid", 500), ("high", 1000), ("vip", 2000)):
        await scheduling.create_priority_class({"metadata": {"name": classes[name]}, "value": value})
    try:
        policy = client.PolicyV1Api(api)
        await policy.create_namespaced_pod_disruption_budget(
            namespace,
            {
                "metadata": {"name": "guarded"},
                "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "guarded"}}},
            },
        )
        # one at a time, so that each lands where the docstring says (best fit: GPU 0 first, then the fullest)
        for body in (
            placed("x-vip", 6, classes["vip"], x),
            placed("x-guarded", 4, classes["low"], x, {"app": "guarded"}),
            placed("x-small", 2, classes["low"], x),
            placed("y-vip", 6, classes["vip"], y),
            placed("y-mid", 4, classes["mid"], y),
            placed("y-small", 2, classes["low"], y),
        ):
            await h.create_pod(api, namespace, body)
            await h.wait_bound(api, namespace, [body["metadata"]["name"]])
        allocs = await h.wait_ledger(stack.database_url, namespace, ["x-vip", "x-guarded", "x-small", "y-small"])
        gpu_of = {name: a["parts"][0]["gpu_index"] for name, a in allocs.items()}
        assert gpu_of == {"x-vip": 0, "x-guarded": 1, "x-small": 0, "y-vip": 0, "y-mid": 1, "y-small": 0}, gpu_of

        await h.create_pod(api, namespace, placed("urgent", 6, classes["high"], None))
        bound = await h.wait_bound(api, namespace, ["urgent"], timeout_s=90)
        assert bound["urgent"] == y

        core = client.CoreV1Api(api)

        async def victims_gone() -> bool:
            names = {p.metadata.name for p in (await core.list_namespaced_pod(namespace)).items}
            return not names & {"y-mid", "y-small"}

        await eventually(victims_gone, what="the victims on node Y deleted", within=60)
        names = {p.metadata.name for p in (await core.list_namespaced_pod(namespace)).items}
        assert {"x-vip", "x-guarded", "x-small", "y-vip", "urgent"} <= names, names
        urgent = await h.wait_ledger(stack.database_url, namespace, ["urgent"])
        assert urgent["urgent"]["parts"][0]["gpu_index"] == 1
    finally:
        for name in classes.values():
            try:
                await scheduling.delete_priority_class(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
