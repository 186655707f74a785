"""A kubelet stand-in for tests and `gpushare up`: the device-plugin side of kubelet over real gRPC.

    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket)
    await kubelet.start()                                  # serves Registration on <plugin_dir>/kubelet.sock
    await kubelet.wait_registered(["aliyun.com/gpu-mem"])  # plugins dial in
    envs = await kubelet.admit(pod)                        # {container name: env}, like kubelet's admission
    await kubelet.restart_container(pod, "main")           # PreStartContainer again, same devices
    await kubelet.restart()                                # kubelet restart: sockets deleted, new server
    await kubelet.stop()

It behaves as kubelet does where it matters to a device plugin: it opens ListAndWatch per registered
resource and tracks device health; for each container (init containers first, sidecars among them) and
each extended resource it picks devices (asking GetPreferredAllocation when offered, else the first free
healthy IDs), calls Allocate, records the assignment (served back on the pod-resources `List` API from its
own socket), then calls PreStartContainer when the plugin asks for it. Like kubelet's device manager
(`devicesToReuse`), a regular init container's devices may be handed again to the containers after it,
which take them first; a sidecar (`restartPolicy: Always`) or app container keeps its devices, so no later
container gets them. Where kubelet takes reusable devices in Go's set order, the stand-in takes them in
the order they were allocated. Pods are admitted in the order the caller chooses, so tests can reproduce
admission races. It does not run containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from shared.kubelet_api import KUBELET_SOCKET

log = logging.getLogger(__name__)


def _protos() -> tuple[Any, Any, Any, Any]:
    # the node agent owns the compiled kubelet protos; they are generated on first import
    from shared.kubelet_api import load

    dp_pb2, dp_grpc = load("deviceplugin")
    pr_pb2, pr_grpc = load("podresources")
    return dp_pb2, dp_grpc, pr_pb2, pr_grpc


class AdmissionError(Exception):
    """kubelet could not admit or start a container: which one, which call, and the plugin's message."""

    def __init__(self, container: str, call: str, message: str) -> None:
        super().__init__(f"{call} failed for container {container!r}: {message}")
        self.container = container
        self.call = call
        self.message = message


def _random_gpu_devices(rng: random.Random, available: list[str], size: int) -> list[str]:
    """`size` free gpu-mem devices of one GPU picked at random among those with enough free (or, for other
    resources, any `size` free devices)."""
    by_gpu: dict[str, list[str]] = {}
    for d in available:
        gpu, sep, _ = d.rpartition("-_-")
        by_gpu.setdefault(gpu if sep else "", []).append(d)
    roomy = sorted(g for g, ids in by_gpu.items() if len(ids) >= size)
    if not roomy or "" in by_gpu:
        return rng.sample(available, size)
    return rng.sample(by_gpu[rng.choice(roomy)], size)


@dataclass
class RegisteredPlugin:
    """A device plugin that registered with the stand-in."""

    resource: str
    endpoint: str
    options: Any
    channel: grpc.aio.Channel
    stub: Any
    devices: dict[str, str] = field(default_factory=dict)  # ID -> "Healthy" / "Unhealthy"
    watch_task: asyncio.Task[Any] | None = None


@dataclass
class Assignment:
    """Devices kubelet gave one container of one pod."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    resource: str
    device_ids: list[str]


class KubeletStandIn:
    """See the module docstring. `registrations` counts Register calls per resource."""

    def __init__(self, plugin_dir: Path | str, pod_resources_socket: Path | str | None = None) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.pod_resources_socket = Path(pod_resources_socket or self.plugin_dir.parent / "pod-resources.sock")
        self.plugins: dict[str, RegisteredPlugin] = {}
        self.assignments: list[Assignment] = []
        # (pod UID, container) -> the mounts Allocate asked for: (container path, host path)
        self.mounts: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self.registrations: dict[str, int] = {}
        self._server: grpc.aio.Server | None = None
        self._pr_server: grpc.aio.Server | None = None
        self._changed = asyncio.Condition()
        self.dp_pb2, self.dp_grpc, self.pr_pb2, self.pr_grpc = _protos()
        # set: ignore GetPreferredAllocation and take the devices of a GPU chosen at random (a kubelet, or a
        # topology manager, that overrides the plugin's preference), to test that nothing depends on it
        self.random_devices: random.Random | None = None

    # -- servers --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve Registration on `<plugin_dir>/kubelet.sock` and pod-resources on its socket."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        await self._start_registration()
        if self._pr_server is None:
            with contextlib.suppress(FileNotFoundError):
                self.pod_resources_socket.unlink()
            server = grpc.aio.server()
            self.pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server)
            server.add_insecure_port(f"unix://{self.pod_resources_socket}")
            await server.start()
            self._pr_server = server

    async def _start_registration(self) -> None:
        sock = self.plugin_dir / KUBELET_SOCKET
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        server = grpc.aio.server()
        self.dp_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{sock}")
        await server.start()
        self._server = server

    async def restart(self) -> None:
        """Simulate a kubelet restart: drop plugin connections, delete every socket in the directory
        (the plugins' too), and serve a new Registration server. Assignments are kept (checkpoint)."""
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        for plugin in list(self.plugins.values()):
            await self._drop(plugin)
        self.plugins.clear()
        for path in self.plugin_dir.iterdir():
            if path.is_socket() or path.name.endswith(".sock"):
                path.unlink(missing_ok=True)
        await self._start_registration()

    async def stop(self) -> None:
        """Stop everything."""
        for plugin in list(self.plugins.values()):
            await self._drop(plugin)
        self.plugins.clear()
        for server in (self._server, self._pr_server):
            if server is not None:
                await server.stop(0)
        self._server = self._pr_server = None

    async def _drop(self, plugin: RegisteredPlugin) -> None:
        if plugin.watch_task is not None:
            plugin.watch_task.cancel()
            with contextlib.suppress(BaseException):
                await plugin.watch_task
        await plugin.channel.close()

    # -- registration and ListAndWatch ----------------------------------------------------------
    async def _register(self, request: Any) -> None:
        if request.version != "v1beta1":
            raise ValueError(f"unsupported device plugin API version {request.version!r}")
        old = self.plugins.pop(request.resource_name, None)
        if old is not None:
            await self._drop(old)
        channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        plugin = RegisteredPlugin(
            resource=request.resource_name,
            endpoint=request.endpoint,
            options=request.options,
            channel=channel,
            stub=self.dp_grpc.DevicePluginStub(channel),
        )
        self.plugins[request.resource_name] = plugin
        self.registrations[request.resource_name] = self.registrations.get(request.resource_name, 0) + 1
        plugin.watch_task = asyncio.create_task(self._watch(plugin))
        async with self._changed:
            self._changed.notify_all()

    async def _watch(self, plugin: RegisteredPlugin) -> None:
        try:
            async for reply in plugin.stub.ListAndWatch(self.dp_pb2.Empty()):
                plugin.devices = {d.ID: d.health for d in reply.devices}
                async with self._changed:
                    self._changed.notify_all()
        except grpc.aio.AioRpcError as exc:
            log.info("ListAndWatch of %s ended: %s", plugin.resource, exc.code().name)
        # like kubelet: a plugin whose stream ended has no healthy devices
        plugin.devices = dict.fromkeys(plugin.devices, "Unhealthy")
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Wait until `predicate()` holds (re-checked at every registration / device update)."""
        async with asyncio.timeout(timeout_s):
            async with self._changed:
                await self._changed.wait_for(predicate)

    async def wait_registered(self, resources: Iterable[str], timeout_s: float = 10.0, *, min_count: int = 1) -> None:
        """Wait until each resource registered (at least `min_count` times in total) and listed devices."""
        wanted = list(resources)

        def ready() -> bool:
            return all(
                self.registrations.get(r, 0) >= min_count and r in self.plugins and self.plugins[r].devices
                for r in wanted
            )

        await self.wait_for(ready, timeout_s)

    def devices(self, resource: str) -> dict[str, str]:
        """Device ID -> health of a resource as last listed."""
        plugin = self.plugins.get(resource)
        return dict(plugin.devices) if plugin else {}

    # -- admission ------------------------------------------------------------------------------
    def _in_use(self, resource: str) -> set[str]:
        return {d for a in self.assignments if a.resource == resource for d in a.device_ids}

    async def admit(self, pod: dict[str, Any], *, start: bool = True) -> dict[str, dict[str, str]]:
        """Allocate every container of a pod, then (with `start`) PreStart them; {container: env}.

        Raises AdmissionError. `pod` is a Kubernetes pod as a dict (API JSON, camelCase):
        metadata.name/namespace/uid and spec.initContainers / spec.containers with resources.limits.
        With `start=False` only admission (GetPreferredAllocation + Allocate) happens; call
        `start_pod(pod)` later to run the PreStartContainer calls (interleaved admissions).
        """
        meta = pod.get("metadata", {})
        ns, name, uid = meta.get("namespace", "default"), meta["name"], meta.get("uid", "")
        spec = pod.get("spec", {})
        inits = list(spec.get("initContainers") or [])
        containers = inits + list(spec.get("containers") or [])
        envs: dict[str, dict[str, str]] = {}
        prestarts: list[tuple[str, RegisteredPlugin, list[str]]] = []
        reusable: dict[str, list[str]] = {}  # kubelet's devicesToReuse for this pod, per resource
        try:
            for i, c in enumerate(containers):
                env: dict[str, str] = {}
                limits = (c.get("resources") or {}).get("limits") or {}
                hands_on = i < len(inits) and c.get("restartPolicy") != "Always"  # a regular init container
                for resource, amount in sorted(limits.items()):
                    plugin = self.plugins.get(resource)
                    if plugin is None:
                        continue
                    reuse = reusable.get(resource, [])
                    ids = await self._pick(plugin, int(str(amount)), c["name"], reuse)
                    if hands_on:
                        reusable[resource] = [*reuse, *(d for d in ids if d not in reuse)]
                    else:
                        reusable[resource] = [d for d in reuse if d not in ids]
                    try:
                        reply = await plugin.stub.Allocate(
                            self.dp_pb2.AllocateRequest(
                                container_requests=[self.dp_pb2.ContainerAllocateRequest(devicesIDs=ids)]
                            )
                        )
                    except grpc.aio.AioRpcError as exc:
                        raise AdmissionError(c["name"], "Allocate", exc.details() or exc.code().name) from None
                    env.update(reply.container_responses[0].envs)
                    self.mounts.setdefault((uid, c["name"]), []).extend(
                        (m.container_path, m.host_path) for m in reply.container_responses[0].mounts
                    )
                    self.assignments.append(Assignment(ns, name, uid, c["name"], resource, ids))
                    if plugin.options.pre_start_required:
                        prestarts.append((c["name"], plugin, ids))
                envs[c["name"]] = env
        except AdmissionError:
            self.remove_pod(pod)  # admission failed: kubelet frees the pod's devices
            raise
        if start:
            for container, plugin, ids in prestarts:
                await self._prestart(container, plugin, ids)
        return envs

    async def start_pod(self, pod: dict[str, Any]) -> None:
        """PreStartContainer for every recorded container of an admitted pod (init containers first)."""
        spec = pod.get("spec", {})
        for c in list(spec.get("initContainers") or []) + list(spec.get("containers") or []):
            await self.restart_container(pod, c["name"])

    async def _pick(self, plugin: RegisteredPlugin, size: int, container: str, reusable: list[str]) -> list[str]:
        """kubelet's `devicesToAllocate`: reusable devices first, then GetPreferredAllocation for the rest (with
        the reused ones as must-include), then the first free healthy IDs."""
        taken = reusable[:size]
        if len(taken) == size:
            return taken
        in_use = self._in_use(plugin.resource)
        available = [d for d, h in plugin.devices.items() if h == "Healthy" and d not in in_use]
        need = size - len(taken)
        if len(available) < need:
            raise AdmissionError(
                container, "admission", f"{plugin.resource}: {need} requested, {len(available)} available"
            )
        if self.random_devices is not None and not taken:
            return _random_gpu_devices(self.random_devices, available, size)
        if plugin.options.get_preferred_allocation_available:
            reply = await plugin.stub.GetPreferredAllocation(
                self.dp_pb2.PreferredAllocationRequest(
                    container_requests=[
                        self.dp_pb2.ContainerPreferredAllocationRequest(
                            available_deviceIDs=[*available, *taken],
                            must_include_deviceIDs=taken,
                            allocation_size=size,
                        )
                    ]
                )
            )
            preferred = list(reply.container_responses[0].deviceIDs) if reply.container_responses else []
            free = set(available)
            taken += [d for d in dict.fromkeys(preferred) if d in free][:need]
        return taken + [d for d in available if d not in taken][: size - len(taken)]

    async def _prestart(self, container: str, plugin: RegisteredPlugin, ids: list[str]) -> None:
        try:
            await plugin.stub.PreStartContainer(self.dp_pb2.PreStartContainerRequest(devicesIDs=ids))
        except grpc.aio.AioRpcError as exc:
            raise AdmissionError(container, "PreStartContainer", exc.details() or exc.code().name) from None

    async def restart_container(self, pod: dict[str, Any], container: str) -> None:
        """Start a container again with its recorded devices (PreStartContainer only, like kubelet)."""
        meta = pod.get("metadata", {})
        ns, name = meta.get("namespace", "default"), meta["name"]
        for a in self.assignments:
            if (a.namespace, a.pod, a.container) == (ns, name, container):
                plugin = self.plugins.get(a.resource)
                if plugin is not None and plugin.options.pre_start_required:
                    await self._prestart(container, plugin, a.device_ids)

    def remove_pod(self, pod: dict[str, Any]) -> None:
        """Forget a pod's assignments (the pod ended)."""
        meta = pod.get("metadata", {})
        key = (meta.get("namespace", "default"), meta["name"])
        self.assignments = [a for a in self.assignments if (a.namespace, a.pod) != key]

    def assigned(self, pod: dict[str, Any], container: str, resource: str) -> list[str]:
        """Device IDs recorded for one container and resource."""
        meta = pod.get("metadata", {})
        key = (meta.get("namespace", "default"), meta["name"], container, resource)
        return [
            d for a in self.assignments if (a.namespace, a.pod, a.container, a.resource) == key for d in a.device_ids
        ]


class _Registration:
    """The Registration service (duck-typed servicer: grpc only needs the method)."""

    def __init__(self, kubelet: KubeletStandIn) -> None:
        self.kubelet = kubelet

    async def Register(self, request: Any, context: Any) -> Any:
        try:
            await self.kubelet._register(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return self.kubelet.dp_pb2.Empty()


class _PodResources:
    """The pod-resources `List` service, answered from the stand-in's records."""

    def __init__(self, kubelet: KubeletStandIn) -> None:
        self.kubelet = kubelet

    async def List(self, request: Any, context: Any) -> Any:
        pb = self.kubelet.pr_pb2
        pods: dict[tuple[str, str], dict[str, list[Any]]] = {}
        for a in self.kubelet.assignments:
            containers = pods.setdefault((a.namespace, a.pod), {})
            containers.setdefault(a.container, []).append(
                pb.ContainerDevices(resource_name=a.resource, device_ids=a.device_ids)
            )
        return pb.ListPodResourcesResponse(
            pod_resources=[
                pb.PodResources(
                    name=pod,
                    namespace=ns,
                    containers=[pb.ContainerResources(name=c, devices=devs) for c, devs in containers.items()],
                )
                for (ns, pod), containers in pods.items()
            ]
        )
