"""Keeping the ledger true to the cluster: release orphans, adopt annotated pods, report conflicts.

Each pass reads the ledger's live allocations *first*, then lists the pods: an allocation made after the
snapshot cannot be mistaken for an orphan, and a pod bound after it is adopted through `Ledger.reserve`,
which returns the existing allocation instead of creating a second (one live allocation per pod UID).
A `reserved` allocation younger than the grace period is never released (its Binding may be in flight);
an older one whose pod lives is handed to the bind handler (its event may sit unacked with a crashed binder).

Adoption is also the migration path from Aliyun gpushare: a bound pod with `ALIYUN_COM_GPU_MEM_IDX` (and
no `gpushare.io/allocation`) is charged on the GPU with that index on its node. What a pod is charged always
comes from its own request (`shared.placement.demand.parse_pod`: each container's `aliyun.com/gpu-mem`,
`aliyun.com/gpu-core` and `aliyun.com/gpu-count`, as the extender reads them); the annotations only say where:
which GPU(s). A pod that requests no `aliyun.com/gpu-mem` in its limits is never adopted, whatever it carries,
and an annotation that records another shape than the pod requests (more memory, another compute share,
another number of GPUs, other containers) is refused. Adoption reserves like the extender (`Ledger.reserve`),
so the namespace's quota and each GPU's capacity hold. Whatever the ledger cannot hold is a conflict: logged as
an error and counted, never dropped silently, and tried again next pass. docs/security.md says what adoption
trusts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client

from services.binder import reads
from services.binder.lifecycle import is_gpu_pod
from services.binder.metrics import BinderMetrics
from services.binder.reads import LiveAllocation
from shared.annotations import ALLOCATION, GPU_MEM_IDX, RESOURCE_MEM, parse_allocation, record_version
from shared.dra import CLAIM_ANNOTATION
from shared.events.catalogue import AllocationPart, ReservedEvent
from shared.kube import pods
from shared.kube.pods import Pod, list_pods
from shared.ledger.ledger import Ledger
from shared.ledger.reservations import InsufficientCapacity, QuotaExceeded, ReservationError, ReservationRequest
from shared.ledger.rules import AllocationState
from shared.placement.demand import ContainerDemand, DemandError, PodDemand, parse_pod, parse_quantity
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)


def stale_reservations(
    live: list[LiveAllocation], pods_by_uid: dict[str, Pod], *, now: datetime, grace_s: float
) -> list[LiveAllocation]:
    """`reserved` allocations older than the grace period whose pod still lives (pure).

    Their `reserved` event is still unacked somewhere (a binder crashed holding it, and JetStream waits
    out the ack deadline before redelivering) or was lost: binding them now catches up at once.
    """
    return [
        a
        for a in live
        if a.state == AllocationState.RESERVED
        and a.claim_uid is None  # a claim's allocation is bound by kube-scheduler, not by a Binding of ours
        and (now - a.reserved_at).total_seconds() >= grace_s
        and a.pod_uid in pods_by_uid
        and not pods.is_terminated(pods_by_uid[a.pod_uid])
    ]


@dataclass(frozen=True)
class Orphan:
    """A live allocation whose pod is gone or finished."""

    allocation: LiveAllocation
    reason: str


class AdoptionError(ValueError):
    """A pod's annotations cannot be turned into a ledger allocation (the message says why)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class ReconcileReport:
    """What one pass did."""

    released: int = 0
    terminating: int = 0
    annotated: int = 0
    adopted: int = 0
    rebound: int = 0
    conflicts: list[str] = field(default_factory=list)


def find_orphans(
    live: list[LiveAllocation], pods_by_uid: dict[str, Pod], *, now: datetime, grace_s: float
) -> list[Orphan]:
    """Live allocations to release (pure): pod missing (by UID) or terminated.

    A terminating pod is not an orphan: its containers may still hold the GPU (see `unmarked_terminating`).
    """
    out = []
    for alloc in live:
        pod = pods_by_uid.get(alloc.pod_uid)
        if pod is None:
            if alloc.state == AllocationState.RESERVED and (now - alloc.reserved_at).total_seconds() < grace_s:
                continue
            out.append(Orphan(alloc, "pod no longer exists"))
        elif pods.is_terminated(pod):
            out.append(Orphan(alloc, f"pod {pods.phase(pod).lower()}"))
    return out


def unmarked_terminating(live: list[LiveAllocation], pods_by_uid: dict[str, Pod]) -> list[LiveAllocation]:
    """Live allocations whose pod is terminating but which the ledger does not yet mark so (pure)."""
    return [
        a
        for a in live
        if a.terminating_at is None
        and a.pod_uid in pods_by_uid
        and pods.is_terminating(pods_by_uid[a.pod_uid])
        and not pods.is_terminated(pods_by_uid[a.pod_uid])
    ]


def stale_annotations(live: list[LiveAllocation], pods_by_uid: dict[str, Pod]) -> list[LiveAllocation]:
    """Bound allocations whose pod carries an older record than the ledger's (an exchange whose annotation
    patch was lost), pure. A pod not yet bound has no record to repair."""
    out = []
    for a in live:
        pod = pods_by_uid.get(a.pod_uid)
        if pod is None or a.state == "reserved" or not pods.node_name(pod):
            continue
        if record_version(pods.annotations(pod).get(ALLOCATION)) < a.version:
            out.append(a)
    return out


def adoption_candidates(all_pods: list[Pod], live_uids: set[str]) -> list[Pod]:
    """Bound pods not yet terminated carrying allocation annotations the ledger does not know, oldest first
    (pure). Terminating pods are adopted too: their containers may still hold the GPU.

    Oldest first: when pods claim more than a GPU holds, the pod that was there first keeps its share.
    """
    out = []
    for pod in all_pods:
        ann = pods.annotations(pod)
        if not (ALLOCATION in ann or GPU_MEM_IDX in ann) or CLAIM_ANNOTATION in ann:
            continue  # a claim's allocation is adopted through its claim (services/binder/claims.py)
        if not pods.node_name(pod) or pods.is_terminated(pod) or pods.pod_uid(pod) in live_uids:
            continue
        out.append(pod)
    return sorted(out, key=lambda p: (str(pods.metadata(p).get("creationTimestamp") or ""), pods.pod_key(p)))


def limits_gpu_memory(pod: Pod) -> bool:
    """True when a container or init container of the pod limits `aliyun.com/gpu-mem` to more than zero (pure).

    Kubernetes requires a limit for every extended resource a container requests, so a pod that asks for GPU
    memory at all has it here; one that does not is no GPU pod, whatever its annotations say.
    """
    spec = pod.get("spec") or {}
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or []:
            limit = ((container.get("resources") or {}).get("limits") or {}).get(RESOURCE_MEM)
            try:
                if limit is not None and parse_quantity(limit, RESOURCE_MEM) > 0:
                    return True
            except DemandError:
                continue  # unreadable: `parse_pod` names the problem if another container asks for memory
    return False


def _requested(demand: PodDemand) -> tuple[ContainerDemand, ...]:
    return (*demand.init_containers, *demand.containers)


def _describe(c: ContainerDemand) -> str:
    gpus = f" on each of {c.count} GPUs" if c.count > 1 else ""
    return f"{c.kind} {c.name}: {c.memory_mib} MiB and {c.compute}% compute{gpus}"


def _check_shape(demand: PodDemand, parts: list[AllocationPart]) -> None:
    """Refuse a recorded allocation whose parts are not exactly what the pod requests (pure): per container, as
    many parts as it asks GPUs, on distinct GPUs, each with its memory and compute per GPU, and nothing else."""
    for c in _requested(demand):
        mine = [p for p in parts if (p.container, p.container_index, p.init) == (c.name, c.index, c.init)]
        if (
            len(mine) != c.count
            or len({p.gpu_uuid for p in mine}) != c.count
            or any((p.memory_mib, p.compute, p.sidecar) != (c.memory_mib, c.compute, c.sidecar) for p in mine)
        ):
            held = ", ".join(f"{p.memory_mib} MiB/{p.compute}% on GPU {p.gpu_index}" for p in mine) or "nothing"
            raise AdoptionError(
                "shape", f"its {ALLOCATION} annotation records {held} for what it requests ({_describe(c)})"
            )
    known = {(c.name, c.index, c.init) for c in _requested(demand)}
    extra = sorted({p.container for p in parts if (p.container, p.container_index, p.init) not in known})
    if extra:
        raise AdoptionError(
            "shape", f"its {ALLOCATION} annotation records shares for {', '.join(extra)}, which request none"
        )


def adoption_request(pod: Pod, gpus_on_node: dict[int, tuple[str, int]], unit: MemoryUnit) -> ReservationRequest:
    """The reservation that records a bound pod's share: what the pod requests, on the GPU(s) its annotations
    name (pure). Raises `AdoptionError` when the pod requests no GPU memory, its request cannot be read, or the
    annotations name GPUs the node does not have or another shape than the request."""
    meta = pods.metadata(pod)
    node = pods.node_name(pod)
    kind, owner_name = pods.owner(pod)
    ann = pods.annotations(pod)
    base: dict[str, Any] = {
        "pod_uid": pods.pod_uid(pod),
        "namespace": str(meta.get("namespace") or ""),
        "pod_name": str(meta.get("name") or ""),
        "node": node,
        "owner_kind": kind,
        "owner_name": owner_name,
    }
    if not limits_gpu_memory(pod):
        raise AdoptionError(
            "no_request",
            f"it carries gpushare's allocation annotations but limits no {RESOURCE_MEM}: "
            "gpushare records only shares a pod requests",
        )
    try:
        demand = parse_pod(pod, unit)
    except DemandError as exc:
        raise AdoptionError("unreadable", f"its GPU request cannot be read: {exc}") from None
    if ALLOCATION in ann:
        try:
            allocation_id, annotated_node, annotated = parse_allocation(ann[ALLOCATION])
        except ValueError as exc:
            raise AdoptionError("unreadable", str(exc)) from None
        if annotated_node != node:
            raise AdoptionError("wrong_node", f"annotation names node {annotated_node} but the pod is on {node}")
        known = {gpu_uuid for gpu_uuid, _ in gpus_on_node.values()}
        unknown = sorted({p.gpu_uuid for p in annotated} - known)
        if unknown:
            raise AdoptionError("unknown_gpu", f"GPU(s) {', '.join(unknown)} are not on {node} in the ledger")
        _check_shape(demand, annotated)
        return ReservationRequest(parts=tuple(annotated), allocation_id=allocation_id, **base)

    raw_index = ann[GPU_MEM_IDX].strip()
    try:
        index = int(raw_index)
    except ValueError:
        raise AdoptionError("unreadable", f"{GPU_MEM_IDX}={raw_index!r} is not one GPU index") from None
    if index not in gpus_on_node:
        raise AdoptionError("unknown_gpu", f"no GPU with index {index} on {node} in the ledger")
    spanning = [c for c in _requested(demand) if c.count > 1]
    if spanning:
        raise AdoptionError(
            "shape", f"{GPU_MEM_IDX}={index} names one GPU but the pod requests {_describe(spanning[0])}"
        )
    gpu_uuid = gpus_on_node[index][0]
    parts = tuple(
        AllocationPart(
            container=c.name,
            container_index=c.index,
            gpu_uuid=gpu_uuid,
            gpu_index=index,
            memory_mib=c.memory_mib,
            compute=c.compute,
            init=c.init,
            sidecar=c.sidecar,
        )
        for c in _requested(demand)
    )
    return ReservationRequest(parts=parts, **base)


class Reconciler:
    """Compares the ledger with the cluster at start and every `interval_s`."""

    def __init__(
        self,
        ledger: Ledger,
        api: client.ApiClient,
        *,
        unit: MemoryUnit,
        metrics: BinderMetrics,
        grace_s: float = 30.0,
        rebind: Callable[[ReservedEvent], Awaitable[None]] | None = None,
        annotate: Callable[[uuid.UUID], Awaitable[object]] | None = None,
    ) -> None:
        self.ledger = ledger
        self.rebind = rebind
        self.annotate = annotate
        self.api = api
        self.unit = unit
        self.metrics = metrics
        self.grace_s = grace_s
        self.passes = 0

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """Reconcile now and then every `interval_s` until `stop` (a failed pass is logged and retried)."""
        while not stop.is_set():
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("reconciliation failed: %r; next pass in %.0fs", exc, interval_s)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass

    async def run_once(self) -> ReconcileReport:
        """One pass: release orphans, adopt unknown annotated pods, count conflicts."""
        started = time.monotonic()
        engine = self.ledger.engine
        live = await reads.live_allocations(engine)  # the ledger first, then the cluster (see module doc)
        all_pods, _ = await list_pods(self.api)
        gpu_pods = [p for p in all_pods if is_gpu_pod(p)]
        by_uid = {pods.pod_uid(p): p for p in all_pods}
        report = ReconcileReport()

        for orphan in find_orphans(live, by_uid, now=datetime.now(UTC), grace_s=self.grace_s):
            a = orphan.allocation
            if await self.ledger.release(a.id, a.pod_uid, a.node, orphan.reason):
                report.released += 1
                self.metrics.released.labels(reason="reconciled").inc()
                log.info(
                    "reconciliation released %s/%s on %s: %s",
                    a.namespace,
                    a.pod_name,
                    a.node,
                    orphan.reason,
                    extra={"namespace": a.namespace, "pod": a.pod_name, "node": a.node, "reason": orphan.reason},
                )

        for a in unmarked_terminating(live, by_uid):
            report.terminating += await self.ledger.mark_terminating(a.pod_uid)

        if self.annotate is not None:
            for a in stale_annotations(live, by_uid):
                try:
                    await self.annotate(a.id)
                    report.annotated += 1
                except Exception as exc:  # tried again next pass
                    log.warning("reconciliation could not annotate %s/%s: %r", a.namespace, a.pod_name, exc)

        if self.rebind is not None:
            for a in stale_reservations(live, by_uid, now=datetime.now(UTC), grace_s=self.grace_s):
                parts = await reads.reservation_parts(engine, a.id)
                event = ReservedEvent(
                    allocation_id=a.id,
                    pod_uid=a.pod_uid,
                    namespace=a.namespace,
                    pod_name=a.pod_name,
                    node=a.node,
                    parts=parts,
                    source="binder-reconcile",
                )
                try:
                    await self.rebind(event)
                    report.rebound += 1
                except Exception as exc:  # the consumer's redelivery will try again
                    log.warning("reconciliation could not bind %s/%s: %r", a.namespace, a.pod_name, exc)

        gpu_cache: dict[str, dict[int, tuple[str, int]]] = {}
        for pod in adoption_candidates(gpu_pods, {a.pod_uid for a in live}):
            await self._adopt(pod, gpu_cache, report)

        self.passes += 1
        self.metrics.reconciliations.inc()
        self.metrics.open_conflicts.set(len(report.conflicts))
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)
        log.log(
            logging.ERROR if report.conflicts else logging.INFO,
            "reconciliation: %d released, %d marked terminating, %d annotation(s) repaired, %d adopted, "
            "%d stale reservation(s) handled, %d conflict(s)",
            report.released,
            report.terminating,
            report.annotated,
            report.adopted,
            report.rebound,
            len(report.conflicts),
            extra={"released": report.released, "adopted": report.adopted, "conflicts": len(report.conflicts)},
        )
        return report

    async def _adopt(self, pod: Pod, gpu_cache: dict[str, dict[int, tuple[str, int]]], report: ReconcileReport) -> None:
        node = pods.node_name(pod)
        if node not in gpu_cache:
            gpu_cache[node] = await reads.gpus_by_index(self.ledger.engine, node)
        try:
            request = adoption_request(pod, gpu_cache[node], self.unit)
            if await reads.allocation_exists(self.ledger.engine, request.allocation_id):
                # the annotated allocation ended in the ledger (e.g. failed) but the pod runs: record it anew
                request = dataclasses.replace(request, allocation_id=uuid.uuid4())
            result = await self.ledger.reserve(request)
        except AdoptionError as exc:
            self._conflict(pod, exc.kind, str(exc), report)
            return
        except InsufficientCapacity as exc:
            self._conflict(pod, "capacity", f"GPU {exc.gpu_uuid} cannot hold it: {exc}", report)
            return
        except QuotaExceeded as exc:
            self._conflict(pod, "quota", str(exc), report)
            return
        except ReservationError as exc:
            self._conflict(pod, "ledger", str(exc), report)
            return
        if not result.created:
            return  # the pod got its allocation meanwhile (bound by us since the snapshot)
        await self.ledger.mark_bound(result.allocation_id, result.pod_uid, result.node)
        if pods.is_terminating(pod):
            report.terminating += await self.ledger.mark_terminating(result.pod_uid)
        report.adopted += 1
        self.metrics.adopted.inc()
        log.warning(
            "adopted %s on %s into the ledger (%d MiB)",
            pods.pod_key(pod),
            node,
            sum(p.memory_mib for p in result.parts),
            extra={"pod": pods.pod_key(pod), "node": node, "allocation_id": str(result.allocation_id)},
        )

    def _conflict(self, pod: Pod, kind: str, message: str, report: ReconcileReport) -> None:
        report.conflicts.append(f"{pods.pod_key(pod)}: {message}")
        self.metrics.conflicts.labels(reason=kind).inc()
        log.error(
            "CONFLICT: pod %s on %s claims GPU shares the ledger cannot record: %s",
            pods.pod_key(pod),
            pods.node_name(pod),
            message,
            extra={"pod": pods.pod_key(pod), "node": pods.node_name(pod), "reason": kind},
        )
