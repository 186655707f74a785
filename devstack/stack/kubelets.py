"""The kubelet side of one simulated node: `devstack.cluster.kubelet.KubeletStandIn` plus a pod watch.

`KubeletStandIn` plays kubelet's device-plugin side (Registration on `kubelet.sock`, ListAndWatch, Allocate,
PreStartContainer, the pod-resources API) but admits only the pods it is handed. It plays the release of the control
plane it joins (asked from the API server's `/version` at start): 1.20's pod-resources lists app containers only,
the current release's sidecars too, and neither lists a regular init container. `NodeKubelet` hands it the
pods the scheduler bound to its node in kubelet's admission order (creation time, which the API keeps to the
second; pods created in the same second in the order they reached this node) and forgets deleted pods, so
the whole path API -> kube-scheduler -> extender -> ledger -> binder -> Binding -> node agent -> container
environment runs. Each container's environment is kept for `container_env`. Like kubelet, it then reports the
pod Running and Ready (nothing runs, but controllers that count running pods, such as the HPA controller and a
Deployment's available replicas, see what they would see on a real node). And like kubelet it reports the node's
device-plugin resources in the node's status, at most every 10 s (`nodeStatusUpdateFrequency`'s default): capacity
every device a plugin listed, allocatable the healthy ones, so a GPU turned unhealthy or a node agent away (its
devices unhealthy until it registers again) is counted by kube-scheduler as on a real node
(`ManagerImpl.GetCapacity` and `markResourceUnhealthy` in pkg/kubelet/cm/devicemanager/manager.go, k8s.io/kubernetes
v1.37.2; the 5-minute grace after which kubelet drops a stopped plugin's resource is not played).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster.releases import Release
from devstack.cluster.waits import cancelled
from shared.annotations import RESOURCES
from shared.kube.pods import list_pods

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 20
UNEXPECTED_ADMISSION = "UnexpectedAdmissionError"  # the reason of a pod kubelet refused at admission
NODE_STATUS_UPDATE_S = 10.0  # kubelet's nodeStatusUpdateFrequency default (pkg/kubelet/apis/config/v1beta1)


def device_capacity(devices: dict[str, dict[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
    """(capacity, allocatable) of the registered device-plugin resources as kubelet's device manager counts them
    (`GetCapacity`): every listed device, and the healthy ones (pure)."""
    capacity = {resource: str(len(ids)) for resource, ids in devices.items()}
    allocatable = {resource: str(sum(1 for h in ids.values() if h == "Healthy")) for resource, ids in devices.items()}
    return capacity, allocatable


def running_status(pod: dict[str, Any], now: datetime) -> dict[str, Any]:
    """The status kubelet reports once a pod's containers started: Running, Ready, each container running (pure)."""
    spec = pod.get("spec") or {}
    at = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = [
        {"type": kind, "status": "True", "lastTransitionTime": at}
        for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
    ]
    containers = [
        {
            "name": c["name"],
            "image": c.get("image") or "unknown",
            "imageID": "",
            "ready": True,
            "started": True,
            "restartCount": 0,
            "state": {"running": {"startedAt": at}},
        }
        for c in spec.get("containers") or []
    ]
    return {"status": {"phase": "Running", "startTime": at, "conditions": conditions, "containerStatuses": containers}}


def gpu_resources_of(pod: dict[str, Any]) -> set[str]:
    """The gpushare resources a pod's containers limit."""
    spec = pod.get("spec") or {}
    out: set[str] = set()
    for c in list(spec.get("initContainers") or []) + list(spec.get("containers") or []):
        limits = (c.get("resources") or {}).get("limits") or {}
        out |= {r for r in limits if r in RESOURCES}
    return out


class NodeKubelet:
    """Admits the pods bound to `node` through a `KubeletStandIn`; `envs` holds each container's env."""

    def __init__(
        self,
        api: ApiClient,
        node: str,
        device_plugin_dir: Path,
        pod_resources_socket: Path,
        *,
        interval: float = 0.5,
        release: Release | None = None,
        dra: Any = None,
    ) -> None:
        from devstack.cluster.kubelet import KubeletStandIn

        self.api = api
        self.node = node
        self.interval = interval
        self.release = release  # None: the API server's, asked at start
        self.standin = KubeletStandIn(device_plugin_dir, pod_resources_socket)
        self.dra = dra  # a DraKubeletStandIn on DRA nodes: claims prepared before, unprepared after (kubelet_dra.py)
        self.envs: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
        self.errors: dict[tuple[str, str], str] = {}
        self._attempts: dict[str, int] = {}
        self._arrival: dict[str, int] = {}  # the order pods were first seen on this node
        self._admitted: dict[str, dict[str, Any]] = {}
        self._not_started: dict[str, tuple[dict[str, Any], dict[str, dict[str, str]]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._reported: tuple[dict[str, str], dict[str, str]] | None = None  # last device status sent
        self._report_due = 0.0  # monotonic time of the next node status update
        # set: each admitted pod is started (PreStartContainer) and reported Running in a task of its own, while the
        # next pods are admitted, as kubelet's per-pod workers and status manager do (a benchmark's latencies);
        # unset: one pod after the other, which tests that order admissions rely on
        self.concurrent_start = False
        self._starting: dict[str, asyncio.Task[None]] = {}
        # as kubelet: a pod refused at admission (Allocate, or too few healthy devices) fails for good; unset, it is
        # retried (up to MAX_ATTEMPTS), which no kubelet does (docs/reliability.md, "Stand-ins and real kubelets")
        self.admission_failures_final = True

    async def start(self, *, poll: bool = True) -> NodeKubelet:
        """Serve the kubelet sockets and begin admitting pods (`poll`: list this node's pods itself; without
        it, someone hands it the node's pods through `sync`)."""
        self.standin.release = self.release or await api_release(self.api)
        await self.standin.start()
        if self.dra is not None:
            await self.dra.start()
        if poll:
            self._task = asyncio.create_task(self._loop())
        return self

    async def pause(self) -> None:
        """Stop admitting pods (the sockets stay up, so device plugins stay registered)."""
        task, self._task = self._task, None
        await cancelled(task)
        for uid in list(self._starting):
            await cancelled(self._starting.pop(uid, None))

    async def stop(self) -> None:
        """Stop watching and stop the stand-in's servers."""
        await self.pause()
        await self.standin.stop()
        if self.dra is not None:
            await self.dra.stop()

    def container_env(self, namespace: str, pod: str, container: str) -> dict[str, str] | None:
        """The env the node agent returned for a container (None until admitted)."""
        return (self.envs.get((namespace, pod)) or {}).get(container)

    async def _loop(self) -> None:
        while True:
            try:
                # raw JSON: building kubernetes_asyncio's model objects for every pod on every poll cost more
                # CPU than the rest of the stand-in
                pods, _ = await list_pods(self.api, field_selector=f"spec.nodeName={self.node}")
                await self.sync(pods)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the apiserver may be restarting; try again
                log.warning("kubelet stand-in sync failed: %s", exc, extra={"node": self.node})
            await asyncio.sleep(self.interval)

    async def report_devices(self, *, now: float | None = None) -> bool:
        """Update the node's device-plugin capacity and allocatable when they changed, at most every
        `NODE_STATUS_UPDATE_S` (kubelet's node status loop); True when the status was written."""
        now = time.monotonic() if now is None else now
        if now < self._report_due:
            return False
        self._report_due = now + NODE_STATUS_UPDATE_S
        devices = {r: self.standin.devices(r) for r in self.standin.plugins if r in RESOURCES}
        if not devices:
            return False  # nothing registered yet: the node keeps what it was created with
        status = device_capacity(devices)
        if status == self._reported:
            return False
        capacity, allocatable = status
        try:
            await client.CoreV1Api(self.api).patch_node_status(
                self.node, {"status": {"capacity": capacity, "allocatable": allocatable}}
            )
        except ApiException as exc:
            log.warning("kubelet stand-in could not update the node status: %s", exc.reason, extra={"node": self.node})
            return False
        self._reported = status
        return True

    async def sync(self, pods: list[dict[str, Any]]) -> None:
        """Admit new pods of this node (in kubelet's order) and forget the ones that are gone; report the node's
        devices (`report_devices`)."""
        await self.report_devices()
        live = {p["metadata"]["uid"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}
        for uid in [u for u in self._not_started if u not in live]:
            gone = self._not_started.pop(uid)[0]
            self.standin.remove_pod(gone)
            await self._unprepare(gone)
        for uid in [u for u in self._admitted if u not in live]:
            pod = self._admitted.pop(uid)
            self.standin.remove_pod(pod)
            await self._unprepare(pod)
            self.envs.pop((pod["metadata"]["namespace"], pod["metadata"]["name"]), None)
            log.info("pod ended", extra={"node": self.node, "pod": pod["metadata"]["name"]})
        # pods that reach the node in one poll arrive as kubelet's watch would deliver them: in the order their
        # bindings were written (resourceVersion), not in the list's name order
        for uid in sorted((u for u in live if u not in self._arrival), key=lambda u: _version(live[u])):
            self._arrival[uid] = len(self._arrival)
        for uid in [u for u in self._arrival if u not in live]:
            del self._arrival[uid]
        order = sorted(
            live.items(), key=lambda kv: (kv[1]["metadata"].get("creationTimestamp") or "", self._arrival[kv[0]])
        )
        for uid, pod in order:
            if uid in self._admitted or uid in self._starting or self._attempts.get(uid, 0) >= MAX_ATTEMPTS:
                continue
            wanted = gpu_resources_of(pod)
            if not wanted <= set(self.standin.plugins):
                continue  # kubelet would not admit before the device plugins registered
            await self._admit(uid, pod)

    async def _admit(self, uid: str, pod: dict[str, Any]) -> None:
        from devstack.cluster.kubelet import AdmissionError
        from devstack.cluster.kubelet_dra import DraPrepareDeferred, DraPrepareError

        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            if uid in self._not_started:
                # like kubelet: a container whose start failed keeps its devices; only the start is retried
                pod, envs = self._not_started[uid]
            else:
                envs = await self.standin.admit(pod, start=False)
                envs = await self._prepare(pod, envs)
                self._not_started[uid] = (pod, envs)
            if self.concurrent_start:
                self._starting[uid] = asyncio.create_task(self._start(uid, pod, envs))
                return
            await self.standin.start_pod(pod)
        except DraPrepareDeferred:
            return  # kubelet's pod worker would not have tried yet: not an attempt
        except (AdmissionError, DraPrepareError) as exc:
            self._failed(uid, key, exc)
            if isinstance(exc, AdmissionError) and exc.call != "PreStartContainer" and self.admission_failures_final:
                await self._reject(uid, pod, exc)
            return
        await self._started(uid, pod, envs)

    async def _start(self, uid: str, pod: dict[str, Any], envs: dict[str, dict[str, str]]) -> None:
        """Start an admitted pod in a task of its own (`concurrent_start`)."""
        from devstack.cluster.kubelet import AdmissionError

        meta = pod["metadata"]
        try:
            await self.standin.start_pod(pod)
        except AdmissionError as exc:
            self._failed(uid, (meta["namespace"], meta["name"]), exc)
            return
        finally:
            self._starting.pop(uid, None)
        await self._started(uid, pod, envs)

    async def _reject(self, uid: str, pod: dict[str, Any], exc: Exception) -> None:
        """kubelet's admission refusal is final: the pod fails with UnexpectedAdmissionError and is never admitted
        again (pkg/kubelet/cm/admission/errors.go, `Allocate failed due to %v, which is unexpected`; the
        allocation manager's "Pod admission denied"), where a failed PreStartContainer or DRA preparation is retried
        as the container is started again."""
        from devstack.cluster.kubelet import AdmissionError

        self._attempts[uid] = MAX_ATTEMPTS
        self._not_started.pop(uid, None)
        message = exc.message if isinstance(exc, AdmissionError) else str(exc)
        status = {
            "phase": "Failed",
            "reason": UNEXPECTED_ADMISSION,
            "message": f"Allocate failed due to {message}, which is unexpected",
        }
        meta = pod["metadata"]
        try:
            await client.CoreV1Api(self.api).patch_namespaced_pod_status(
                meta["name"], meta["namespace"], {"status": status}
            )
        except (ApiException, OSError, TimeoutError) as err:
            log.warning("could not report pod %s failed: %s", meta["name"], err, extra={"node": self.node})

    def _failed(self, uid: str, key: tuple[str, str], exc: Exception) -> None:
        self._attempts[uid] = self._attempts.get(uid, 0) + 1
        self.errors[key] = str(exc)
        log.warning("admission failed: %s", exc, extra={"node": self.node, "pod": key[1]})

    async def _started(self, uid: str, pod: dict[str, Any], envs: dict[str, dict[str, str]]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        self._not_started.pop(uid, None)
        self._admitted[uid] = pod
        self.envs[key] = envs
        self.errors.pop(key, None)
        log.info("pod admitted", extra={"node": self.node, "namespace": key[0], "pod": key[1]})
        await self._report_running(pod)

    async def _prepare(self, pod: dict[str, Any], envs: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        """kubelet prepares a pod's claims before its containers start; each container then gets its CDI devices'
        environment on top of what the device plugins gave it."""
        if self.dra is None or not (pod.get("spec") or {}).get("resourceClaims"):
            return envs
        await self.dra.prepare(pod)
        spec = pod.get("spec") or {}
        out = dict(envs)
        for c in list(spec.get("initContainers") or []) + list(spec.get("containers") or []):
            out[c["name"]] = {**envs.get(c["name"], {}), **self.dra.container_env(pod, c)}
        return out

    async def _unprepare(self, pod: dict[str, Any]) -> None:
        """kubelet unprepares a pod's claims once its containers stopped (a failure is logged, kubelet retries)."""
        if self.dra is None:
            return
        try:
            await self.dra.unprepare(pod)
        except Exception as exc:
            log.warning("unprepare failed: %s", exc, extra={"node": self.node, "pod": pod["metadata"]["name"]})

    async def _report_running(self, pod: dict[str, Any]) -> None:
        """Patch the pod's status to Running, as kubelet does once its containers started (a pod already gone
        or a failed patch is only logged: admission itself succeeded)."""
        meta = pod["metadata"]
        try:
            await client.CoreV1Api(self.api).patch_namespaced_pod_status(
                meta["name"], meta["namespace"], running_status(pod, datetime.now(UTC))
            )
        except (ApiException, OSError, TimeoutError) as exc:
            log.warning("could not report pod %s running: %s", meta["name"], exc, extra={"node": self.node})


async def api_release(api: ApiClient) -> Release:
    """The Kubernetes release the API server runs (`/version`'s gitVersion, e.g. v1.37.2), which a kubelet joining
    it plays."""
    info = await client.VersionApi(api).get_code(_request_timeout=10)
    match = re.match(r"^v?1\.(\d+)\.(\d+)", info.git_version or "")
    if not match:
        raise ValueError(f"the API server reports an unreadable version: {info.git_version!r}")
    return Release(f"v1.{match.group(1)}.{match.group(2)}")


async def start_kubelet(api: ApiClient, node: str, device_plugin_dir: Path, pod_resources_socket: Path) -> NodeKubelet:
    """Start the kubelet side of `node`."""
    return await NodeKubelet(api, node, device_plugin_dir, pod_resources_socket).start()


def _version(pod: dict[str, Any]) -> int:
    """The pod's resourceVersion as a number (etcd's revision; 0 when it is not one)."""
    value = str(pod["metadata"].get("resourceVersion") or "")
    return int(value) if value.isdigit() else 0


class SharedAdmission:
    """One pod list for many nodes' kubelets (hundreds of simulated nodes in one process must not each poll
    the API server): every `interval` it lists the pods bound to a node and hands each kubelet its own."""

    def __init__(self, api: ApiClient, kubelets: dict[str, NodeKubelet], *, interval: float = 1.0) -> None:
        self.api = api
        self.kubelets = kubelets
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> SharedAdmission:
        """Begin admitting pods."""
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        """Stop admitting pods."""
        task, self._task = self._task, None
        await cancelled(task)

    async def _loop(self) -> None:
        while True:
            try:
                pods, _ = await list_pods(self.api, field_selector="spec.nodeName!=")
                by_node: dict[str, list[dict[str, Any]]] = {name: [] for name in self.kubelets}
                for pod in pods:
                    node = (pod.get("spec") or {}).get("nodeName")
                    if node in by_node:
                        by_node[node].append(pod)
                await asyncio.gather(*(k.sync(by_node[n]) for n, k in self.kubelets.items()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the apiserver may be restarting; try again
                log.warning("shared kubelet admission failed: %s", exc)
            await asyncio.sleep(self.interval)
