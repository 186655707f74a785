"""Several nodes through the real kube-scheduler: binpack and spread, multi-GPU and multi-container pods, quotas."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e import helpers as h
from tests.e2e.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.e2e

STACK_NODES = 3
STACK_GPUS = "2x16GiB:Tesla-T4"

POLICY = "gpushare.io/policy"


async def test_binpack_fills_one_node_spread_uses_all(stack, api, namespace) -> None:
    packed = [f"pack-{i}" for i in range(3)]
    for name in packed:
        await h.create_pod(api, namespace, h.gpu_pod(name, [4], annotations={POLICY: "binpack"}))
        await h.wait_bound(api, namespace, [name])
    nodes = await h.wait_bound(api, namespace, packed)
    assert len(set(nodes.values())) == 1, f"binpack spread pods over nodes: {nodes}"
    allocs = await h.wait_ledger(stack.database_url, namespace, packed)
    # best fit on the node: all three 4 GiB shares on one GPU
    assert len({a["parts"][0]["gpu_uuid"] for a in allocs.values()}) == 1, allocs

    await h.delete_all_pods(api, namespace)
    for name in packed:
        await h.wait_released(stack.database_url, namespace, name)

    spread = [f"spread-{i}" for i in range(3)]
    for name in spread:
        await h.create_pod(api, namespace, h.gpu_pod(name, [4], annotations={POLICY: "spread"}))
        await h.wait_bound(api, namespace, [name])
    nodes = await h.wait_bound(api, namespace, spread)
    assert sorted(nodes.values()) == sorted(stack.node_names), f"spread did not use every node: {nodes}"


async def test_multi_gpu_pod_gets_two_gpus(stack, api, namespace) -> None:
    name = "ddp-2gpu"
    await h.create_pod(api, namespace, h.gpu_pod(name, [8], count=2))
    node = (await h.wait_bound(api, namespace, [name]))[name]
    alloc = (await h.wait_ledger(stack.database_url, namespace, [name]))[name]
    gpus = {p["gpu_uuid"] for p in alloc["parts"]}
    assert len(gpus) == 2, alloc
    assert all(p["memory_mib"] == 4 * 1024 for p in alloc["parts"]), alloc
    assert alloc["node"] == node
    env = await h.container_env(stack, node, namespace, name, "c0")
    assert set(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == gpus, env


async def test_multi_container_pod_each_container_its_share(stack, api, namespace) -> None:
    name = "sidecar-pod"
    await h.create_pod(api, namespace, h.gpu_pod(name, [3, 5]))
    node = (await h.wait_bound(api, namespace, [name]))[name]
    alloc = (await h.wait_ledger(stack.database_url, namespace, [name]))[name]
    parts = {p["container"]: p for p in alloc["parts"]}
    assert set(parts) == {"c0", "c1"}
    assert parts["c0"]["memory_mib"] == 3 * 1024 and parts["c1"]["memory_mib"] == 5 * 1024
    for container, mem in (("c0", 3), ("c1", 5)):
        env = await h.container_env(stack, node, namespace, name, container)
        assert env["NVIDIA_VISIBLE_DEVICES"] == parts[container]["gpu_uuid"], env
        assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(mem), env
        assert env["ALIYUN_COM_GPU_MEM_POD"] == "8", env


async def test_quota_rejects_over_limit_pod(stack, api, namespace) -> None:
    resp = await h.set_quota(stack, "wrong-token", namespace, 4)
    assert resp.status_code in (401, 403), resp.text
    resp = await h.set_quota(stack, ADMIN_TOKEN, namespace, 4)
    assert resp.status_code in (200, 201, 204), resp.text

    await h.create_pod(api, namespace, h.gpu_pod("within-quota", [4]))
    await h.wait_bound(api, namespace, ["within-quota"])
    await h.create_pod(api, namespace, h.gpu_pod("over-quota", [2]))
    assert await h.stays_pending(api, namespace, "over-quota", 5.0)

    view = await h.wait_pending_reason(stack, namespace, "over-quota")
    text = (view["pending"]["summary"] + " " + " ".join(view["pending"]["reasons"].values())).lower()
    assert "quota" in text, view

    # freeing the quota lets it in
    await h.delete_pod(api, namespace, "within-quota")
    await h.wait_released(stack.database_url, namespace, "within-quota")
    await h.wait_bound(api, namespace, ["over-quota"], timeout_s=30)


async def test_inspect_matches_cluster(stack, api, namespace) -> None:
    pods = {"insp-a": [6], "insp-b": [2], "insp-c": [10], "insp-d": [3, 1]}
    for name, mems in pods.items():
        await h.create_pod(api, namespace, h.gpu_pod(name, mems, annotations={POLICY: "binpack"}))
    placed = await h.wait_bound(api, namespace, list(pods))
    await h.wait_ledger(stack.database_url, namespace, list(pods))

    async def agree() -> tuple[dict, dict] | None:
        cluster = await h.cluster_gpu_mem_by_node(api)
        data = await h.inspect_json(stack)
        shown = {n["name"]: sum(g["allocated_memory_mib"] for g in n["gpus"]) // 1024 for n in data["nodes"]}
        want = {node: cluster.get(node, 0) for node in stack.node_names}
        return (shown, want) if {n: shown.get(n) for n in stack.node_names} == want else None

    _, want = await h.poll(agree, 30, what="inspect -o json to match the pods bound in the cluster")
    assert sum(want.values()) >= 22
    assert data_unit_ok(await h.inspect_json(stack))

    table = await h.inspect(stack)
    for node in stack.node_names:
        row = next(line for line in table.splitlines() if line.startswith(node + " "))
        assert f"{want[node]}/32" in row, (node, row, table)
    sections = h.detail_sections(await h.inspect(stack, "-d"))
    for name, node in placed.items():
        rows = sections[node]
        assert name in rows, (name, node, sections)
        assert rows[name] == sum(pods[name]), (name, rows)


def data_unit_ok(data: dict) -> bool:
    """inspect's JSON names its memory unit (GiB here)."""
    return data.get("memory_unit") == "GiB"


async def test_a_node_whose_agent_is_away_is_not_chosen_until_it_registers_again(stack, api, namespace) -> None:
    """kubelet counts a device plugin's devices unhealthy while the plugin is away and reports only healthy ones
    as allocatable (`markResourceUnhealthy`, `GetCapacity`, pkg/kubelet/cm/devicemanager/manager.go), and
    kube-scheduler counts aliyun.com/* itself as shipped: a node whose agent is down gets no GPU pod (kubelet would
    reject it at admission), and gets them again once the agent registered and the node status says so."""
    from kubernetes_asyncio import client

    from devstack.stack.kubelets import NODE_STATUS_UPDATE_S
    from tests.waiting import eventually

    core = client.CoreV1Api(api)
    away = stack.node_names[0]
    agent = stack.processes[f"node-agent-{away}"]

    async def allocatable(node: str) -> int:
        return int((await core.read_node(node)).status.allocatable.get("aliyun.com/gpu-mem", "0"))

    full = await allocatable(away)
    assert full > 0
    await asyncio.to_thread(agent.stop)
    try:
        await eventually(
            lambda: _equals(allocatable(away), 0),
            what="the node's gpu-mem allocatable at 0",
            within=NODE_STATUS_UPDATE_S * 3,
        )
        pinned = h.gpu_pod("while-away", [2])
        pinned["spec"]["nodeSelector"] = {"kubernetes.io/hostname": away}
        await h.create_pod(api, namespace, pinned)
        assert await h.stays_pending(api, namespace, "while-away", 3)

        async def refused_for_memory() -> bool:  # kube-scheduler writes its verdict after its attempt
            return "Insufficient aliyun.com/gpu-mem" in await h.scheduled_condition(api, namespace, "while-away")

        await eventually(refused_for_memory, what="kube-scheduler's verdict: Insufficient gpu-mem", within=30)
    finally:
        await asyncio.to_thread(agent.start)
    await eventually(lambda: _equals(allocatable(away), full), what="the node's gpu-mem back", within=60)
    assert (await h.wait_bound(api, namespace, ["while-away"], timeout_s=60))["while-away"] == away


async def _equals(value, expected) -> bool:  # type: ignore[no-untyped-def]
    return await value == expected


async def test_a_pod_reaching_a_node_whose_agent_is_away_fails_admission_as_on_kubelet(stack, api, namespace) -> None:
    """A pod that reaches kubelet while the node agent is away (here: bound by `spec.nodeName`, before the node
    status says so) is refused at admission for good, as the real kubelet v1.37.2 refuses it (tests/realnode/
    test_restarts.py): phase Failed, reason UnexpectedAdmissionError, "Allocate failed due to no healthy devices
    present; cannot allocate unhealthy devices aliyun.com/gpu-mem, which is unexpected". The stand-in used to try
    again until the agent was back; no kubelet does."""
    from kubernetes_asyncio import client

    away = stack.node_names[1]
    agent = stack.processes[f"node-agent-{away}"]
    standin = stack.kubelets[away].standin
    await asyncio.to_thread(agent.stop)
    try:
        await h.poll(
            lambda: "Healthy" not in standin.devices("aliyun.com/gpu-mem").values(),
            30,
            what="the stand-in to count the agent's devices unhealthy",
        )
        body = h.gpu_pod("arrives-early", [2])
        body["spec"]["nodeName"] = away  # straight to the node, as a pod bound a moment before the agent left
        await h.create_pod(api, namespace, body)

        async def failed() -> client.V1Pod | None:
            pod = await client.CoreV1Api(api).read_namespaced_pod("arrives-early", namespace)
            return pod if pod.status.phase == "Failed" else None

        pod = await h.poll(failed, 30, what="the pod refused at admission")
        assert pod.status.reason == "UnexpectedAdmissionError"
        assert pod.status.message == (
            "Allocate failed due to no healthy devices present; cannot allocate unhealthy devices "
            "aliyun.com/gpu-mem, which is unexpected"
        )
    finally:
        agent.start()
        await agent.wait_ready(60)
    await standin.wait_registered(["aliyun.com/gpu-mem"], timeout_s=60, min_count=2)
    await asyncio.sleep(2)  # it stays failed: kubelet never admits a refused pod again
    pod = await client.CoreV1Api(api).read_namespaced_pod("arrives-early", namespace)
    assert pod.status.phase == "Failed" and (namespace, "arrives-early") not in stack.kubelets[away].envs
