"""Client of kubelet's pod-resources API: which pod and container really hold given device IDs."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from shared.kubelet_api import load

pr_pb2, pr_grpc = load("podresources")


async def holders(socket_path: str, resource: str, device_ids: Iterable[str], timeout_s: float = 5.0) -> list[tuple]:
    """(namespace, pod name, container) of every container kubelet gave all of `device_ids` of `resource`.

    Raises grpc.aio.AioRpcError when the API is unreachable.
    """
    wanted = set(device_ids)
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        reply = await pr_grpc.PodResourcesListerStub(channel).List(pr_pb2.ListPodResourcesRequest(), timeout=timeout_s)
    out = []
    for pod in reply.pod_resources:
        for c in pod.containers:
            ids = {d for dev in c.devices if dev.resource_name == resource for d in dev.device_ids}
            if wanted and wanted <= ids:
                out.append((pod.namespace, pod.name, c.name))
    return out
