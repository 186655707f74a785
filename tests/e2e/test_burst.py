"""A burst on the real control plane: 300 pods of 1 and 2 GiB over 4 nodes x 8 GPUs, a kubelet stand-in per
node that admits pods in kubelet's order (creation time, then arrival) and calls GetPreferredAllocation,
Allocate and PreStartContainer, starting each admitted pod in a task of its own as kubelet's pod workers do.
For every pod, the container's environment, the ledger, both annotations
(`ALIYUN_COM_GPU_MEM_IDX` and `gpushare.io/allocation`) and `gpushare inspect` name the same GPU.

Where kubelet admits another pod than the agent expected, the PreStart exchange corrects the ledger and the
binder then rewrites both pods' annotations: the count of exchanges is printed (and kept low by the agent's
prediction of kubelet's admission order).
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from kubernetes_asyncio import client

from shared.annotations import ALLOCATION, GPU_MEM_IDX, parse_allocation
from tests.e2e import helpers as h

pytestmark = pytest.mark.e2e

STACK_NODES = 4
STACK_GPUS = "8x16GiB:Tesla-T4"
PODS = 300
IN_FLIGHT = 16


@pytest.fixture
def pod_workers(stack):  # type: ignore[no-untyped-def]
    """The kubelet stand-ins start admitted pods concurrently, as kubelet's pod workers do (admission stays serial,
    `Kubelet.HandlePodAdditions`; each pod's containers start in its own worker, `podWorkers.UpdatePod`, in
    pkg/kubelet of k8s.io/kubernetes v1.37.2), so PreStarts of different pods reach the node agent together."""
    for kubelet in stack.kubelets.values():
        kubelet.concurrent_start = True
    yield
    for kubelet in stack.kubelets.values():
        kubelet.concurrent_start = False


async def test_every_record_names_the_gpu_the_container_got(stack, api, namespace, pod_workers) -> None:
    names = [f"burst-{i:03d}" for i in range(PODS)]
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def create(i: int, name: str) -> None:
        body = h.gpu_pod(name, [1 + i % 2])
        async with gate:
            await h.create_pod(api, namespace, body)

    await asyncio.gather(*(create(i, n) for i, n in enumerate(names)))
    await h.wait_bound(api, namespace, names, timeout_s=300)

    async def all_started() -> dict | None:
        envs = {}
        for name in names:
            for node in stack.node_names:
                env = await h.kubelet_env(stack.kubelets[node], namespace, name, "c0")
                if env is not None:
                    envs[name] = env
                    break
        return envs if len(envs) == len(names) else None

    envs = await h.poll(all_started, 300, interval=2, what=f"{PODS} containers started by the kubelet stand-ins")

    async def assigned_in_ledger() -> dict | None:
        allocs = await h.ledger_allocations(stack.database_url, namespace)
        return allocs if len(allocs) == PODS and all(a["state"] == "assigned" for a in allocs.values()) else None

    ledger = await h.poll(assigned_in_ledger, 120, interval=1, what="every allocation assigned in the ledger")

    core = client.CoreV1Api(api)

    async def annotations_agree() -> list[str] | None:
        pods = {p.metadata.name: p for p in (await core.list_namespaced_pod(namespace)).items}
        wrong = [n for n in names if _disagreement(n, pods[n], envs[n], ledger[n])]
        return wrong or None

    # the annotations follow the ledger a moment after each exchange: wait until none disagrees
    leftover = await _settles(annotations_agree, 60)
    assert not leftover, f"{len(leftover)} pods disagree, e.g. {leftover[:5]}"

    data = await h.inspect_json(stack, "-d")
    shown = {
        a["pod_name"]: {p["gpu_uuid"] for p in a["parts"]}
        for n in data["nodes"]
        for a in n.get("allocations", [])
        if a["namespace"] == namespace
    }
    assert len(shown) == PODS
    assert [n for n in names if shown[n] != {ledger[n]["parts"][0]["gpu_uuid"]}] == []

    exchanged = await _exchanges(stack)
    print(f"\n{PODS} pods: {exchanged} exchanges ({100 * exchanged / PODS:.1f} %)")


def _disagreement(name: str, pod, env: dict[str, str], alloc: dict) -> str:  # type: ignore[no-untyped-def]
    """What disagrees about one pod's GPU ('' when environment, ledger and both annotations agree)."""
    (part,) = alloc["parts"]
    ann = pod.metadata.annotations or {}
    if env["NVIDIA_VISIBLE_DEVICES"] != part["gpu_uuid"]:
        return f"{name}: env {env['NVIDIA_VISIBLE_DEVICES']} vs ledger {part['gpu_uuid']}"
    if ann.get(GPU_MEM_IDX) != str(part["gpu_index"]):
        return f"{name}: {GPU_MEM_IDX} {ann.get(GPU_MEM_IDX)} vs ledger {part['gpu_index']}"
    _, _, parts = parse_allocation(ann[ALLOCATION])
    if [p.gpu_uuid for p in parts] != [part["gpu_uuid"]]:
        return f"{name}: {ALLOCATION} names {[p.gpu_uuid for p in parts]}"
    if env["ALIYUN_COM_GPU_MEM_IDX"] != str(part["gpu_index"]):
        return f"{name}: env index {env['ALIYUN_COM_GPU_MEM_IDX']} vs ledger {part['gpu_index']}"
    return ""


async def _settles(check, within: float):  # type: ignore[no-untyped-def]
    """Poll `check` (it returns what is still wrong, or None) until nothing is; returns the last leftovers."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        leftover = await check()
        if not leftover or asyncio.get_running_loop().time() > deadline:
            return leftover
        await asyncio.sleep(1)


async def _exchanges(stack) -> int:  # type: ignore[no-untyped-def]
    """Exchanges the node agents made (their `gpushare_node_agent_device_plugin_outcomes_total{reason="exchanged"}`)."""
    total = 0
    async with httpx.AsyncClient(timeout=10) as http:
        for name, proc in stack.processes.items():
            if not name.startswith("node-agent-"):
                continue
            text = (await http.get(proc.command.listens + "/metrics")).text
            for line in text.splitlines():
                if line.startswith("gpushare_node_agent_device_plugin_outcomes_total") and 'reason="exchanged"' in line:
                    total += int(float(re.split(r"\s+", line)[-1]))
    return total
