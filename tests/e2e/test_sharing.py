"""The classic gpushare scenario through the real kube-scheduler: one node, one 16 GiB GPU shared by seven pods.

API -> kube-scheduler -> extender (filter, bind) -> ledger -> binder -> Binding -> node agent (via the kubelet
stand-in's Allocate) -> container environment. Then the GPU is full: the next pod stays Pending with a reason
that accounting shows (kube-scheduler's own: the node has no GPU memory left in total), and deleting one pod lets
it in.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from tests.e2e import helpers as h

pytestmark = pytest.mark.e2e

STACK_NODES = 1
STACK_GPUS = "1x16GiB:Tesla-T4"

TRAIN = "bert-train"
INFER = [f"resnet-infer-{i}" for i in range(6)]
WAITER = "resnet-infer-waiting"


async def test_seven_pods_fill_one_gpu_then_the_next_waits(stack, api, namespace) -> None:
    node = stack.node_names[0]
    await h.create_pod(api, namespace, h.gpu_pod(TRAIN, [4]))
    for name in INFER:
        await h.create_pod(api, namespace, h.gpu_pod(name, [2]))

    placed = await h.wait_bound(api, namespace, [TRAIN, *INFER])
    assert set(placed.values()) == {node}

    # The ledger holds exactly one GPU share per pod, all on the single GPU, 16 GiB in total.
    allocs = await h.wait_ledger(stack.database_url, namespace, [TRAIN, *INFER])
    (gpu,) = await h.gpu_rows(stack.database_url, node)
    assert gpu["allocated_memory_mib"] == 16 * 1024 == gpu["memory_mib"]
    assert allocs[TRAIN]["memory_mib"] == 4 * 1024
    assert all(allocs[n]["memory_mib"] == 2 * 1024 for n in INFER)
    assert {p["gpu_uuid"] for a in allocs.values() for p in a["parts"]} == {gpu["uuid"]}

    # Every container got the GPU the ledger holds for it, with its own share, from the node agent.
    for name in [TRAIN, *INFER]:
        env = await h.container_env(stack, node, namespace, name, "c0")
        assert env["NVIDIA_VISIBLE_DEVICES"] == allocs[name]["parts"][0]["gpu_uuid"], (name, env)
        assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(allocs[name]["memory_mib"] // 1024), (name, env)
        assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0"
        assert env["ALIYUN_COM_GPU_MEM_DEV"] == "16"

    # The GPU is full: the next 2 GiB pod is refused, and accounting says why. kube-scheduler counts GPU memory per
    # node (the shipped configuration): the node has none left in total, so its own filter refuses it and the
    # extender is never asked; accounting shows kube-scheduler's reason, read from the pod.
    await h.create_pod(api, namespace, h.gpu_pod(WAITER, [2]))
    assert await h.stays_pending(api, namespace, WAITER, 5.0)

    view = await h.wait_pending_reason(stack, namespace, WAITER)
    assert view["status"] == "pending", view
    pending = view["pending"]
    assert pending["source"] == "kube-scheduler" and pending["reasons"] == {}, view
    assert "0/1 nodes are available: 1 Insufficient aliyun.com/gpu-mem" in pending["summary"], view
    assert pending["scheduler"]["reason"] == "Unschedulable", view
    cond = await h.scheduled_condition(api, namespace, WAITER)
    assert cond.startswith("False:Unschedulable") and pending["scheduler"]["message"] in cond, (cond, pending)
    (listed,) = [p for p in await h.accounting_pending(stack, namespace) if p["pod_name"] == WAITER]
    assert listed["summary"] == pending["summary"]

    # Deleting one inference pod frees 2 GiB; kube-scheduler retries the waiting pod and it gets them.
    await h.delete_pod(api, namespace, INFER[0])
    await h.wait_released(stack.database_url, namespace, INFER[0])
    # the binder stamps gpushare.io/capacity-freed on the node after the release, which sends the waiting
    # pod straight back to kube-scheduler's active queue (well before its 60 s unschedulable flush)
    placed = await h.wait_bound(api, namespace, [WAITER], timeout_s=30)
    assert placed[WAITER] == node
    allocs = await h.wait_ledger(stack.database_url, namespace, [WAITER])
    env = await h.container_env(stack, node, namespace, WAITER, "c0")
    assert env["NVIDIA_VISIBLE_DEVICES"] == allocs[WAITER]["parts"][0]["gpu_uuid"] == gpu["uuid"]
    (gpu_after,) = await h.gpu_rows(stack.database_url, node)
    assert gpu_after["allocated_memory_mib"] == 16 * 1024

    # `gpushare inspect` agrees with the cluster: the node's GPU is fully allocated by exactly these pods.
    await check_inspect(stack, api, namespace, node, [TRAIN, *INFER[1:], WAITER])


async def check_inspect(stack, api, namespace: str, node: str, pods: list[str]) -> None:
    """`gpushare inspect` (table and -d) against the pods actually bound in the cluster."""
    table = await h.inspect(stack)
    lines = [line for line in table.splitlines() if line.startswith(node)]
    assert lines, table
    assert "16/16" in lines[0], table
    # IPADDRESS is the node's InternalIP, as the node agent reported it to the ledger
    node_obj = await client.CoreV1Api(api).read_node(node)
    internal_ip = next(a.address for a in node_obj.status.addresses if a.type == "InternalIP")
    assert lines[0].split()[1] == internal_ip, table
    detail = await h.inspect(stack, "-d", node)
    bound_in_cluster = [p for p in pods if await h.pod_node(api, namespace, p) == node]
    assert sorted(bound_in_cluster) == sorted(pods)
    for pod in pods:
        assert pod in detail, (pod, detail)
    assert INFER[0] not in detail, detail


async def test_a_terminating_pod_keeps_its_share_until_it_is_gone(stack, api, namespace) -> None:
    """Deleted with a 60 s grace period on a node where nothing finishes it, a pod stays Terminating and its
    processes may still hold GPU memory: a pod that needs that memory waits until the object is gone."""
    node = stack.node_names[0]
    holder = h.gpu_pod("leaving", [10])
    holder["spec"]["terminationGracePeriodSeconds"] = 60
    await h.create_pod(api, namespace, holder)
    await h.wait_bound(api, namespace, ["leaving"])
    await h.wait_ledger(stack.database_url, namespace, ["leaving"])

    core = client.CoreV1Api(api)
    await core.delete_namespaced_pod("leaving", namespace, grace_period_seconds=60)
    pod = await core.read_namespaced_pod("leaving", namespace)
    assert pod.metadata.deletion_timestamp is not None, "no kubelet finishes it: the pod stays Terminating"

    async def marked() -> dict | None:
        view = await h.accounting_pod(stack, namespace, "leaving")
        allocation = (view or {}).get("allocation") or {}
        return view if allocation.get("terminating_at") else None

    view = await h.poll(marked, 30, what="the ledger to mark the holder terminating")
    assert view["status"] in ("bound", "assigned"), "the share stays held"
    (gpu,) = await h.gpu_rows(stack.database_url, node)
    assert gpu["allocated_memory_mib"] == 10 * 1024

    await h.create_pod(api, namespace, h.gpu_pod("next", [8]))
    assert await h.stays_pending(api, namespace, "next", 8.0), "6 GiB are free while the holder terminates"

    async def waiting_on_holder() -> dict | None:
        view = await h.accounting_pod(stack, namespace, "next")
        pending = (view or {}).get("pending") or {}
        return pending if pending.get("terminating_holders") else None

    pending = await h.poll(waiting_on_holder, 30, what="the pending view to name the terminating holder")
    assert [(x["pod_name"], x["node"]) for x in pending["terminating_holders"]] == [("leaving", node)]
    detail = await h.inspect(stack, "-d", node)
    assert f"Terminating (share held until gone): {namespace}/leaving" in detail, detail

    await core.delete_namespaced_pod("leaving", namespace, grace_period_seconds=0)  # force deletion
    await h.wait_released(stack.database_url, namespace, "leaving")
    placed = await h.wait_bound(api, namespace, ["next"], timeout_s=30)
    assert placed["next"] == node


async def test_a_second_pod_asking_for_the_nodes_only_gpu_by_count_waits_for_it(stack, api, namespace) -> None:
    """`aliyun.com/gpu-count` is a device per GPU that kubelet counts (the node agent's device plugin): a pod asking
    for one holds it whatever memory it asks. The ledger places two such pods on one GPU (their memory fits), but
    kubelet's admission refuses the second (lifecycle/predicate.go: `noderesources.Fits` against node allocatable,
    `OutOfaliyun.com/gpu-count`; its device manager has no gpu-count device left). kube-scheduler counts gpu-count
    per node as shipped, so the second stays Pending with that reason instead of being bound and refused there."""
    node = stack.node_names[0]
    first, second = h.gpu_pod("one-gpu", [4], count=1), h.gpu_pod("one-more-gpu", [4], count=1)
    await h.create_pod(api, namespace, first)
    assert (await h.wait_bound(api, namespace, ["one-gpu"], timeout_s=60))["one-gpu"] == node
    await h.create_pod(api, namespace, second)
    assert await h.stays_pending(api, namespace, "one-more-gpu", 5.0)
    view = await h.wait_pending_reason(stack, namespace, "one-more-gpu")
    assert view["pending"]["source"] == "kube-scheduler", view
    assert "0/1 nodes are available: 1 Insufficient aliyun.com/gpu-count" in view["pending"]["summary"], view
    assert "one-more-gpu" not in await h.ledger_allocations(stack.database_url, namespace)
    assert (namespace, "one-more-gpu") not in stack.kubelets[node].errors, "never sent to the node"

    await h.delete_pod(api, namespace, "one-gpu")
    await h.wait_released(stack.database_url, namespace, "one-gpu")
    assert (await h.wait_bound(api, namespace, ["one-more-gpu"], timeout_s=60))["one-more-gpu"] == node
