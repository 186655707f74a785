"""kubelet's DRA side for the dev stack and the tests: plugin registration, prepare, unprepare, device health.

What it mirrors, from the v1.37.2 sources in the Go module cache (k8s.io/kubernetes@v1.37.2):

* registration (pkg/kubelet/pluginmanager): the plugin watcher finds a socket in `plugins_registry`
  (`pluginwatcher.Watcher.traversePluginDir` / `handleCreateEvent`: sockets only, names starting with `.` ignored;
  a removed socket `handleDeleteEvent` deregisters), then `operationGenerator.GenerateRegisterPluginFunc`: dial the
  socket, `GetInfo`, pick the handler by `type`, an empty `endpoint` means the registration socket itself,
  validate, register, then `NotifyRegistrationStatus` (an error is notified too);
* the DRA handler (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go): `validateSupportedServices` takes the first
  of the plugin's `supported_versions` that kubelet knows (`v1.DRAPlugin`, `v1beta1.DRAPlugin`); `pickHealthService`
  the first of kubelet's health services (`v1.DRAResourceHealth`, `v1alpha1.DRAResourceHealth`) the plugin lists;
  one endpoint may not be registered twice for a driver;
* prepare (pkg/kubelet/cm/dra/manager.go `Manager.prepareResources`), before a pod's containers start: for each of
  the pod's `spec.resourceClaims`, the claim's name (`resourceclaim.Name`: `resourceClaimName`, or the pod's
  `status.resourceClaimStatuses` for a template), the claim read from the API, owned by the pod when it came from
  a template (`resourceclaim.IsForPod`), reserved for the pod (`IsReservedForPod`) and allocated
  (`newClaimInfoFromClaim`), the plugin of each driver in its results (`GetPlugin`: an error when none registered);
  a claim already prepared is not prepared again; the claims of one driver go in one `NodePrepareResources` call;
  an error of one claim, a result for a claim not asked about, or a claim left out fails the pod's preparation;
* a pod whose preparation failed (pkg/kubelet/kuberuntime/kuberuntime_manager.go `SyncPod`: the error becomes a
  `FailedPrepareDynamicResources` event and SyncPod returns without a sync error, so pkg/kubelet/pod_workers.go
  `completeWork` requeues the pod at the resync interval, `syncFrequency` 1 min jittered by up to half of it) is
  prepared again at its next update that kubelet's pod config passes on (pkg/kubelet/config/config.go
  `checkAndUpdatePod`: spec, labels, annotations or deletion changed, not status) or at that resync, whichever
  comes first; until then `prepare` raises `DraPrepareDeferred` without calling the plugin;
* a container's CDI devices (`Manager.GetResources`, claiminfo.go `cdiDevicesAsList`): the CDI IDs of the devices
  whose request the container references (all of the claim's devices for a reference without a request);
* unprepare (`Manager.unprepareResources`), after a pod's containers stopped: a claim another pod still references
  only loses this pod's reference; the others go to `NodeUnprepareResources` per driver and leave the cache;
* device health (`Manager.HandleWatchResourcesStream`): one `NodeWatchResources` stream per plugin that offered a
  health service, its devices' health kept by (driver, pool, device).

Like a container runtime, `container_env` applies the CDI devices of a container from the spec files in the CDI
directory (`containerEdits.env`, later devices overriding earlier ones). It runs no container.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from shared.kube.raw import read_json

log = logging.getLogger(__name__)

KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # dra_plugin.go servicesSupportedByKubelet, newest first
KUBELET_HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")  # healthServicesSupportedByKubelet
PLUGIN_TYPE = "DRAPlugin"


def _protos() -> dict[str, tuple[Any, Any]]:
    from shared.kubelet_api import load

    names = ("pluginregistration", "dra_v1", "dra_v1beta1", "drahealth_v1", "drahealth_v1alpha1")
    return {n: load(n) for n in names}


SYNC_FREQUENCY_S = 60.0  # KubeletConfiguration syncFrequency default (pkg/kubelet/apis/config/v1beta1/defaults.go)
RESYNC_JITTER = 0.5  # workerResyncIntervalJitterFactor (pkg/kubelet/pod_workers.go)


class DraPrepareError(Exception):
    """kubelet could not prepare a pod's claims (its containers do not start): which claim and why."""


class DraPrepareDeferred(DraPrepareError):
    """A pod whose preparation failed, asked again before kubelet would retry it (its next update or resync)."""


def pod_fingerprint(pod: dict[str, Any]) -> str:
    """What of a pod makes kubelet's pod config pass an update on to the pod worker (`podsDifferSemantically`):
    spec, labels, annotations, deletion timestamp and grace period; status changes do not."""
    meta = pod.get("metadata") or {}
    seen = {
        "spec": pod.get("spec"),
        "labels": meta.get("labels"),
        "annotations": meta.get("annotations"),
        "deletion": [meta.get("deletionTimestamp"), meta.get("deletionGracePeriodSeconds")],
    }
    return json.dumps(seen, sort_keys=True, separators=(",", ":"))


def claim_name(pod: dict[str, Any], entry: dict[str, Any]) -> tuple[str | None, bool]:
    """`resourceclaim.Name`: (the claim's name or None when none was generated, whether the pod must own it).
    Raises DraPrepareError when a template's claim is not in the pod's status yet."""
    if entry.get("resourceClaimName"):
        return str(entry["resourceClaimName"]), False
    if entry.get("resourceClaimTemplateName"):
        for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if status.get("name") == entry.get("name"):
                name = status.get("resourceClaimName")
                return (str(name) if name else None), True
        raise DraPrepareError(f"pod {pod['metadata']['name']}: claim for {entry.get('name')} not created yet")
    raise DraPrepareError(f"pod {pod['metadata']['name']}: spec.resourceClaim {entry.get('name')} has no source")


@dataclass
class RegisteredDraPlugin:
    """A DRA plugin kubelet registered (one endpoint per driver here)."""

    driver: str
    endpoint: str
    service: str
    health_service: str
    channel: grpc.aio.Channel
    health_task: asyncio.Task[Any] | None = None


def _identity(socket: Path) -> tuple[int, int] | None:
    """Which socket file is at a path (inode and change time; None once it is gone): a plugin that removed and
    created its socket again gives another one, as kubelet's watcher sees another create event."""
    try:
        st = socket.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


@dataclass
class ClaimInfo:
    """kubelet's claim info cache entry (claiminfo.go `ClaimInfo`)."""

    uid: str
    name: str
    namespace: str
    drivers: set[str]
    pods: set[str] = field(default_factory=set)
    prepared: bool = False
    devices: list[dict[str, Any]] = field(default_factory=list)  # {driver, request_names, pool, device, cdi_ids}


class DraKubeletStandIn:
    """kubelet's DRA manager and plugin watcher for one node. `start()` watches the registration directory."""

    def __init__(
        self,
        api: client.ApiClient,
        registration_dir: Path | str,
        cdi_dir: Path | str,
        *,
        services: tuple[str, ...] = KUBELET_SERVICES,
    ) -> None:
        self.api = api
        self.services = services  # the DRAPlugin versions this kubelet knows (an older kubelet: v1beta1 only)
        self.registration_dir = Path(registration_dir)
        self.cdi_dir = Path(cdi_dir)
        self.plugins: dict[str, RegisteredDraPlugin] = {}
        self.sockets: dict[Path, tuple[str, tuple[int, int]]] = {}  # registration socket -> driver, its identity
        self.cache: dict[tuple[str, str], ClaimInfo] = {}  # (namespace, claim name) -> info
        self.health: dict[tuple[str, str, str], int] = {}  # (driver, pool, device) -> health status enum value
        self.registration_errors: list[str] = []
        self.calls: list[tuple[str, list[str]]] = []  # (rpc, claim UIDs): what kubelet asked, in order
        self.sync_frequency_s = SYNC_FREQUENCY_S
        self.refused: dict[str, tuple[str, float]] = {}  # pod UID -> (fingerprint, monotonic time of the resync)
        self.clock = time.monotonic
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.pb = _protos()

    # -- the plugin watcher -------------------------------------------------------------------------------------
    async def start(self, interval_s: float = 0.2) -> DraKubeletStandIn:
        """Create the registration directory (`Watcher.init`) and watch it."""
        self.registration_dir.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._watch(interval_s))
        return self

    async def stop(self) -> None:
        """Stop watching; drop every plugin connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for plugin in list(self.plugins.values()):
            await self._drop(plugin)
        self.plugins.clear()
        self.sockets.clear()

    async def _watch(self, interval_s: float) -> None:
        """The watcher and the reconciler (pkg/kubelet/pluginmanager/reconciler/reconciler.go `reconcile`): a socket
        gone is unregistered; a socket created again at the same path (a restarted plugin: a new create event, a new
        UUID in the desired state) is unregistered first and then registered anew; a new socket is registered."""
        while True:
            found = [p for p in self.registration_dir.iterdir() if not p.name.startswith(".") and p.is_socket()]
            present = {p: identity for p in found if (identity := _identity(p)) is not None}
            for socket in set(self.sockets) - set(present):
                await self._unregister(socket)
            for socket, identity in sorted(present.items()):
                known = self.sockets.get(socket)
                if known is not None and known[1] == identity:
                    continue
                if known is not None:
                    await self._unregister(socket)
                try:
                    await self._register(socket, identity)
                except Exception as exc:  # the watcher logs and goes on (it retries on the next create event)
                    self.registration_errors.append(str(exc))
                    log.warning("DRA plugin registration at %s failed: %s", socket, exc)
            await asyncio.sleep(interval_s)

    async def _unregister(self, socket: Path) -> None:
        driver, _ = self.sockets.pop(socket)
        plugin = self.plugins.pop(driver, None)
        if plugin is not None:
            await self._drop(plugin)
        async with self._changed:
            self._changed.notify_all()

    async def _register(self, socket: Path, identity: tuple[int, int]) -> None:
        """`GenerateRegisterPluginFunc` with the DRA handler (`ValidatePlugin`, `RegisterPlugin`)."""
        reg_pb2, reg_grpc = self.pb["pluginregistration"]
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(reg_pb2.InfoRequest(), timeout=1.0)

            async def notify(ok: bool, error: str = "") -> None:
                await stub.NotifyRegistrationStatus(
                    reg_pb2.RegistrationStatus(plugin_registered=ok, error=error), timeout=5.0
                )

            if info.type != PLUGIN_TYPE:
                await notify(False, f"RegisterPlugin error -- no handler registered for plugin type: {info.type}")
                raise ValueError(f"no handler for plugin type {info.type!r}")
            endpoint = info.endpoint or str(socket)
            versions = list(info.supported_versions)
            chosen = next((v for v in versions if v in self.services), "")
            if not chosen:
                error = (
                    f"none of services supported by the plugin ({versions}) are supported by the kubelet "
                    f"({list(self.services)})"
                )
                await notify(False, f"RegisterPlugin error -- plugin validation failed with err: {error}")
                raise ValueError(error)
            old = self.plugins.get(info.name)
            if old is not None and old.endpoint == endpoint:
                error = f"endpoint {endpoint} already registered for DRA driver plugin {info.name}"
                await notify(False, f"RegisterPlugin error -- plugin registration failed with err: {error}")
                raise ValueError(error)
            if old is not None:
                await self._drop(old)
            health = next((h for h in KUBELET_HEALTH_SERVICES if h in versions), "")
            plugin = RegisteredDraPlugin(
                info.name, endpoint, chosen, health, grpc.aio.insecure_channel(f"unix://{endpoint}")
            )
            self.plugins[info.name] = plugin
            self.sockets[socket] = (info.name, identity)
            await notify(True)
        if health:
            plugin.health_task = asyncio.create_task(self._watch_health(plugin))
        log.info("registered DRA plugin %s (%s) at %s", info.name, chosen, endpoint)
        async with self._changed:
            self._changed.notify_all()

    async def _drop(self, plugin: RegisteredDraPlugin) -> None:
        if plugin.health_task is not None:
            plugin.health_task.cancel()
            with contextlib.suppress(BaseException):
                await plugin.health_task
        await plugin.channel.close()

    async def wait_registered(self, driver: str, timeout_s: float = 30.0) -> RegisteredDraPlugin:
        """Until `driver` registered."""
        await self.wait_for(lambda: driver in self.plugins, timeout_s)
        return self.plugins[driver]

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Until `predicate()` holds (checked at each registration and health update)."""
        async with asyncio.timeout(timeout_s):
            async with self._changed:
                await self._changed.wait_for(predicate)

    # -- device health --------------------------------------------------------------------------------------------
    async def _watch_health(self, plugin: RegisteredDraPlugin) -> None:
        """`HandleWatchResourcesStream`: every update replaces the health of the devices it names."""
        name = "drahealth_v1" if plugin.health_service.startswith("v1.") else "drahealth_v1alpha1"
        pb, grpc_mod = self.pb[name]
        stub = grpc_mod.DRAResourceHealthStub(plugin.channel)
        try:
            async for reply in stub.NodeWatchResources(pb.NodeWatchResourcesRequest()):
                for d in reply.devices:
                    self.health[(plugin.driver, d.device.pool_name, d.device.device_name)] = int(d.health)
                async with self._changed:
                    self._changed.notify_all()
        except grpc.aio.AioRpcError as exc:
            log.info("health stream of %s ended: %s", plugin.driver, exc.code().name)

    def device_health(self, driver: str, pool: str, device: str) -> str:
        """HEALTHY / UNHEALTHY / UNKNOWN as the plugin last reported it."""
        pb, _ = self.pb["drahealth_v1"]
        return pb.HealthStatus.Name(self.health.get((driver, pool, device), 0))

    # -- prepare ------------------------------------------------------------------------------------------------
    async def _read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        resource = client.ResourceV1Api(self.api)
        try:
            return await read_json(
                await resource.read_namespaced_resource_claim(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            raise DraPrepareError(f"fetch ResourceClaim {name}: {exc.status} {exc.reason}") from None

    async def prepare(self, pod: dict[str, Any]) -> None:
        """`Manager.prepareResources` for one pod (raises DraPrepareError; the pod's containers must not start), as
        the pod worker runs it: a pod that failed is tried again only once it changed or its resync is due."""
        uid, fingerprint = pod["metadata"]["uid"], pod_fingerprint(pod)
        refused = self.refused.get(uid)
        if refused is not None and refused[0] == fingerprint and self.clock() < refused[1]:
            raise DraPrepareDeferred(
                f"pod {pod['metadata'].get('name')}: preparation failed before; kubelet tries again at the pod's next "
                "update or resync"
            )
        try:
            await self._prepare(pod)
        except DraPrepareError:
            resync = self.sync_frequency_s * (1 + random.random() * RESYNC_JITTER)  # wait.Jitter
            self.refused[uid] = (fingerprint, self.clock() + resync)
            raise
        self.refused.pop(uid, None)

    async def _prepare(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        ns, pod_uid = meta.get("namespace", "default"), meta["uid"]
        infos: list[ClaimInfo] = []
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:  # the validation pass
            name, must_own = claim_name(pod, entry)
            if name is None:
                continue
            claim = await self._read_claim(ns, name)
            cmeta = claim.get("metadata") or {}
            if must_own and not any(
                r.get("uid") == pod_uid and r.get("controller") for r in cmeta.get("ownerReferences") or []
            ):
                raise DraPrepareError(
                    f"ResourceClaim {ns}/{name} was not created for Pod {ns}/{meta['name']} (Pod is not owner)"
                )
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            if not any(r.get("uid") == pod_uid for r in reserved):
                raise DraPrepareError(
                    f"pod {meta['name']} ({pod_uid}) is not allowed to use ResourceClaim {name} ({cmeta.get('uid')})"
                )
            allocation = (claim.get("status") or {}).get("allocation")
            if not allocation:
                raise DraPrepareError(f"ResourceClaim {name}: not allocated")
            drivers = {r["driver"] for r in (allocation.get("devices") or {}).get("results") or []}
            for driver in drivers:
                if driver not in self.plugins:
                    raise DraPrepareError(f"DRA driver {driver} is not registered")
            infos.append(ClaimInfo(str(cmeta["uid"]), name, ns, drivers))
        batches: dict[str, list[ClaimInfo]] = {}
        for fresh in infos:  # the cache update
            key = (fresh.namespace, fresh.name)
            info = self.cache.get(key)
            if info is None:
                info = self.cache[key] = fresh
            elif info.uid != fresh.uid:
                raise DraPrepareError(
                    f"old ResourceClaim with same name {fresh.name} and different UID {info.uid} still exists"
                )
            info.pods.add(pod_uid)
            if info.prepared:
                continue
            for driver in info.drivers:
                batches.setdefault(driver, []).append(info)
        for driver, claims in batches.items():
            reply = await self._call(driver, "NodePrepareResources", claims)
            for uid, result in reply.claims.items():
                info = next((c for c in claims if c.uid == uid), None)
                if info is None:
                    raise DraPrepareError(f"NodePrepareResources returned result for unknown claim UID {uid}")
                if result.error:
                    raise DraPrepareError(f"NodePrepareResources failed for ResourceClaim {info.name}: {result.error}")
                info.devices = [d for d in info.devices if d["driver"] != driver] + [
                    {
                        "driver": driver,
                        "request_names": list(d.request_names),
                        "pool": d.pool_name,
                        "device": d.device_name,
                        "cdi_ids": list(d.cdi_device_ids),
                        "share_id": _share_id(d),
                    }
                    for d in result.devices
                ]
            unfinished = len(claims) - len(reply.claims)
            if unfinished:
                raise DraPrepareError(f"NodePrepareResources skipped {unfinished} ResourceClaims")
        for fresh in infos:
            self.cache[(fresh.namespace, fresh.name)].prepared = True

    async def _call(self, driver: str, rpc: str, claims: list[ClaimInfo]) -> Any:
        plugin = self.plugins.get(driver)
        if plugin is None:
            raise DraPrepareError(f"DRA driver {driver} is not registered")
        pb, grpc_mod = self.pb["dra_v1" if plugin.service == "v1.DRAPlugin" else "dra_v1beta1"]
        stub = grpc_mod.DRAPluginStub(plugin.channel)
        wire = [pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        request = getattr(pb, f"{rpc}Request")(claims=wire)
        self.calls.append((rpc, [c.uid for c in claims]))
        try:
            return await getattr(stub, rpc)(request, timeout=45.0)  # defaultClientCallTimeout
        except grpc.aio.AioRpcError as exc:
            raise DraPrepareError(f"{rpc}: {exc.code().name}: {exc.details()}") from None

    def cdi_devices(self, pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
        """`Manager.GetResources`: the CDI device IDs a container of a prepared pod gets."""
        uses: dict[str, list[str]] = {}
        for use in (container.get("resources") or {}).get("claims") or []:
            uses.setdefault(use["name"], []).append(use.get("request") or "")
        out: list[str] = []
        ns = pod["metadata"].get("namespace", "default")
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            requests = uses.get(entry["name"])
            if requests is None:
                continue
            name, _ = claim_name(pod, entry)
            if name is None:
                continue
            info = self.cache.get((ns, name))
            if info is None:
                raise DraPrepareError(f"internal error: unable to get claim info for ResourceClaim {name}")
            for request in requests:  # cdiDevicesAsList
                for d in info.devices:
                    if not request or not d["request_names"] or request in d["request_names"]:
                        out.extend(d["cdi_ids"])
        return out

    def container_env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        """What the container runtime sets from the container's CDI devices (their specs in the CDI directory)."""
        specs = []
        if self.cdi_dir.exists():
            for path in sorted(self.cdi_dir.glob("*.json")):
                with contextlib.suppress(ValueError, OSError):
                    specs.append(json.loads(path.read_text()))
        env: dict[str, str] = {}
        for cdi_id in self.cdi_devices(pod, container):
            kind, _, name = cdi_id.partition("=")
            device = next(
                (d for s in specs if s.get("kind") == kind for d in s.get("devices") or [] if d.get("name") == name),
                None,
            )
            if device is None:
                raise DraPrepareError(f"CDI device {cdi_id} is in no spec of {self.cdi_dir}")
            env.update(item.split("=", 1) for item in (device.get("containerEdits") or {}).get("env") or [])
        return env

    # -- unprepare ----------------------------------------------------------------------------------------------
    async def unprepare(self, pod: dict[str, Any]) -> None:
        """`Manager.unprepareResources` once a pod's containers stopped (idempotent)."""
        pod_uid = pod["metadata"]["uid"]
        self.refused.pop(pod_uid, None)
        batches: dict[str, list[ClaimInfo]] = {}
        done: list[tuple[str, str]] = []
        for key, info in list(self.cache.items()):
            if pod_uid not in info.pods:
                continue
            if len(info.pods) > 1:
                info.pods.discard(pod_uid)
                continue
            done.append(key)
            for driver in info.drivers:
                batches.setdefault(driver, []).append(info)
        for driver, claims in batches.items():
            reply = await self._call(driver, "NodeUnprepareResources", claims)
            for uid, result in reply.claims.items():
                if result.error:
                    name = next((c.name for c in claims if c.uid == uid), uid)
                    raise DraPrepareError(f"NodeUnprepareResources failed for ResourceClaim {name}: {result.error}")
            unfinished = len(claims) - len(reply.claims)
            if unfinished:
                raise DraPrepareError(f"NodeUnprepareResources skipped {unfinished} ResourceClaims")
        for key in done:
            self.cache.pop(key, None)


def _share_id(device: Any) -> str | None:
    """A prepared device's share ID (v1 only; None when the plugin set none)."""
    if "share_id" not in device.DESCRIPTOR.fields_by_name or not device.HasField("share_id"):
        return None
    return str(device.share_id)
