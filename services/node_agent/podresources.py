"""Client of kubelet's pod-resources API (`List`, and `Get` where kubelet has it): which pod and container really
hold given device IDs.

kubelet lists only the containers that run for the pod's life: app containers and (from 1.29) sidecars, never a
regular init container (`v1PodResourcesServer.List`, pkg/kubelet/apis/podresources/server_v1.go; 1.20 lists app
containers only). A regular init container's devices show up, if at all, under the later containers of its pod that
kubelet's device manager handed them on to (`devicesToReuse`): devices belong to one pod at a time, so a container
listing any of them names the pod that received them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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


class PodResourcesClient:
    """kubelet's pod-resources API over one channel, kept open (a channel per call cost more than the call; gRPC
    reconnects it by the socket's path after a kubelet restart)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.get_available = True  # kubelet answers `Get` (1.34+ by default; none in 1.20)
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    def _lister(self) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket_path}")
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    async def listing(self, resource: str, timeout_s: float = 5.0) -> list[Listed]:
        """Every container kubelet lists that holds devices of `resource`. Raises grpc.aio.AioRpcError when the API
        is unreachable."""
        reply = await self._lister().List(pr_pb2.ListPodResourcesRequest(), timeout=timeout_s)
        return [c for pod in reply.pod_resources for c in _listed(pod, resource)]

    async def pod(self, namespace: str, name: str, resource: str, timeout_s: float = 5.0) -> list[Listed] | None:
        """The containers kubelet lists for one pod that hold devices of `resource` (`Get`, which reads one pod, not
        all of the node's); None when kubelet does not offer `Get` or answered with an error (an unknown pod, say):
        the caller lists every pod instead."""
        if not self.get_available:
            return None
        try:
            reply = await self._lister().Get(
                pr_pb2.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.get_available = False
            return None
        return _listed(reply.pod_resources, resource)

    async def close(self) -> None:
        """Close the channel."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()


def _listed(pod: Any, resource: str) -> list[Listed]:
    out = []
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
