"""The same-size race with a kubelet that ignores the agent's preference: it hands each container the devices of
a GPU chosen at random. Eight 4 GiB pods fill one node's two 16 GiB GPUs through the real kube-scheduler; each
wrong pick is corrected by the PreStart exchange (same size) or refused and admitted again, and in the end every
container runs on the GPU the ledger records, with no GPU holding more than it has."""

from __future__ import annotations

import random

import pytest

from tests.e2e import helpers as h

pytestmark = pytest.mark.e2e

STACK_NODES = 1
STACK_GPUS = "2x16GiB:Tesla-T4"
PODS = [f"rand-{i}" for i in range(8)]


async def test_random_device_picks_end_exactly(stack, api, namespace) -> None:
    node = stack.node_names[0]
    stack.kubelets[node].standin.random_devices = random.Random(20241)
    try:
        for name in PODS:
            await h.create_pod(api, namespace, h.gpu_pod(name, [4]))
        await h.wait_bound(api, namespace, PODS)
        envs = {name: await h.container_env(stack, node, namespace, name, "c0", timeout_s=120) for name in PODS}
    finally:
        stack.kubelets[node].standin.random_devices = None
    ledger = await h.wait_ledger(stack.database_url, namespace, PODS)
    for name in PODS:
        assert envs[name]["NVIDIA_VISIBLE_DEVICES"] == ledger[name]["parts"][0]["gpu_uuid"], name
    gpus = await h.gpu_rows(stack.database_url, node)
    assert [g["allocated_memory_mib"] for g in gpus] == [16 * 1024, 16 * 1024]
    per_gpu: dict[str, int] = {}
    for name in PODS:
        per_gpu[envs[name]["NVIDIA_VISIBLE_DEVICES"]] = per_gpu.get(envs[name]["NVIDIA_VISIBLE_DEVICES"], 0) + 4
    assert sorted(per_gpu.values()) == [16, 16], "four 4 GiB containers really run on each GPU"
