"""Client of kubelet's pod-resources API: which pod and container really hold given device IDs.

kubelet lists only the containers that run for the pod's life: app containers and (from 1.29) sidecars, never a
regular init container (`v1PodResourcesServer.List`, pkg/kubelet/apis/podresources/server_v1.go; 1.20 lists app
containers only). A regular init container's devices show up, if at all, under the later containers of its pod that
kubelet's device manager handed them on to (`devicesToReuse`): devices belong to one pod at a time, so a container
listing any of them names the pod that received them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from shared.kubelet_api import load

pr_pb2, pr_grpc = load("podresources")


@dataclass(frozen=True)
class Listed:
    """One container as kubelet lists it, with its device IDs of one resource."""

    namespace: str
    pod: str
    container: str
    device_ids: frozenset[str]


async def listing(socket_path: str, resource: str, timeout_s: float = 5.0) -> list[Listed]:
    """Every container kubelet lists that holds devices of `resource`. Raises grpc.aio.AioRpcError when the API is
    unreachable."""
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        reply = await pr_grpc.PodResourcesListerStub(channel).List(pr_pb2.ListPodResourcesRequest(), timeout=timeout_s)
    out = []
    for pod in reply.pod_resources:
        for c in pod.containers:
            ids = frozenset(d for dev in c.devices if dev.resource_name == resource for d in dev.device_ids)
            if ids:
                out.append(Listed(pod.namespace, pod.name, c.name, ids))
    return out


def holders(listed: Iterable[Listed], device_ids: Iterable[str]) -> list[tuple[str, str, str]]:
    """(namespace, pod name, container) of every listed container that holds all of `device_ids` (pure)."""
    wanted = set(device_ids)
    return [(c.namespace, c.pod, c.container) for c in listed if wanted and wanted <= c.device_ids]


def pods_holding_any(listed: Iterable[Listed], device_ids: Iterable[str]) -> set[tuple[str, str]]:
    """(namespace, pod name) of every pod a listed container of which holds any of `device_ids` (pure)."""
    wanted = set(device_ids)
    return {(c.namespace, c.pod) for c in listed if wanted & c.device_ids}
