"""Simulated GPU nodes for the dev control plane (no kubelet runs them).

A node is created through the API, the ``not-ready`` taint that admission adds
is removed, and its status subresource gets capacity/allocatable and a Ready
condition, which is all kube-scheduler needs to place pods there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster.waits import cancelled
from shared.annotations import RESOURCE_CORE, RESOURCE_COUNT, RESOURCE_MEM

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
GPUS_ANNOTATION = "gpushare.devcluster/gpus"

GpuSpec = tuple[int, str]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def gpu_resources(gpus: Sequence[GpuSpec]) -> dict[str, str]:
    """Extended resources advertised for a list of ``(mem_gib, model)`` GPUs."""
    return {
        RESOURCE_MEM: str(sum(int(mem) for mem, _ in gpus)),
        RESOURCE_COUNT: str(len(gpus)),
        RESOURCE_CORE: str(100 * len(gpus)),
    }


def ready_condition(ready: bool = True) -> dict[str, str]:
    """A NodeCondition of type Ready with fresh timestamps."""
    now = _now()
    return {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "KubeletNotReady",
        "message": "simulated by gpushare devcluster",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


async def create_gpu_node(
    api_client: ApiClient,
    name: str,
    gpus: Sequence[GpuSpec] = ((16, "Tesla-V100"),),
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    cpu: str = "32",
    memory: str = "128Gi",
    pods: str = "110",
    taints: Sequence[Mapping[str, str]] = (),
    dra: bool = False,
) -> client.V1Node:
    """Create a schedulable simulated node with GPU extended resources.

    ``gpus`` lists ``(mem_gib, model)`` per device; the list is also stored as JSON
    in the ``gpushare.devcluster/gpus`` annotation.  With ``dra`` the node advertises
    no ``aliyun.com/*`` resources: its GPUs are published as a ResourceSlice by its
    node agent (``--dra``). Returns the node after the status patch.
    """
    core = client.CoreV1Api(api_client)
    ann = {
        GPUS_ANNOTATION: json.dumps(
            [{"index": i, "memGiB": int(mem), "model": model} for i, (mem, model) in enumerate(gpus)]
        )
    }
    ann.update(annotations or {})
    node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    node_labels.update(labels or {})
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": node_labels, "annotations": ann},
        "spec": {"taints": [dict(t) for t in taints]} if taints else {},
    }
    await core.create_node(body)
    await untaint_not_ready(api_client, name)
    return await set_node_status(
        api_client, name, () if dra else gpus, cpu=cpu, memory=memory, pods=pods, extended=not dra
    )


async def untaint_not_ready(api_client: ApiClient, name: str, *, attempts: int = 10) -> None:
    """Remove the ``node.kubernetes.io/not-ready`` taint added at creation.

    The patch is guarded by the resourceVersion it read (so it cannot drop a taint someone added
    meanwhile); when another writer got there first, read again and retry.
    """
    core = client.CoreV1Api(api_client)
    for attempt in range(attempts):
        node = await core.read_node(name)
        taints = node.spec.taints or []
        keep = [api_client.sanitize_for_serialization(t) for t in taints if t.key != NOT_READY_TAINT]
        if len(keep) == len(taints):
            return
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": node.metadata.resource_version},
            {"op": "replace", "path": "/spec/taints", "value": keep},
        ]
        try:
            await core.patch_node(name, patch)
            return
        except client.exceptions.ApiException as exc:
            if exc.status not in (409, 422) or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.05 * (attempt + 1))


async def set_node_status(
    api_client: ApiClient,
    name: str,
    gpus: Sequence[GpuSpec],
    *,
    cpu: str = "32",
    memory: str = "128Gi",
    pods: str = "110",
    ready: bool = True,
    allocatable: Mapping[str, str] | None = None,
    extended: bool = True,
) -> client.V1Node:
    """Patch a node's status: capacity/allocatable (GPU resources too, unless not `extended`) and Ready."""
    core = client.CoreV1Api(api_client)
    capacity = {"cpu": cpu, "memory": memory, "pods": pods, **(gpu_resources(gpus) if extended else {})}
    alloc = {**capacity, **(allocatable or {})}
    body: dict[str, Any] = {
        "status": {
            "capacity": capacity,
            "allocatable": alloc,
            "conditions": [ready_condition(ready)],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {
                "kubeletVersion": "v1.20.2",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "simulated://0",
                "kernelVersion": "",
                "osImage": "gpushare devcluster",
                "kubeProxyVersion": "v1.20.2",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }
    }
    return await core.patch_node_status(name, body)


async def delete_node(api_client: ApiClient, name: str, *, missing_ok: bool = True) -> None:
    """Delete a node (no error if it is already gone unless ``missing_ok`` is False)."""
    core = client.CoreV1Api(api_client)
    try:
        await core.delete_node(name)
    except ApiException as exc:
        if not (missing_ok and exc.status == 404):
            raise


class NodeHeartbeat:
    """Periodically refreshes the Ready condition of simulated nodes.

    Not needed while the node-lifecycle controller is disabled (the devcluster
    default); useful for components that look at ``lastHeartbeatTime``.
    """

    def __init__(self, api_client: ApiClient, names: Sequence[str], interval: float = 10.0):
        self.api_client = api_client
        self.names = list(names)
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def beat(self) -> None:
        """Send one heartbeat for every node."""
        core = client.CoreV1Api(self.api_client)
        for name in self.names:
            cond = ready_condition(True)
            with contextlib.suppress(ApiException):
                await core.patch_node_status(name, {"status": {"conditions": [cond]}})

    async def _loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.interval)

    def start(self) -> NodeHeartbeat:
        """Begin heartbeating in a background task."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        """Stop the background task."""
        task, self._task = self._task, None
        await cancelled(task)

    async def __aenter__(self) -> NodeHeartbeat:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
