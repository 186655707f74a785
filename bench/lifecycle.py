"""The whole life of a benchmark's pods: created, bound, admitted and started by kubelet, their GPU recorded.

`NodeWatchKubelets` plays kubelet's side of every simulated node of a stack as kubelet 1.37 gets its pods: a watch
per node (`fieldSelector=spec.nodeName=<node>`, as kubelet's API source), the pods handed to that node's
`devstack.stack.kubelets.NodeKubelet` as they arrive, which admits them in kubelet's order (creation time, then
arrival), calls GetPreferredAllocation and Allocate per container through the node agent's device plugins, then,
in a task per pod while the next pods are admitted (kubelet's pod workers and status manager), PreStartContainer per
container and the pod's Running status; it serves pod-resources (`devstack.cluster.kubelet.KubeletStandIn`).
`PodTimes` records when each pod was created (just before its create request), first seen bound (on its node's
watch, where kubelet sees it), started (its last container's PreStartContainer answered) and first showed
`ALIYUN_COM_GPU_MEM_ASSIGNED=true`. `disagreements` checks every GPU pod afterwards: the environment each
container got, the ledger and both annotations must name the same GPUs, and no GPU may hold more than its memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from kubernetes_asyncio import client

from bench.common import gather_limited, percentile
from shared.annotations import ALLOCATION, GPU_MEM_ASSIGNED, GPU_MEM_IDX, RESOURCE_MEM, parse_allocation
from shared.kube.raw import read_json
from shared.kube.watching import DELETED, SYNCED, watch_objects
from shared.ledger.rules import LIVE_STATE_VALUES


def pod_key(pod: dict[str, Any]) -> str:
    """`namespace/name`."""
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


@dataclass
class PodTimes:
    """Monotonic times of each pod's steps, by `namespace/name` (the first time each was seen)."""

    created: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)  # the last container's PreStartContainer answered
    running: dict[str, float] = field(default_factory=dict)  # kubelet's Running status seen
    assigned: dict[str, float] = field(default_factory=dict)  # ALIYUN_COM_GPU_MEM_ASSIGNED=true seen

    def saw(self, pod: dict[str, Any], now: float) -> None:
        """Record what a pod as the API server sent it shows (bound, Running, the assigned flag)."""
        key = pod_key(pod)
        if (pod.get("spec") or {}).get("nodeName"):
            self.bound.setdefault(key, now)
        if (pod.get("status") or {}).get("phase") == "Running":
            self.running.setdefault(key, now)
        if ((pod.get("metadata") or {}).get("annotations") or {}).get(GPU_MEM_ASSIGNED) == "true":
            self.assigned.setdefault(key, now)

    def count(self, step: str, namespace: str) -> int:
        """How many pods of a namespace reached a step."""
        prefix = f"{namespace}/"
        return sum(1 for k in getattr(self, step) if k.startswith(prefix))

    def last(self, step: str, namespace: str) -> float:
        """When the last pod of a namespace reached a step (0 for none)."""
        prefix = f"{namespace}/"
        return max((t for k, t in getattr(self, step).items() if k.startswith(prefix)), default=0.0)

    def delays(self, since: str, until: str, namespace: str) -> list[float]:
        """Seconds from one step to a later one, for each pod of the namespace that reached both."""
        start, end = getattr(self, since), getattr(self, until)
        prefix = f"{namespace}/"
        return [end[k] - t for k, t in start.items() if k.startswith(prefix) and k in end]


def latency_ms(prefix: str, seconds: list[float]) -> dict[str, float]:
    """`<prefix>_p50_ms`, `_p99_ms`, `_max_ms` (0 for none)."""
    if not seconds:
        return {f"{prefix}_p50_ms": 0.0, f"{prefix}_p99_ms": 0.0, f"{prefix}_max_ms": 0.0}
    return {
        f"{prefix}_p50_ms": round(percentile(seconds, 50) * 1000, 1),
        f"{prefix}_p99_ms": round(percentile(seconds, 99) * 1000, 1),
        f"{prefix}_max_ms": round(max(seconds) * 1000, 1),
    }


class NodeWatchKubelets:
    """Every node's kubelet stand-in fed by a watch of its node's pods (see the module docstring); `skip(pod)`
    leaves pods no kubelet here admits (the seed's extender's pods: it has no device plugin of its own here)."""

    def __init__(
        self,
        api: Any,
        kubelets: dict[str, Any],
        times: PodTimes,
        *,
        skip: Callable[[dict[str, Any]], bool] | None = None,
        retry_s: float = 0.5,
    ) -> None:
        self.api = api
        self.kubelets = kubelets
        self.times = times
        self.skip = skip or (lambda pod: False)
        self.retry_s = retry_s
        self._live: dict[str, dict[str, dict[str, Any]]] = {node: {} for node in kubelets}
        self._dirty: dict[str, asyncio.Event] = {node: asyncio.Event() for node in kubelets}
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    async def start(self) -> NodeWatchKubelets:
        """Stop the kubelets' own polling and feed them from the watches."""
        for node, kubelet in self.kubelets.items():
            await kubelet.pause()
            kubelet.standin.on_started = self._started
            kubelet.concurrent_start = True  # kubelet's pod workers start pods while the next are admitted
            self._tasks.append(asyncio.create_task(self._watch(node)))
            self._tasks.append(asyncio.create_task(self._work(node)))
        return self

    async def stop(self) -> None:
        """Stop watching and admitting."""
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for kubelet in self.kubelets.values():
            await kubelet.pause()
            kubelet.standin.on_started = None
            kubelet.concurrent_start = False

    def _started(self, pod: dict[str, Any]) -> None:
        self.times.started.setdefault(pod_key(pod), time.monotonic())

    async def _watch(self, node: str) -> None:
        core = client.CoreV1Api(self.api)
        listing = functools.partial(core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}")
        live = self._live[node]
        async for event in watch_objects(listing, what=f"pods of {node}", stop=self._stop):
            if event.type == SYNCED or not event.object:
                continue
            pod = event.object
            self.times.saw(pod, time.monotonic())
            uid = (pod.get("metadata") or {}).get("uid", "")
            if event.type == DELETED or (pod.get("metadata") or {}).get("deletionTimestamp"):
                if live.pop(uid, None) is None:
                    continue
            elif self.skip(pod):
                continue
            else:
                live[uid] = pod
            self._dirty[node].set()

    async def _work(self, node: str) -> None:
        kubelet, live, dirty = self.kubelets[node], self._live[node], self._dirty[node]
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(dirty.wait(), self.retry_s)
            if not dirty.is_set() and not kubelet.errors:
                continue  # nothing new, and no admission to retry
            dirty.clear()
            await kubelet.sync(list(live.values()))


async def create_timed(
    api: Any,
    namespace: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    times: PodTimes,
    *,
    rate: float | None = None,
) -> None:
    """Create the pods with at most `concurrency` requests in flight (and, with `rate`, no more than `rate` a
    second, evenly spaced), each one's time taken as its request goes out."""
    core = client.CoreV1Api(api)
    start = time.monotonic()

    async def one(i: int, body: dict[str, Any]) -> None:
        if rate:
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        times.created[f"{namespace}/{body['metadata']['name']}"] = time.monotonic()
        await read_json(await core.create_namespaced_pod(namespace, body, _preload_content=False))

    await gather_limited(concurrency, [one(i, b) for i, b in enumerate(bodies)])


async def wait_for(times: PodTimes, step: str, namespace: str, count: int, timeout_s: float) -> bool:
    """Until `count` pods of the namespace reached `step` (polled in memory); False at the timeout."""
    deadline = time.monotonic() + timeout_s
    while times.count(step, namespace) < count:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def watch_namespace(api: Any, namespace: str, times: PodTimes, stop: asyncio.Event) -> None:
    """Record the steps of a namespace's pods from one watch (where no in-process kubelet sees them)."""
    core = client.CoreV1Api(api)
    listing = functools.partial(core.list_namespaced_pod, namespace)
    async for event in watch_objects(listing, what=f"pods of {namespace}", stop=stop):
        if event.type != SYNCED and event.object:
            times.saw(event.object, time.monotonic())


# -- exactness --------------------------------------------------------------------------------------------
Envs = Callable[[str, str, str], dict[str, str] | None]  # (namespace, pod, container) -> its environment
_LEDGER = (
    "SELECT a.pod_name, a.state, p.container, p.gpu_uuid, p.gpu_index, p.init, p.sidecar FROM allocations a"
    " JOIN allocation_parts p ON p.allocation_id = a.id WHERE a.namespace = $1 AND a.state = ANY($2::text[])"
    " ORDER BY p.gpu_index"
)
_OVERCOMMIT = (
    "SELECT g.node, g.uuid, g.memory_mib, g.allocated_memory_mib, coalesce(s.mib, 0) AS held FROM gpus g"
    " LEFT JOIN (SELECT p.gpu_uuid, sum(p.memory_mib) AS mib FROM allocation_parts p JOIN allocations a"
    " ON a.id = p.allocation_id WHERE a.state = ANY($1::text[]) AND (NOT p.init OR p.sidecar)"
    " GROUP BY p.gpu_uuid) s ON s.gpu_uuid = g.uuid"
    " WHERE g.retired_at IS NULL AND (g.allocated_memory_mib > g.memory_mib OR coalesce(s.mib, 0) > g.memory_mib"
    " OR g.allocated_memory_mib <> coalesce(s.mib, 0))"
)


async def disagreements(api: Any, database_url: str, namespace: str, envs: Envs | None) -> list[str]:
    """What disagrees about the GPU pods of a namespace ([] when all agree): for every app container, the
    environment kubelet's Allocate returned (`envs(namespace, pod, container)`; None: not checked), the ledger (an
    assigned live allocation) and the pod's `ALIYUN_COM_GPU_MEM_IDX` and `gpushare.io/allocation` must name the same
    GPUs; and no GPU's counter may differ from its live shares or exceed its memory. Pods without GPU are left
    out."""
    core = client.CoreV1Api(api)
    pods = (await read_json(await core.list_namespaced_pod(namespace, _preload_content=False))).get("items") or []
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(_LEDGER, namespace, list(LIVE_STATE_VALUES))
        over = await conn.fetch(_OVERCOMMIT, list(LIVE_STATE_VALUES))
    finally:
        await conn.close()
    ledger: dict[str, dict[str, list[Any]]] = {}  # pod -> container -> its parts (every container, init too)
    states: dict[str, str] = {}
    for r in rows:
        ledger.setdefault(r["pod_name"], {}).setdefault(r["container"], []).append(r)
        states[r["pod_name"]] = r["state"]
    wrong = [
        f"GPU {r['node']}/{r['uuid']}: counter {r['allocated_memory_mib']} MiB, live shares {r['held']} MiB, "
        f"memory {r['memory_mib']} MiB"
        for r in over
    ]
    for pod in pods:
        name = pod["metadata"]["name"]
        gpu = [c for c in pod["spec"]["containers"] if RESOURCE_MEM in ((c.get("resources") or {}).get("limits") or {})]
        if gpu:
            wrong += _pod_disagreement(pod, gpu, ledger.get(name, {}), states.get(name, ""), envs)
    return wrong


def _pod_disagreement(
    pod: dict[str, Any],
    containers: list[dict[str, Any]],
    ledger: dict[str, list[Any]],
    state: str,
    envs: Envs | None,
) -> list[str]:
    meta = pod["metadata"]
    ns, name = meta["namespace"], meta["name"]
    notes = meta.get("annotations") or {}
    if state != "assigned":
        return [f"{name}: ledger state {state or 'none'}, not assigned"]
    out = []
    indices: set[int] = set()
    for c in containers:
        parts = ledger.get(c["name"], [])
        want_uuids = ",".join(p["gpu_uuid"] for p in parts)
        want_idx = ",".join(str(p["gpu_index"]) for p in parts)
        indices |= {p["gpu_index"] for p in parts}
        if envs is None:
            continue
        env = envs(ns, name, c["name"])
        if env is None:
            out.append(f"{name}/{c['name']}: no environment (not started)")
        elif env.get("NVIDIA_VISIBLE_DEVICES") != want_uuids or env.get("ALIYUN_COM_GPU_MEM_IDX") != want_idx:
            out.append(
                f"{name}/{c['name']}: env {env.get('NVIDIA_VISIBLE_DEVICES')} ({env.get('ALIYUN_COM_GPU_MEM_IDX')})"
                f" vs ledger {want_uuids} ({want_idx})"
            )
    want_idx = ",".join(str(i) for i in sorted(indices))  # the app containers' GPUs (`record_annotations`)
    if notes.get(GPU_MEM_IDX) != want_idx:
        out.append(f"{name}: {GPU_MEM_IDX}={notes.get(GPU_MEM_IDX)} vs ledger {want_idx}")
    try:
        recorded = sorted((p.container, p.gpu_uuid) for p in parse_allocation(notes.get(ALLOCATION, ""))[2])
    except ValueError as exc:
        return [*out, f"{name}: {exc}"]
    held = sorted((p["container"], p["gpu_uuid"]) for parts in ledger.values() for p in parts)
    if recorded != held:
        out.append(f"{name}: {ALLOCATION} names {recorded}, the ledger {held}")
    return out
