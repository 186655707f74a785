"""GPU init containers on the real current release (kube-apiserver, kube-scheduler, kube-controller-manager 1.37) with
the whole stack, one node of two 16 GiB GPUs, and a kubelet stand-in that answers as kubelet 1.37 does: its
pod-resources `List` names app containers and sidecars, never a regular init container
(pkg/kubelet/apis/podresources/server_v1.go, `v1PodResourcesServer.List`), and its device manager hands a regular
init container's devices on to the containers allocated after it (pkg/kubelet/cm/devicemanager/manager.go,
`ManagerImpl.Allocate` / `devicesToAllocate` with `devicesToReuse`), before calling PreStartContainer as each
container starts (`GetDeviceRunContainerOptions`).

Before: the binpack solver put the 4 GiB app container on the fuller GPU and the 8 GiB init container, which did not
fit there, on the other; kubelet handed the app container the init container's devices, and the agent refused its
Allocate. And with the placement right, the agent refused the init container's PreStart, as pod-resources named the
app container as the holder of its devices. A pod that kubelet's reuse keeps on one GPU that none has room for was
placed split, and refused at admission; it now stays pending with the reason.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client

from shared.annotations import GPU_MEM_IDX
from tests.e2e import helpers as h
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

STACK_NODES = 1
STACK_GPUS = "2x16GiB:Tesla-T4"


def with_init(pod: dict[str, Any], name: str, gib: int) -> dict[str, Any]:
    """The pod with a regular GPU init container first."""
    init = {
        "name": name,
        "image": "busybox",
        "command": ["true"],
        "resources": {"limits": {"aliyun.com/gpu-mem": str(gib)}},
    }
    pod["spec"]["initContainers"] = [init, *pod["spec"].get("initContainers", [])]
    return pod


async def test_an_init_container_and_the_app_container_that_reuses_its_devices(stack, api, namespace) -> None:
    node = stack.node_names[0]
    gpus = await h.gpu_rows(stack.database_url, node)
    await h.create_pod(api, namespace, h.gpu_pod("filler", [10]))  # GPU 0 keeps 6 GiB free
    await h.wait_bound(api, namespace, ["filler"])
    filler = (await h.wait_ledger(stack.database_url, namespace, ["filler"]))["filler"]
    assert filler["parts"][0]["gpu_uuid"] == gpus[0]["uuid"]

    await h.create_pod(api, namespace, with_init(h.gpu_pod("warm", [4]), "setup", 8))
    await h.wait_bound(api, namespace, ["warm"])
    envs = {c: await h.container_env(stack, node, namespace, "warm", c) for c in ("setup", "c0")}
    allocs = await h.wait_ledger(stack.database_url, namespace, ["warm"])
    parts = {p["container"]: p for p in allocs["warm"]["parts"]}
    # kubelet's reuse: the app container took 4 of the init container's 8 devices, so both hold GPU 1
    assert parts["setup"]["gpu_uuid"] == parts["c0"]["gpu_uuid"] == gpus[1]["uuid"]
    for c in ("setup", "c0"):
        assert envs[c]["NVIDIA_VISIBLE_DEVICES"] == gpus[1]["uuid"], (c, envs[c])
    standin = stack.kubelets[node].standin
    body = {"metadata": {"namespace": namespace, "name": "warm"}}
    reused = set(standin.assigned(body, "setup", "aliyun.com/gpu-mem")) & set(
        standin.assigned(body, "c0", "aliyun.com/gpu-mem")
    )
    assert len(reused) == 4
    # pod-resources names the app container only, as kubelet does
    listed = {c for ns, pod, cs in standin.pod_resources() if (ns, pod) == (namespace, "warm") for c, _ in cs}
    assert listed == {"c0"}

    async def assigned() -> dict | None:
        now = (await h.ledger_allocations(stack.database_url, namespace))["warm"]
        return now if now["state"] == "assigned" else None

    await h.poll(assigned, 30, what="the pod's allocation assigned (both PreStarts confirmed)")
    pod = await client.CoreV1Api(api).read_namespaced_pod("warm", namespace)
    assert pod.metadata.annotations[GPU_MEM_IDX] == "1"
    assert not stack.kubelets[node].errors, stack.kubelets[node].errors


async def test_a_pod_that_kubelets_reuse_keeps_on_one_gpu_waits_for_one_with_room(stack, api, namespace) -> None:
    """GPU 0 has 6 GiB free, GPU 1 8 GiB. init 8 GiB, then app containers of 6 and 6: the first takes 6 of the init
    container's devices, the second the other 2, so all three must share one GPU with 12 GiB. Split over the two
    GPUs it fitted before, and kubelet refused it at admission; it stays pending with the reason now."""
    node = stack.node_names[0]
    await h.create_pod(api, namespace, h.gpu_pod("filler-0", [10]))
    await h.create_pod(api, namespace, h.gpu_pod("filler-1", [8]))
    await h.wait_bound(api, namespace, ["filler-0", "filler-1"])
    await h.create_pod(api, namespace, with_init(h.gpu_pod("wide", [6, 6]), "setup", 8))
    assert await h.stays_pending(api, namespace, "wide", 6.0)

    async def extenders_reason() -> str | None:  # the extender's refusal reaches accounting apart from the pod watch
        view = await h.accounting_pod(stack, namespace, "wide")
        return (((view or {}).get("pending") or {}).get("reasons") or {}).get(node)

    reason = await eventually(extenders_reason, what="accounting to show the extender's reason for wide", within=30)
    assert "kubelet hands the GPU memory devices of init container setup on to container c0, container c1" in reason
    assert "must share a GPU" in reason, reason
    assert "wide" not in await h.ledger_allocations(stack.database_url, namespace)
