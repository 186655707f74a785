"""The node agent: discovery and inventory, health, the three device plugins, usage and metrics.

agent = NodeAgent(config, backend, bus=...)
await agent.start()            # GPUs discovered, plugins serving and registering, ledger loops started
...                            # background loops run until `agent.stop` is set
await agent.close()

The agent's only channel to the ledger is the bus (`ledger_link`): a snapshot of its node from the binder's
gateway plus the node's events keep its view current, and inventory, health, assignments and exchanges go to
the gateway as commands. When the ledger cannot be reached the agent keeps serving kubelet from what it knows,
reports not ready, and retries with capped backoff; only a fatal error stops it (with a non-zero exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.node_agent import labels as node_labels
from services.node_agent.assigner import Assigner
from services.node_agent.assignment import device_id
from services.node_agent.discovery import GpuBackend, GpuDevice, HealthChange, schedulable_mib
from services.node_agent.ledger_link import CommandRefused, LedgerLink, LedgerUnavailable
from services.node_agent.metrics import AgentMetrics
from services.node_agent.mps import MpsRoot
from services.node_agent.plugin import PluginServer, dp_pb2
from services.node_agent.usage import (
    OveruseTracker,
    allocated_by_pod_gpu,
    build_samples,
    pid_to_pod_uid,
    pod_sm_series,
)
from services.node_agent.view import NodeView, allocated_by_gpu
from shared.annotations import RESOURCE_CORE, RESOURCE_MEM, RESOURCES
from shared.dra import CDI_DIR, PLUGIN_DIR, REGISTRATION_DIR
from shared.events.bus import EventBus
from shared.events.catalogue import Event, GpuInfo, HealthEvent, InventoryEvent, UnallocatedUseEvent, UsageEvent
from shared.kubelet_api import DEVICE_PLUGIN_DIR, POD_RESOURCES_SOCKET
from shared.metrics import gpu_labels, mib_to_bytes, percent_to_ratio
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)


@dataclass
class AgentConfig:
    """What the agent needs to know about its node."""

    node: str
    unit: MemoryUnit = MemoryUnit.GIB
    device_plugin_dir: Path = DEVICE_PLUGIN_DIR
    pod_resources_socket: str = POD_RESOURCES_SOCKET
    mps: bool = False
    mps_root: Path | None = None  # hand out MPS limits while the control daemon runs there (services/node_agent/mps.py)
    device_list_strategy: str = "envvar"  # or volume-mounts (assignment.device_list)
    type_label_key: str = "gpu-type"
    usage_interval_s: float = 5.0
    inventory_interval_s: float = 30.0
    resync_interval_s: float = 300.0  # a fresh snapshot now and then repairs whatever the stream could not
    ledger_deadline_s: float = 10.0  # how long one snapshot or command may take, retries included
    retry_max_s: float = 30.0  # the longest pause between attempts while the ledger is unreachable
    overuse_grace_s: float = 60.0
    evict_overusers: bool = False
    proc_root: Path = Path("/proc")
    address: str = ""
    metrics_debounce_s: float = 0.5  # ledger events within this window refresh the GPU gauges once
    dra: bool = False  # a DRA node: the DRA plugin and a ResourceSlice, no device plugins (services/node_agent/dra.py)
    dra_registration_dir: Path = Path(REGISTRATION_DIR)
    dra_plugin_dir: Path = Path(PLUGIN_DIR)
    cdi_dir: Path = Path(CDI_DIR)
    # how long NodePrepareResources waits for the ledger to hold a claim's allocation before refusing it (the binder
    # records an allocation from its claim watch, and kubelet may call as soon as the pod is bound)
    dra_ledger_wait_s: float = 10.0


@dataclass
class NodeAgent:
    """One node's agent. Kubernetes access (`patch_node_labels`, `evict_pod`) is optional."""

    config: AgentConfig
    backend: GpuBackend
    bus: EventBus
    metrics: AgentMetrics = field(default_factory=AgentMetrics)
    patch_node_labels: Callable[[str, dict[str, str]], Awaitable[None]] | None = None
    evict_pod: Callable[[str, str], Awaitable[None]] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    kube_api: Any = None  # the API client: needed with --dra (the slice, the claims)

    def __post_init__(self) -> None:
        self.gpus: list[GpuDevice] = []
        self.health: dict[str, bool] = {}
        self.driver = self.cuda = ""
        self.failed: BaseException | None = None  # a fatal error stopped the agent
        self._changed = asyncio.Event()
        self._view_changed = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.link = LedgerLink(self.bus, self.config.node, max_backoff_s=min(5.0, self.config.retry_max_s))
        self.view = NodeView(self.config.node)
        self._reload_lock = asyncio.Lock()
        self._inventory_sent = False  # the ledger holds the inventory last discovered
        self._inventory_due = asyncio.Event()
        self.overuse = OveruseTracker(self.config.overuse_grace_s)
        self._unallocated_labels: dict[tuple[str, str], tuple[str, ...]] = {}
        self.last_usage: UsageEvent | None = None
        self._metrics_due: asyncio.TimerHandle | None = None
        self.assigner = Assigner(
            link=self.link,
            view=self.view,
            reload=self.reload_view,
            node=self.config.node,
            unit=self.config.unit,
            pod_resources_socket=self.config.pod_resources_socket,
            gpu_memory_mib=lambda: {g.uuid: schedulable_mib(g.memory_total_mib, self.config.unit) for g in self.gpus},
            gpu_total_mib=lambda: {g.uuid: g.memory_total_mib for g in self.gpus},
            mps=self.config.mps,
            mps_root=MpsRoot(self.config.mps_root) if self.config.mps_root else None,
            on_outcome=lambda reason: self.metrics.plugin_outcomes.labels(self.config.node, reason).inc(),
        )
        self.dra: Any = None  # DraNode with --dra (started in `start`)
        self.plugins = (
            []
            if self.config.dra
            else [
                PluginServer(
                    self.config.device_plugin_dir,
                    r,
                    self,
                    pre_start=(r == RESOURCE_MEM),
                    device_list=self.config.device_list_strategy,
                )
                for r in RESOURCES
            ]
        )

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Discover the GPUs, start the plugins, then the loops that keep the ledger and the view current.

        Nothing here waits for the ledger: kubelet is served from the start, and `ready()` says when the
        ledger holds the inventory and the view is loaded.
        """
        await self.discover()
        if self.config.dra:
            from services.node_agent.dra import DraNode

            if self.kube_api is None:
                raise RuntimeError("--dra needs Kubernetes access (the ResourceSlice and the claims)")
            self.dra = DraNode(
                self,
                self.kube_api,
                registration_dir=self.config.dra_registration_dir,
                plugin_dir=self.config.dra_plugin_dir,
                cdi_dir=self.config.cdi_dir,
            )
            await self.dra.start()
            self._spawn(self.dra.slice_loop(self.stop))
            self._spawn(self.dra.server.watch(self.stop))
        for p in self.plugins:
            await p.start()
            self._spawn(p.watch(self.stop))
        self._spawn(self._health_loop())
        self._spawn(self._usage_loop())
        self._spawn(self._inventory_loop())
        self._spawn(self._view_loop())

    def ready(self) -> bool:
        """GPUs discovered, the inventory recorded, the view loaded and the ledger reachable."""
        ready = bool(self.gpus) and self._inventory_sent and self.view.loaded and self.link.reachable
        return ready and (self.dra is None or self.dra.published.is_set())

    def inventory_recorded(self) -> bool:
        """Whether the ledger holds the inventory last discovered."""
        return self._inventory_sent

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)

        def _done(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("node agent task failed: %r", t.exception(), exc_info=t.exception())
                self.failed = t.exception()
                self.stop.set()

        task.add_done_callback(_done)
        self._tasks.append(task)

    async def close(self) -> None:
        """Stop every loop and plugin server."""
        self.stop.set()
        self._notify()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for p in self.plugins:
            await p.stop()
        if self.dra is not None:
            await self.dra.close()
        await self.link.unfollow()
        await self.assigner.pod_resources.close()
        if self._metrics_due is not None:
            self._metrics_due.cancel()
            self._metrics_due = None

    # -- the view of the ledger -----------------------------------------------------------------
    async def reload_view(self) -> bool:
        """Load a snapshot of the node and follow its events from there; False when the ledger is unreachable.

        Concurrent callers share one reload.
        """
        if self._reload_lock.locked():
            async with self._reload_lock:
                return self.view.loaded
        async with self._reload_lock:
            try:
                snapshot = await self.link.snapshot(deadline_s=self.config.ledger_deadline_s)
                self.view.load(snapshot)
                await self.link.follow(snapshot.stream_seq, self._on_event)
            except (LedgerUnavailable, OSError, TimeoutError) as exc:
                log.warning("could not load the node's view of the ledger: %s", exc, extra={"node": self.config.node})
                return False
            except Exception as exc:  # the stream subscription: NATS may be between reconnects
                log.warning("could not follow the node's events: %r", exc, extra={"node": self.config.node})
                return False
        self._update_gpu_metrics()
        return True

    def _on_event(self, event: Event) -> None:
        if self.view.apply(event):
            self._gpu_metrics_soon()
            old, self._view_changed = self._view_changed, asyncio.Event()
            old.set()

    def view_changed(self) -> asyncio.Event:
        """Set at the next change of the node's view of the ledger (an event of the node applied)."""
        return self._view_changed

    def _gpu_metrics_soon(self) -> None:
        """Refresh the GPU gauges once for every ledger event of the next `metrics_debounce_s`: a refresh walks
        every allocation on the node, so one per event would cost a burst of N pods N x N steps."""
        if self._metrics_due is not None:
            return

        def refresh() -> None:
            self._metrics_due = None
            self._update_gpu_metrics()

        self._metrics_due = asyncio.get_running_loop().call_later(self.config.metrics_debounce_s, refresh)

    async def _view_loop(self) -> None:
        """Load the view (retrying with capped backoff while the ledger is away), then resync periodically."""
        attempt = 0
        while not self.stop.is_set():
            if await self.reload_view():
                attempt, pause = 0, self.config.resync_interval_s
            else:
                attempt += 1
                pause = min(self.config.retry_max_s, 0.5 * 2**attempt)
            if await _sleep_or_stop(self.stop, pause):
                return

    # -- inventory and health -----------------------------------------------------------------
    def gpu_infos(self) -> list[GpuInfo]:
        """The inventory as the ledger wants it."""
        return [
            GpuInfo(
                uuid=g.uuid,
                index=g.index,
                model=g.model,
                memory_mib=schedulable_mib(g.memory_total_mib, self.config.unit),
                memory_total_mib=g.memory_total_mib,
                healthy=self.health.get(g.uuid, True),
                mig_mode=g.mig_mode,
                numa_node=g.numa_node,
                pci_bus_id=g.pci_bus_id,
            )
            for g in self.gpus
        ]

    async def discover(self) -> bool:
        """Re-discover the GPUs; True when something changed (the ledger then needs the new inventory)."""
        gpus = await asyncio.to_thread(self.backend.devices)
        driver, cuda = await asyncio.to_thread(self.backend.versions)
        if gpus == self.gpus and (driver, cuda) == (self.driver, self.cuda):
            return False
        self.gpus, self.driver, self.cuda = gpus, driver, cuda
        for g in gpus:
            self.health.setdefault(g.uuid, True)
        self._inventory_sent = False
        self._notify()
        self._update_gpu_metrics()
        return True

    async def refresh_inventory(self, *, force: bool = False) -> bool:
        """Re-discover; send the inventory to the ledger when something changed, it was not sent yet, or
        `force`. True when sent. Raises `LedgerUnavailable` / `CommandRefused` when it could not be."""
        changed = await self.discover()
        if not (force or changed or not self._inventory_sent):
            return False
        await self.link.send(
            InventoryEvent(
                node=self.config.node,
                gpus=self.gpu_infos(),
                driver_version=self.driver,
                cuda_version=self.cuda,
                address=self.config.address,
                allocator="dra" if self.config.dra else "extender",
                source="node-agent",
            ),
            deadline_s=self.config.ledger_deadline_s,
        )
        self._inventory_sent = True
        log.info("inventory recorded", extra={"node": self.config.node, "gpus": len(self.gpus)})
        await self._label_node()
        return True

    async def _label_node(self) -> None:
        if self.patch_node_labels is None:
            return
        labels = node_labels.node_labels(
            self.gpus,
            self.driver,
            self.cuda,
            type_label_key=self.config.type_label_key,
            schedulable_mib={g.uuid: schedulable_mib(g.memory_total_mib, self.config.unit) for g in self.gpus},
        )
        try:
            await self.patch_node_labels(self.config.node, labels)
        except Exception as exc:
            log.warning("could not label node %s: %s", self.config.node, exc)

    async def apply_health(self, change: HealthChange) -> bool:
        """Record a health change and tell kubelet (ListAndWatch); False when nothing changed."""
        if change.gpu_uuid not in self.health or self.health[change.gpu_uuid] == change.healthy:
            return False
        self.health[change.gpu_uuid] = change.healthy
        self._notify()  # kubelet hears it at once, whether or not the ledger does
        try:
            await self.link.send(
                HealthEvent(
                    node=self.config.node,
                    gpu_uuid=change.gpu_uuid,
                    healthy=change.healthy,
                    reason=change.reason,
                    source="node-agent",
                ),
                deadline_s=self.config.ledger_deadline_s,
            )
        except (LedgerUnavailable, CommandRefused) as exc:
            # the inventory carries every GPU's health: resending it brings the ledger up to date
            log.warning(
                "could not record GPU %s health in the ledger (%s); resending the inventory", change.gpu_uuid, exc
            )
            self._inventory_sent = False
            self._inventory_due.set()
        log.warning(
            "GPU %s is now %s: %s", change.gpu_uuid, "healthy" if change.healthy else "unhealthy", change.reason
        )
        self._update_gpu_metrics()
        return True

    async def _health_loop(self) -> None:
        while not self.stop.is_set():
            changes = await asyncio.to_thread(self.backend.wait_health, 0.5)
            for change in changes:
                await self.apply_health(change)

    async def _inventory_loop(self) -> None:
        """Keep the ledger's inventory current: at start, on change (checked every interval), after a failed
        health write; while the ledger is unreachable, retry with capped backoff and one log line per try."""
        attempt = 0
        while not self.stop.is_set():
            self._inventory_due.clear()
            try:
                await self.refresh_inventory()
                attempt, pause = 0, self.config.inventory_interval_s
            except (LedgerUnavailable, CommandRefused) as exc:
                attempt += 1
                pause = min(self.config.retry_max_s, 0.5 * 2**attempt)
                log.warning("inventory not recorded (%s); retrying in %.0fs", exc, pause)
            await _wait_any((self._inventory_due, self.stop), pause)

    # -- device plugin handler ------------------------------------------------------------------
    def changed(self) -> asyncio.Event:
        """Set at the next device change."""
        return self._changed

    def _notify(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    def device_list(self, resource: str) -> list[Any]:
        """kubelet devices of a resource: gpu-mem one per unit, gpu-core 100 per GPU, gpu-count one per GPU."""
        out: list[Any] = []
        for g in self.gpus:
            health = "Healthy" if self.health.get(g.uuid, True) else "Unhealthy"
            topo = dp_pb2.TopologyInfo(nodes=[dp_pb2.NUMANode(ID=g.numa_node)]) if g.numa_node is not None else None
            if resource == RESOURCE_MEM:
                n = schedulable_mib(g.memory_total_mib, self.config.unit) // self.config.unit.mib
                ids = [device_id(g.uuid, j) for j in range(n)]
            elif resource == RESOURCE_CORE:
                ids = [f"{g.uuid}-core-{j}" for j in range(100)]
            else:
                ids = [g.uuid]
            out.extend(dp_pb2.Device(ID=i, health=health, topology=topo) for i in ids)
        return out

    async def preferred(self, resource: str, available: list[str], must: list[str], size: int) -> list[str]:
        """gpu-mem: the reserved GPU's IDs; other resources: no preference."""
        if resource != RESOURCE_MEM:
            return []
        return await self.assigner.preferred(available, must, size)

    async def allocate(self, resource: str, device_ids: list[str]) -> dict[str, str]:
        """gpu-mem carries the assignment and the env; gpu-core / gpu-count are counted only."""
        self.metrics.plugin_calls.labels(self.config.node, resource, "Allocate").inc()
        if resource != RESOURCE_MEM:
            return {}
        return await self.assigner.allocate(device_ids)

    async def prestart(self, resource: str, device_ids: list[str]) -> None:
        """gpu-mem: confirm the container against kubelet's pod-resources API."""
        self.metrics.plugin_calls.labels(self.config.node, resource, "PreStartContainer").inc()
        if resource == RESOURCE_MEM:
            await self.assigner.prestart(device_ids)

    # -- usage, metrics ---------------------------------------------------------------------------
    def _update_gpu_metrics(self) -> None:
        m, node = self.metrics, self.config.node
        view = self.view.containers()
        allocated = allocated_by_gpu(view)
        for g in self.gpus:
            labels = gpu_labels(node, g.index, g.uuid, g.model)
            m.gpu_total.labels(*labels).set(mib_to_bytes(schedulable_mib(g.memory_total_mib, self.config.unit)))
            m.gpu_allocated.labels(*labels).set(mib_to_bytes(allocated.get(g.uuid, 0)))
            m.gpu_healthy.labels(*labels).set(1 if self.health.get(g.uuid, True) else 0)
        pods: dict[tuple[str, str, str], int] = {}
        for c in view:
            if c.long_running:
                key = (node, c.namespace, c.pod_name)
                pods[key] = pods.get(key, 0) + sum(s.memory_mib for s in c.shares)
        m.pod_allocated.publish({key: mib_to_bytes(mib) for key, mib in pods.items()})

    async def sample_usage(self) -> UsageEvent:
        """Sample processes, publish a UsageEvent on the bus, update metrics, track over-use."""
        processes = await asyncio.to_thread(self.backend.processes)
        utilization = await asyncio.to_thread(self.backend.utilization)
        process_sm = await asyncio.to_thread(self.backend.process_utilization)
        view = self.view.containers()
        samples = build_samples(processes, utilization, pid_to_pod_uid(self.config.proc_root), view, process_sm)
        event = UsageEvent(node=self.config.node, samples=samples, source="node-agent")
        await self.bus.publish(event)
        self.last_usage = event
        m, node = self.metrics, self.config.node
        used_gpu: dict[str, int] = {}
        used_pod = {(node, c.namespace, c.pod_name): 0 for c in view}  # a live pod without processes uses 0
        for s in samples:
            used_gpu[s.gpu_uuid] = used_gpu.get(s.gpu_uuid, 0) + s.used_memory_mib
            if s.pod_uid:
                key = (node, s.namespace, s.pod_name)
                used_pod[key] = used_pod.get(key, 0) + s.used_memory_mib
        for g in self.gpus:
            labels = gpu_labels(node, g.index, g.uuid, g.model)
            m.gpu_used.labels(*labels).set(mib_to_bytes(used_gpu.get(g.uuid, 0)))
            m.gpu_util.labels(*labels).set(percent_to_ratio(utilization.get(g.uuid, 0.0)))
        m.pod_used.publish({key: mib_to_bytes(mib) for key, mib in used_pod.items()})
        m.pod_sm.publish(pod_sm_series(node, self.gpus, samples))
        self._update_gpu_metrics()
        allocated = allocated_by_pod_gpu(view)
        for sample, limit in self.overuse.update(samples, allocated, time.monotonic()):
            if limit is None:
                await self._unallocated(sample)
            else:
                await self._overuse(sample, limit)
        over = self.overuse.over()
        over_pods = {p for p, g in over if (p, g) in allocated}
        m.pod_overuse.publish({(node, c.namespace, c.pod_name): 1 if c.pod_uid in over_pods else 0 for c in view})
        unallocated = {(p, g) for p, g in over if (p, g) not in allocated}
        for pod_gpu, series in list(self._unallocated_labels.items()):
            m.pod_unallocated.labels(*series).set(1 if pod_gpu in unallocated else 0)
        return event

    async def _unallocated(self, sample: Any) -> None:
        """A pod uses a GPU where it holds no share: log, count, flag, and tell the bus (never skipped)."""
        pod = f"{sample.namespace}/{sample.pod_name}" if sample.pod_name else f"pod UID {sample.pod_uid}"
        log.warning(
            "%s uses %d MiB on GPU %s where it holds no GPU share: the GPU was reached around the device plugin "
            "(its own NVIDIA_VISIBLE_DEVICES, an exemption, a privileged container)",
            pod,
            sample.used_memory_mib,
            sample.gpu_uuid,
            extra={"reason": "unallocated_use", "pod_uid": sample.pod_uid, "gpu": sample.gpu_uuid},
        )
        gpu = next((g for g in self.gpus if g.uuid == sample.gpu_uuid), None)
        labels = (
            *gpu_labels(self.config.node, gpu.index if gpu else -1, sample.gpu_uuid, gpu.model if gpu else ""),
            sample.namespace,
            sample.pod_name or sample.pod_uid,
        )
        self._unallocated_labels[(sample.pod_uid, sample.gpu_uuid)] = labels
        self.metrics.unallocated_events.labels(*labels).inc()
        try:
            await self.bus.publish(
                UnallocatedUseEvent(
                    node=self.config.node,
                    gpu_uuid=sample.gpu_uuid,
                    pod_uid=sample.pod_uid,
                    namespace=sample.namespace,
                    pod_name=sample.pod_name,
                    used_memory_mib=sample.used_memory_mib,
                    source="node-agent",
                )
            )
        except Exception as exc:  # the metric and the log line stand; the bus may be away
            log.warning("could not publish the unallocated GPU use of %s: %s", pod, exc)

    async def _overuse(self, sample: Any, limit: int) -> None:
        log.warning(
            "pod %s/%s uses %d MiB on GPU %s but was allocated %d MiB (longer than %.0fs)",
            sample.namespace,
            sample.pod_name,
            sample.used_memory_mib,
            sample.gpu_uuid,
            limit,
            self.config.overuse_grace_s,
            extra={"reason": "overuse", "pod_uid": sample.pod_uid},
        )
        self.metrics.overuse_events.labels(self.config.node, sample.namespace, sample.pod_name).inc()
        if self.config.evict_overusers and self.evict_pod is not None and sample.pod_name:
            try:
                await self.evict_pod(sample.namespace, sample.pod_name)
                log.warning("evicted over-using pod %s/%s", sample.namespace, sample.pod_name)
            except Exception as exc:
                log.error("could not evict %s/%s: %s", sample.namespace, sample.pod_name, exc)

    async def _usage_loop(self) -> None:
        while not await _sleep_or_stop(self.stop, self.config.usage_interval_s):
            try:
                await self.sample_usage()
            except Exception as exc:
                log.warning("usage sampling failed: %s", exc)


async def _wait_any(events: tuple[asyncio.Event, ...], seconds: float) -> None:
    """Wait until one of `events` is set or `seconds` passed."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`; True when `stop` was set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()
