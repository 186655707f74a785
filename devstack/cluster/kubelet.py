"""A kubelet stand-in for tests and `gpushare up`: the device-plugin side of kubelet over real gRPC.

    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket, release=CURRENT)
    await kubelet.start()                                  # serves Registration on <plugin_dir>/kubelet.sock
    await kubelet.wait_registered(["aliyun.com/gpu-mem"])  # plugins dial in
    envs = await kubelet.admit(pod)                        # {container name: env}, like kubelet's admission
    await kubelet.restart_container(pod, "main")           # PreStartContainer again, same devices
    await kubelet.restart()                                # kubelet restart: sockets deleted, new server
    await kubelet.stop()

It behaves as kubelet of `release` (the current one, or 1.20) does where it matters to a device plugin, as read in
k8s.io/kubernetes (v1.37.2 and v1.20.2):

* Registration and ListAndWatch per registered resource, tracking each device's health and NUMA topology.
* Admission (`admit`) allocates every container of the pod, init containers first in spec order, then app
  containers (the topology manager's `scope.admitPolicyNone` / `allocateAlignedResources` loop over
  `append(pod.Spec.InitContainers, pod.Spec.Containers...)`), each through the device manager's `Allocate`
  (`pkg/kubelet/cm/devicemanager/manager.go`): `devicesToAllocate` takes the pod's reusable devices first
  (`devicesToReuse`), in Go's set order (arbitrary: the stand-in shuffles them), and asks GetPreferredAllocation
  (when offered) for the rest with the reused ones as must-include, else takes free healthy IDs; then the
  `Allocate` RPC. After a regular init container, `podDevices.addContainerAllocatedResources` adds its devices to
  the reusable set; after an app container (and, from 1.29, a sidecar: an init container with `restartPolicy:
  Always`), `removeContainerAllocatedResources` takes its devices out. 1.20 knows no sidecars: every init
  container is a regular one there.
* Start (`start_pod`, after admission) calls PreStartContainer per container in the order kubelet starts them
  (init containers one after the other, then app containers), with the container's own devices
  (`GetDeviceRunContainerOptions` -> `callPreStartContainerIfNeeded`).
* The pod-resources `List` (`pkg/kubelet/apis/podresources/server_v1.go`, `v1PodResourcesServer.List`) lists every
  pod it admitted (`Get`, `v1PodResourcesServer.Get`, one of them, from 1.34), and in each only the containers
  kubelet lists: app containers and, from 1.29, sidecars; never a regular init container (1.20: app containers
  only). Their devices come from its allocation records (the
  device manager's `podDevices`), one `ContainerDevices` per device (per NUMA node) as 1.37's
  `containerDevicesFromResourceDeviceInstances` writes them, or one per resource and NUMA node (-1 without
  topology) as 1.20's `podDevices.getContainerDevices` does.

Pods are admitted in the order the caller chooses, so tests can reproduce admission races. It does not run
containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from devstack.cluster.releases import CURRENT, Release
from shared.kubelet_api import KUBELET_SOCKET

log = logging.getLogger(__name__)


def _protos() -> tuple[Any, Any, Any, Any]:
    # the node agent owns the compiled kubelet protos; they are generated on first import
    from shared.kubelet_api import load

    dp_pb2, dp_grpc = load("deviceplugin")
    pr_pb2, pr_grpc = load("podresources")
    return dp_pb2, dp_grpc, pr_pb2, pr_grpc


class RegistrationRefused(Exception):
    """kubelet refuses a device plugin's registration (its message is kubelet's)."""


_QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def is_extended_resource_name(name: str) -> bool:
    """`v1helper.IsExtendedResourceName`: a domain-prefixed name outside kubernetes.io whose quota name
    (`requests.<name>`) is a qualified name (pure)."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, short = f"requests.{name}".partition("/")
    return len(short) <= 63 and len(prefix) <= 253 and bool(_QUALIFIED_NAME.match(f"requests.{name}"))


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
    numa: dict[str, list[int]] = field(default_factory=dict)  # ID -> the NUMA nodes its topology names
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


SIDECARS_SINCE = 29  # kubelet 1.29 lists sidecars in pod-resources and keeps their devices from later containers
GET_SINCE = 34  # pod-resources `Get` on by default (its feature gate beta, default true, from 1.34; GA in 1.36)


def is_sidecar(container: dict[str, Any], release: Release) -> bool:
    """An init container kubelet of `release` treats as restartable (`podutil.IsRestartableInitContainer`)."""
    return release.minor >= SIDECARS_SINCE and container.get("restartPolicy") == "Always"


def listed_containers(pod: dict[str, Any], release: Release) -> list[str]:
    """The containers of a pod that kubelet's pod-resources `List` names, in its order: sidecars (from 1.29) and
    app containers; never a regular init container (`v1PodResourcesServer.List`)."""
    spec = pod.get("spec") or {}
    sidecars = [c["name"] for c in spec.get("initContainers") or [] if is_sidecar(c, release)]
    return sidecars + [c["name"] for c in spec.get("containers") or []]


class KubeletStandIn:
    """See the module docstring. `registrations` counts Register calls per resource."""

    def __init__(
        self,
        plugin_dir: Path | str,
        pod_resources_socket: Path | str | None = None,
        *,
        release: Release = CURRENT,
        seed: int | None = 0,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.pod_resources_socket = Path(pod_resources_socket or self.plugin_dir.parent / "pod-resources.sock")
        self.release = release
        self.plugins: dict[str, RegisteredPlugin] = {}
        self.assignments: list[Assignment] = []
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}  # the pods kubelet admitted: (namespace, name) -> pod
        self.reuse_order = random.Random(seed)  # Go's set iteration order, which devicesToAllocate reuses in
        # (pod UID, container) -> the mounts Allocate asked for: (container path, host path)
        self.mounts: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self.registrations: dict[str, int] = {}
        self.refusals: list[str] = []  # `resource: kubelet's reason` of each refused registration
        self.dial_timeout_s = 10.0  # kubelet's dial of a registering plugin's endpoint (client.go `dial`)
        self.pod_resources_calls: dict[str, int] = {}  # pod-resources calls answered, by method (List, Get)
        self._server: grpc.aio.Server | None = None
        self._pr_server: grpc.aio.Server | None = None
        self._changed = asyncio.Condition()
        self.dp_pb2, self.dp_grpc, self.pr_pb2, self.pr_grpc = _protos()
        # set: ignore GetPreferredAllocation and take the devices of a GPU chosen at random (a kubelet, or a
        # topology manager, that overrides the plugin's preference), to test that nothing depends on it
        self.random_devices: random.Random | None = None
        # called with the pod once its last container's PreStartContainer was answered (a benchmark's clock)
        self.on_started: Callable[[dict[str, Any]], None] | None = None

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
        """kubelet's `server.Register` (pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go): refuse an unsupported
        version or a resource name that is no extended resource, then dial the plugin's endpoint in the plugin
        folder for up to `dial_timeout_s` (`dial` in client.go: 10 s) and refuse when it cannot be reached; the
        answer comes only then. A refusal is a Go error, which reaches the plugin as gRPC UNKNOWN
        (`RegistrationRefused`)."""
        if request.version != "v1beta1":
            raise RegistrationRefused(
                f'requested API version "{request.version}" is not supported by kubelet. Supported version is '
                '["v1beta1"]'
            )
        if not is_extended_resource_name(request.resource_name):
            raise RegistrationRefused(f'the ResourceName "{request.resource_name}" is invalid')
        old = self.plugins.pop(request.resource_name, None)
        if old is not None:
            await self._drop(old)
        channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        try:
            await asyncio.wait_for(channel.channel_ready(), self.dial_timeout_s)
        except TimeoutError:
            await channel.close()
            raise RegistrationRefused("failed to dial device plugin: context deadline exceeded") from None
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
                plugin.numa = {d.ID: [n.ID for n in d.topology.nodes] for d in reply.devices if d.HasField("topology")}
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
        self.pods[(ns, name)] = pod
        envs: dict[str, dict[str, str]] = {}
        prestarts: list[tuple[str, RegisteredPlugin, list[str]]] = []
        reusable: dict[str, list[str]] = {}  # the device manager's devicesToReuse for this pod, per resource
        try:
            for i, c in enumerate(containers):
                env: dict[str, str] = {}
                limits = (c.get("resources") or {}).get("limits") or {}
                # ManagerImpl.Allocate: a regular init container's devices become reusable, a sidecar's or an
                # app container's are taken out of the reusable set
                hands_on = i < len(inits) and not is_sidecar(c, self.release)
                for resource, amount in sorted(limits.items()):
                    plugin = self.plugins.get(resource)
                    if plugin is None or int(str(amount)) == 0:
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
            self._started(pod)
        return envs

    def _started(self, pod: dict[str, Any]) -> None:
        if self.on_started is not None:
            self.on_started(pod)

    async def start_pod(self, pod: dict[str, Any]) -> None:
        """PreStartContainer for every recorded container of an admitted pod (init containers first)."""
        spec = pod.get("spec", {})
        for c in list(spec.get("initContainers") or []) + list(spec.get("containers") or []):
            await self.restart_container(pod, c["name"])
        self._started(pod)

    async def _pick(self, plugin: RegisteredPlugin, size: int, container: str, reusable: list[str]) -> list[str]:
        """kubelet's `devicesToAllocate`: reusable devices first (in Go's set order, arbitrary), then
        GetPreferredAllocation for the rest (with the reused ones as must-include), then the first free healthy
        IDs."""
        taken = self.reuse_order.sample(reusable, len(reusable))[:size]
        if len(taken) == size:
            return taken
        in_use = self._in_use(plugin.resource)
        healthy = [d for d, h in plugin.devices.items() if h == "Healthy"]
        if not healthy:  # the plugin is away (its stream ended): kubelet marked every device unhealthy
            raise AdmissionError(
                container,
                "admission",
                f"no healthy devices present; cannot allocate unhealthy devices {plugin.resource}",
            )
        available = [d for d in healthy if d not in in_use]
        need = size - len(taken)
        if len(available) < need:
            raise AdmissionError(
                container,
                "admission",
                f"requested number of devices unavailable for {plugin.resource}. Requested: {need}, "
                f"Available: {len(available)}",
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
        """Forget a pod and its assignments (the pod ended, or its admission failed)."""
        meta = pod.get("metadata", {})
        key = (meta.get("namespace", "default"), meta["name"])
        self.pods.pop(key, None)
        self.assignments = [a for a in self.assignments if (a.namespace, a.pod) != key]

    def pod_resources(self) -> list[tuple[str, str, list[tuple[str, list[tuple[str, list[str], list[int]]]]]]]:
        """What `List` answers, as (namespace, pod, [(container, [(resource, device IDs, NUMA nodes)])]): every
        admitted pod, in each the containers kubelet lists (`listed_containers`) with their devices grouped as
        kubelet of this release groups them (see the module docstring)."""
        out = []
        for (ns, name), pod in self.pods.items():
            containers = []
            for container in listed_containers(pod, self.release):
                devices: list[tuple[str, list[str], list[int]]] = []
                for a in self.assignments:
                    if (a.namespace, a.pod, a.container) != (ns, name, container):
                        continue
                    numa = self.plugins[a.resource].numa if a.resource in self.plugins else {}
                    if self.release.minor >= SIDECARS_SINCE:  # one entry per device and NUMA node
                        for d in a.device_ids:
                            nodes = numa.get(d) or []
                            devices += [(a.resource, [d], [n]) for n in nodes] or [(a.resource, [d], [])]
                    else:  # one entry per NUMA node (-1: none), listing its devices
                        by_node: dict[int, list[str]] = {}
                        for d in a.device_ids:
                            for n in numa.get(d) or [-1]:
                                by_node.setdefault(n, []).append(d)
                        devices += [(a.resource, ids, [n]) for n, ids in by_node.items()]
                containers.append((container, devices))
            out.append((ns, name, containers))
        return out

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
        except RegistrationRefused as exc:
            self.kubelet.refusals.append(f"{request.resource_name}: {exc}")
            await context.abort(grpc.StatusCode.UNKNOWN, str(exc))
        return self.kubelet.dp_pb2.Empty()


class _PodResources:
    """The pod-resources `List` service, answered as kubelet of the stand-in's release does (`pod_resources`)."""

    def __init__(self, kubelet: KubeletStandIn) -> None:
        self.kubelet = kubelet

    async def List(self, request: Any, context: Any) -> Any:
        pb = self.kubelet.pr_pb2
        self._count("List")
        return pb.ListPodResourcesResponse(pod_resources=[self._pod(*p) for p in self.kubelet.pod_resources()])

    async def Get(self, request: Any, context: Any) -> Any:
        """One pod's resources (`v1PodResourcesServer.Get`): its sidecars and app containers as `List` shows them;
        an unknown pod is an error naming it (a Go error: gRPC code Unknown). Before 1.34 the method is off by
        default (the `KubeletPodResourcesGet` gate, alpha from 1.27, `pkg/features/kube_features.go`), and 1.20 has
        none: the stand-in answers as an unknown method there."""
        self._count("Get")
        if self.kubelet.release.minor < GET_SINCE:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method Get for service v1.PodResourcesLister")
        for ns, pod, containers in self.kubelet.pod_resources():
            if (ns, pod) == (request.pod_namespace, request.pod_name):
                return self.kubelet.pr_pb2.GetPodResourcesResponse(pod_resources=self._pod(ns, pod, containers))
        await context.abort(
            grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
        )

    def _count(self, method: str) -> None:
        self.kubelet.pod_resources_calls[method] = self.kubelet.pod_resources_calls.get(method, 0) + 1

    def _pod(self, ns: str, pod: str, containers: list[tuple[str, list[tuple[str, list[str], list[int]]]]]) -> Any:
        pb = self.kubelet.pr_pb2

        def devices(resource: str, ids: list[str], numa: list[int]) -> Any:
            topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=n) for n in numa]) if numa else None
            return pb.ContainerDevices(resource_name=resource, device_ids=ids, topology=topology)

        return pb.PodResources(
            name=pod,
            namespace=ns,
            containers=[pb.ContainerResources(name=c, devices=[devices(*d) for d in devs]) for c, devs in containers],
        )
