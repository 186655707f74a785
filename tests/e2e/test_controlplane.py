"""The dev control plane schedules pods onto simulated nodes with the real kube-scheduler."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from kubernetes_asyncio import client

from devstack.cluster import ControlPlane, Paths
from devstack.cluster.nodes import create_gpu_node, delete_node
from devstack.cluster.waits import wait_for_pod_node, wait_for_pods_bound
from shared.annotations import RESOURCE_COUNT as GPU_COUNT
from shared.annotations import RESOURCE_MEM as GPU_MEM

pytestmark = pytest.mark.e2e

BIND_TIMEOUT = 60.0


def _container(name: str = "main") -> dict:
    return {
        "name": name,
        "image": "busybox:1.36",
        "command": ["sleep", "3600"],
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
    }


async def test_scheduler_binds_pod_and_deployment(control_plane: ControlPlane) -> None:
    """A plain pod and a 2-replica Deployment get bound to the simulated node."""
    node_name = f"gpu-node-{uuid.uuid4().hex[:6]}"
    ns = "default"
    async with control_plane.api_client() as api:
        core = client.CoreV1Api(api)
        apps = client.AppsV1Api(api)
        node = await create_gpu_node(
            api, node_name, gpus=[(16, "Tesla-V100"), (16, "Tesla-V100")], labels={"gpushare": "true"}
        )
        assert node.status.allocatable[GPU_MEM] == "32"
        assert node.status.allocatable[GPU_COUNT] == "2"
        assert not [t for t in (node.spec.taints or []) if t.key.startswith("node.kubernetes.io")]

        pod_name = f"plain-{uuid.uuid4().hex[:6]}"
        await core.create_namespaced_pod(
            ns,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod_name, "labels": {"app": pod_name}},
                "spec": {"containers": [_container()]},
            },
        )
        assert await wait_for_pod_node(api, ns, pod_name, BIND_TIMEOUT) == node_name

        dep_name = f"dep-{uuid.uuid4().hex[:6]}"
        labels = {"app": dep_name}
        await apps.create_namespaced_deployment(
            ns,
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": dep_name},
                "spec": {
                    "replicas": 2,
                    "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels}, "spec": {"containers": [_container()]}},
                },
            },
        )
        pods = await wait_for_pods_bound(api, ns, f"app={dep_name}", 2, BIND_TIMEOUT)
        assert {p.spec.node_name for p in pods} == {node_name}

        await apps.delete_namespaced_deployment(dep_name, ns)
        await core.delete_namespaced_pod(pod_name, ns, grace_period_seconds=0)
        await delete_node(api, node_name)


def test_start_stop_leaves_no_processes(control_plane_binaries: Paths) -> None:
    """A separate ControlPlane stops every process and removes its work dir."""
    cp = ControlPlane(paths=control_plane_binaries)
    with cp:
        pids = cp.pids
        assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
        assert all(cp.running().values())
        assert cp.kubeconfig_path.is_file()
        work_dir = cp.work_dir
    assert not any(cp.running().values())
    for name, pid in pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert name
    assert not work_dir.exists()


async def test_token_and_client_certificate_kubeconfigs_both_work(control_plane: ControlPlane) -> None:
    """The two ordinary kinds of kubeconfig user a managed cluster hands out reach the current apiserver through
    the services' own client (`shared.kube.client.api_client`): a token and a client certificate. (The local
    stack runs its services with the certificate and its tests with the token.)"""
    from shared.kube.binding import create_binding
    from shared.kube.client import api_client
    from shared.kube.pods import get_pod

    node_name = f"cert-node-{uuid.uuid4().hex[:6]}"
    for kubeconfig in (control_plane.kubeconfig_path, control_plane.cert_kubeconfig_path):
        user = json.loads(kubeconfig.read_text())["users"][0]["user"]
        api = await api_client(str(kubeconfig))
        try:
            core = client.CoreV1Api(api)
            if not any(n.metadata.name == node_name for n in (await core.list_node()).items):
                await create_gpu_node(api, node_name, gpus=[(16, "Tesla-T4")])
            name = f"via-{'cert' if 'client-certificate' in user else 'token'}-{uuid.uuid4().hex[:5]}"
            body = {"metadata": {"name": name}, "spec": {"schedulerName": "nobody", "containers": [_container()]}}
            created = await core.create_namespaced_pod("default", body)
            await create_binding(api, "default", name, node_name, uid=created.metadata.uid, annotations={"a": "b"})
            pod = await get_pod(api, "default", name)
            assert pod is not None and pod["spec"]["nodeName"] == node_name
            assert pod["metadata"]["annotations"]["a"] == "b"
            await core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
        finally:
            await api.close()
    assert "client-certificate" in json.loads(control_plane.cert_kubeconfig_path.read_text())["users"][0]["user"]
    async with control_plane.api_client() as admin:
        await delete_node(admin, node_name)


async def test_a_watch_keeps_the_selector_of_its_list(control_plane: ControlPlane) -> None:
    """`watch_objects(..., field_selector=...)` passes its parameters to the watch as well as to the list: the
    extender's watch of unbound pods (`spec.nodeName=`) must not receive every pod update of the cluster after its
    first list (it did: the parameters went to the list only). Real kube-apiserver: a pod that becomes bound leaves
    the selection, which a watch reports as DELETED, and the bound pod's later updates are not sent at all."""
    import asyncio
    import contextlib

    from shared.kube.watching import DELETED, SYNCED, watch_objects

    node_name = f"sel-node-{uuid.uuid4().hex[:6]}"
    ns, pod_name = "default", f"sel-{uuid.uuid4().hex[:6]}"
    seen: list[tuple[str, str]] = []  # (event type, the pod's nodeName)
    async with control_plane.api_client() as api:
        core = client.CoreV1Api(api)
        await create_gpu_node(api, node_name, gpus=[(16, "Tesla-V100")])
        stop, synced, left = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def follow() -> None:
            async for event in watch_objects(
                core.list_pod_for_all_namespaces, what="unbound pods", stop=stop, field_selector="spec.nodeName="
            ):
                if event.type == SYNCED:
                    synced.set()
                elif event.object["metadata"]["name"] == pod_name:
                    seen.append((event.type, str(event.object["spec"].get("nodeName") or "")))
                    if event.type == DELETED:
                        left.set()

        follower = asyncio.create_task(follow())
        try:
            await asyncio.wait_for(synced.wait(), 30)
            await core.create_namespaced_pod(
                ns, {"metadata": {"name": pod_name}, "spec": {"containers": [_container()]}}
            )
            assert await wait_for_pod_node(api, ns, pod_name, BIND_TIMEOUT) == node_name
            await core.patch_namespaced_pod(pod_name, ns, {"metadata": {"labels": {"touched": "yes"}}})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(left.wait(), 10)
            await asyncio.sleep(1.0)  # the label patch's event would come by now, had the watch no selector
        finally:
            stop.set()
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await core.delete_namespaced_pod(pod_name, ns, grace_period_seconds=0)
            await delete_node(api, node_name)
    assert seen[0] == ("ADDED", ""), seen
    assert all(node == "" for kind, node in seen if kind != DELETED), seen  # no update of the bound pod
    assert seen[-1][0] == DELETED, seen  # the bind took it out of the selection (the event shows it as it matched)
