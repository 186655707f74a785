"""GPU init containers, sidecars and the containers that reuse an init container's devices, with the kubelet
stand-in answering as kubelet does (k8s.io/kubernetes v1.37.2 and v1.20.2):

* pod-resources `List` (pkg/kubelet/apis/podresources/server_v1.go, `v1PodResourcesServer.List`) names app
  containers and, from 1.29, sidecars (`podutil.IsRestartableInitContainer`); never a regular init container. 1.20
  names app containers only.
* The device manager (pkg/kubelet/cm/devicemanager/manager.go) allocates at admission, init containers first
  (`ManagerImpl.Allocate`, called by the topology manager's `allocateAlignedResources` for
  `append(pod.Spec.InitContainers, pod.Spec.Containers...)`); `devicesToAllocate` takes the pod's `devicesToReuse`
  first; a regular init container's devices are added to them (`podDevices.addContainerAllocatedResources`,
  pod_devices.go), a sidecar's and an app container's taken out (`removeContainerAllocatedResources`).
* PreStartContainer comes when each container starts (`GetDeviceRunContainerOptions` ->
  `callPreStartContainerIfNeeded`), init containers first, with the container's own devices.

So when PreStartContainer asks who holds an init container's devices, kubelet names at most the later containers
of its pod that were handed them on. Before, the agent required pod-resources to name the init container itself:
on a real kubelet every GPU init container was refused at PreStart.
"""

from __future__ import annotations

from typing import Any

import pytest

from devstack.cluster.releases import COMPAT, CURRENT, Release
from services.node_agent import podresources
from tests.node_agent.conftest import Harness

MEM = "aliyun.com/gpu-mem"


async def listed(harness: Harness) -> dict[tuple[str, str], dict[str, set[str]]]:
    """What the stand-in's pod-resources API answers: {(namespace, pod): {container: gpu-mem device IDs}}."""
    pb, grpc_mod = podresources.pr_pb2, podresources.pr_grpc
    import grpc

    async with grpc.aio.insecure_channel(f"unix://{harness.kubelet.pod_resources_socket}") as channel:
        reply = await grpc_mod.PodResourcesListerStub(channel).List(pb.ListPodResourcesRequest(), timeout=5)
    return {
        (p.namespace, p.name): {
            c.name: {d for dev in c.devices if dev.resource_name == MEM for d in dev.device_ids} for c in p.containers
        }
        for p in reply.pod_resources
    }


def with_plain_container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """The pod with one more app container that asks for no GPU."""
    pod["spec"]["containers"].append({"name": name})
    return pod


@pytest.mark.parametrize("release", [CURRENT, COMPAT], ids=lambda r: r.version)
async def test_pod_resources_names_the_containers_kubelet_names(harness: Harness, release: Release) -> None:
    """The init container, the sidecar and the app container all hold devices; kubelet lists the app containers
    (the plain one too, without devices) and, from 1.29, the sidecar; never the regular init container. 1.20
    knows no sidecars: its `proxy` is a regular init container there."""
    k = harness.kubelet
    k.release = release
    sidecars = release.minor >= 29
    pod, _ = await harness.reserve(
        "listed",
        [("setup", [(0, 6)]), ("proxy", [(0, 4)]), ("main", [(0, 8)])],
        init=["setup"] if sidecars else ["setup", "proxy"],
        sidecars=["proxy"] if sidecars else [],
    )
    await k.admit(with_plain_container(pod, "log"))
    containers = (await listed(harness))[("default", "listed")]
    if sidecars:
        assert list(containers) == ["proxy", "main", "log"]
    else:
        assert list(containers) == ["main", "log"]
    assert "setup" not in containers and containers["log"] == set()
    assert containers["main"] == set(k.assigned(pod, "main", MEM))


async def test_an_init_container_whose_devices_the_app_container_takes_over(harness: Harness) -> None:
    """init 4 GiB, then app 4 GiB on the same GPU: kubelet hands the app all four of the init container's devices.
    At the init container's PreStart pod-resources names only the app container as holder; the init container
    is confirmed from it (before: refused, as if kubelet had given the init container's devices to another
    container)."""
    pod, alloc = await harness.reserve("takeover", [("setup", [(0, 4)]), ("main", [(0, 4)])], init=["setup"])
    k = harness.kubelet
    envs = await k.admit(pod)
    assert set(k.assigned(pod, "main", MEM)) == set(k.assigned(pod, "setup", MEM))
    for container in ("setup", "main"):
        assert envs[container]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(0)
        assert await harness.ledger_gpus(alloc, container) == ("assigned", [harness.gpu(0)], True)


@pytest.mark.parametrize("release", [CURRENT, COMPAT], ids=lambda r: r.version)
async def test_an_init_container_no_later_container_reuses(harness: Harness, release: Release) -> None:
    """A GPU init container before app containers that ask for no GPU: nothing on the node lists its devices at
    PreStart; it is confirmed as Allocate decided (before: "lists no container holding 6 devices")."""
    harness.kubelet.release = release
    pod, alloc = await harness.reserve("warmup", [("setup", [(1, 6)])], init=["setup"])
    pod["spec"]["containers"] = [{"name": "main"}]
    env = (await harness.kubelet.admit(pod))["setup"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(1)
    assert await harness.ledger_gpus(alloc, "setup") == ("assigned", [harness.gpu(1)], True)


async def test_pods_with_gpu_init_containers_admitted_against_the_prediction(harness: Harness) -> None:
    """Pods a (older, GPU 0) and b (GPU 1), each an init container of 4 GiB and an app container of 4 GiB. kubelet
    admits b first: it gets a's devices on GPU 0 (the agent's preference), and its app container is handed the
    init container's devices. The app container's Allocate is matched within the init container's pod as decided
    (a), PreStart then learns from pod-resources that b received them: both containers are exchanged, and each
    pod ends with the GPU its environment names."""
    a, a_id = await harness.reserve("ia", [("setup", [(0, 4)]), ("main", [(0, 4)])], init=["setup"])
    b, b_id = await harness.reserve("ib", [("setup", [(1, 4)]), ("main", [(1, 4)])], init=["setup"])
    k = harness.kubelet
    env_b = await k.admit(b)
    env_a = await k.admit(a)
    for pod_id, envs, gpu in ((b_id, env_b, harness.gpu(0)), (a_id, env_a, harness.gpu(1))):
        for container in ("setup", "main"):
            assert envs[container]["NVIDIA_VISIBLE_DEVICES"] == gpu, (container, envs)
            assert await harness.ledger_gpus(pod_id, container) == ("assigned", [gpu], True)


async def test_agent_restart_between_allocate_and_an_init_containers_prestart(harness: Harness) -> None:
    """The agent forgets its Allocate decisions; the init container's PreStart is recomputed from the pod whose
    app container pod-resources lists with some of its devices."""
    pod, alloc = await harness.reserve("restart-init", [("setup", [(0, 6)]), ("main", [(0, 2)])], init=["setup"])
    k = harness.kubelet
    envs = await k.admit(pod, start=False)
    async with harness.restarted_agent():
        await k.start_pod(pod)
    for container in ("setup", "main"):
        assert envs[container]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(0)
        assert await harness.ledger_gpus(alloc, container) == ("assigned", [harness.gpu(0)], True)


@pytest.mark.parametrize("release", [CURRENT, COMPAT], ids=lambda r: r.version)
async def test_get_answers_one_pod_as_list_shows_it(harness: Harness, release: Release) -> None:
    """pod-resources `Get` (kubelet 1.34+): the one pod, its containers as `List` shows them; an unknown pod is an
    error naming it. 1.20 has no `Get`: an unknown method."""
    import grpc

    k = harness.kubelet
    k.release = release
    pod, _ = await harness.reserve("one", [("main", [(0, 3)])])
    await k.admit(with_plain_container(pod, "log"))
    client = podresources.PodResourcesClient(str(k.pod_resources_socket))
    stub = client._lister()
    request = podresources.pr_pb2.GetPodResourcesRequest(pod_name="one", pod_namespace="default")
    try:
        if release.minor < 34:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Get(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert await client.pod("default", "one", MEM) is None and not client.get_available
            return
        reply = await stub.Get(request, timeout=5)
        assert (reply.pod_resources.namespace, reply.pod_resources.name) == ("default", "one")
        got = {c.name: {d for dev in c.devices for d in dev.device_ids} for c in reply.pod_resources.containers}
        assert got == (await listed(harness))[("default", "one")]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Get(podresources.pr_pb2.GetPodResourcesRequest(pod_name="nope", pod_namespace="x"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNKNOWN
        assert err.value.details() == "pod nope in namespace x not found"
        assert await client.pod("x", "nope", MEM) is None and client.get_available
    finally:
        await client.close()


@pytest.mark.parametrize("release", [CURRENT, COMPAT], ids=lambda r: r.version)
async def test_prestart_reads_kubelets_answer_for_its_own_pod(harness: Harness, release: Release) -> None:
    """PreStart of a container that received what Allocate decided asks kubelet about its own pod (`Get`), not
    about every pod of the node (`List`, read and parsed per PreStart: its cost grew with the node's pods); kubelet
    1.20 has no `Get` and is listed, and the agent asks it `Get` no more."""
    k = harness.kubelet
    k.release = release
    for name in ("other-1", "other-2"):
        other, _ = await harness.reserve(name, [("main", [(1, 2)])])
        await k.admit(other)
    pod, alloc = await harness.reserve("own", [("main", [(0, 3)])])
    await k.admit(pod, start=False)
    k.pod_resources_calls.clear()
    await k.start_pod(pod)
    assert await harness.ledger_gpus(alloc, "main") == ("assigned", [harness.gpu(0)], True)
    if release.minor >= 34:
        assert k.pod_resources_calls == {"Get": 1}
    else:
        assert k.pod_resources_calls.get("List") == 1 and not harness.agent.assigner.pod_resources.get_available
