"""DRA claims in the ledger: every gpushare claim allocation kube-scheduler makes is recorded as it appears.

kube-scheduler's allocator places claim shares from the nodes' ResourceSlices and keeps every device within its
capacity; PreBind writes the claim's allocation and reservation, then the pod binds (pkg/scheduler/framework/
plugins/dynamicresources, v1.37.2). The binder follows every ResourceClaim (list-then-watch) and, for a claim
allocated on gpushare devices and reserved for a pod:

1. reads the claim with its pod as the ledger must record it (`shared.dra.claims.read_claim`);
2. records it with `Ledger.reserve_claim` (the reservation statements and CHECKs: capacity, no GPU of the
   device-plugin path; the namespace's GiB quota was taken when the claim was created, at admission), the
   `claim_reserved` event staged in the same transaction;
3. remembers the pod, so that the pod watch marks it `bound` (the claim's pod is read from the binder's pod watch,
   not from the API server). The pod's annotations (gpushare's `ALIYUN_COM_GPU_MEM_*`, `gpushare.io/allocation`,
   `gpushare.io/claim`) are written once, with the assigned flag, when the node agent has prepared the claim
   (services/binder/annotate.py): one pod update instead of two, each of which every pod watcher receives. They
   are written at the record instead on a gated pool, and when the record comes `LATE_RECORD_S` or more after the
   bind (kubelet may have been refused meanwhile; the pod's update makes it ask again).

The pod may be bound before step 2 ends: the node agent prepares no claim the ledger does not hold on its node
(services/node_agent/dra_prepare.py), so no container starts on an unrecorded share. A record the ledger refuses
should never happen (kube-scheduler kept the device within its capacity): it is counted and logged at once, tried
again with backoff, and when it lasts, an alert (an error log line and a Warning event on the pod).

**A gated pool** (nodes labelled `gpushare.io/dra-gate=ledger`) publishes the binding condition
`gpushare.io/LedgerReserved` and the failure condition `gpushare.io/LedgerRefused` on its devices, and
kube-scheduler copies them into the allocation's results. PreBind then waits for them (`isPodReadyForBinding`,
checked at once and then every 5 s), and the binder adds a step 4: `LedgerReserved=True` on each device, or
`LedgerRefused=True` with the ledger's reason (the scheduler clears the allocation and tries again; nothing was
written). Once such a pod binds, its node is nudged (`on_pod`).

A crash between any two steps is repaired by doing them again: the allocation id comes from the claim's UID and
share ids, so the ledger returns the allocation recorded before; annotations and conditions are idempotent. The
allocation ends when the claim loses its allocation or is deleted (failed while it was never bound, released
otherwise), when the pod ends (the pod watch, exactly as on device-plugin nodes), or by reconciliation: allocated
claims the ledger does not hold are recorded (adopted) and live claim allocations whose claim is gone or
allocated anew are ended. The pod watch marks an allocation `bound` once the scheduler bound its pod.

The binder remembers, per claim, what it last learnt the ledger holds (`Held`): a claim's later events that cannot
change anything (the claim created, a finalizer added or removed, a gated claim's own condition, the claim deleted
after its allocation ended) then cost no ledger query; benchmark 12 counted six or seven claim events per pod. What
it has not seen in this term (a claim first seen without an allocation) it takes to hold nothing: what changed
while nobody watched is found by the reconciliation after every (re)list, which reads the ledger and hands such
claims back to be checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from sqlalchemy import and_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.binder.metrics import BinderMetrics
from services.binder.reads import PodRecord, claim_record
from shared.annotations import ALLOCATION, binding_annotations, parse_allocation
from shared.dra import CLAIM_ANNOTATION, DEVICE_CLASS, RESERVED_CONDITION
from shared.dra.claims import (
    ClaimRefused,
    LedgerGpu,
    allocation_id,
    claim_key,
    our_results,
    pod_consumer,
    read_claim,
    requests_gpushare,
)
from shared.dra.conditions import FIELD_MANAGER, REFUSED, RESERVED, decided, status_apply
from shared.dra.slices import device_name
from shared.events.bus import EventBus
from shared.events.catalogue import EventDecodeError, QuotaEvent, decode_event
from shared.kube import pods
from shared.kube.events import event_body, post_pod_event
from shared.kube.pod_index import PodIndex
from shared.kube.pods import Pod
from shared.kube.raw import read_json
from shared.kube.retry import RetryPolicy, call_with_retry, describe_failure, is_retryable
from shared.kube.watching import ADDED, DELETED, SYNCED, watch_objects
from shared.ledger.claim_holds import end_holds, holds_older_than, quota_namespaces
from shared.ledger.claims import ClaimAllocationEnded, PathConflict
from shared.ledger.db import reading
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations, gpus
from shared.ledger.reservations import InsufficientCapacity, QuotaExceeded, ReservationError
from shared.ledger.rules import LIVE_STATE_VALUES, AllocationState
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

APPLY_PATCH = "application/apply-patch+yaml"
MAX_ATTEMPTS = 8
REMEMBERED_BOUND = 10_000


NODE_GPUS_TTL_S = 30.0
HOLD_GRACE_S = 60.0  # a quota hold this old whose claim is not listed belongs to a creation that failed
ALERT_AFTER_S = 5.0  # an unrecorded claim allocation that lasts this long is an alert (an event on its pod)
RETRY_FIRST_S = 0.25  # then doubled at each refusal, up to RETRY_MAX_S
RETRY_MAX_S = 30.0
# A record this long after its pod's bind is late: a node agent may have refused to prepare the claim meanwhile
# (it waits up to `--dra-ledger-wait`, 10 s by default, for the record), and kubelet asks again at the pod's next
# update, so a late record's annotations are written at once. On time, they are written once the share is assigned.
LATE_RECORD_S = 5.0
ASK_AGAIN_S = 5.0  # a throttled or unreachable API server is asked again this often whether it serves DRA
# A DRA pod's `bound` is marked in the background, and the marks of this long go in one transaction: kube-scheduler
# binds DRA pods one after another, so each mark was a transaction of its own, awaited by the binder's pod watch.
BOUND_LINGER_S = 0.1


CHECK = "check"  # a claim the gate must look up in the ledger (reconciliation found it there)
Held = uuid.UUID | str | None  # what the ledger holds for a claim, as the gate last learnt: an allocation, CHECK, none


@dataclass(frozen=True)
class LiveClaim:
    """A live DRA allocation as the ledger holds it."""

    id: uuid.UUID
    claim_uid: str
    pod_uid: str
    node: str
    state: str
    reserved_at: datetime


async def live_claim_allocations(engine: AsyncEngine, claim_uid: str | None = None) -> list[LiveClaim]:
    """Live allocations made from claims (of one claim, when given)."""
    query = select(
        allocations.c.id,
        allocations.c.claim_uid,
        allocations.c.pod_uid,
        allocations.c.node,
        allocations.c.state,
        allocations.c.reserved_at,
    ).where(and_(allocations.c.claim_uid.is_not(None), allocations.c.state.in_(LIVE_STATE_VALUES)))
    if claim_uid is not None:
        query = query.where(allocations.c.claim_uid == claim_uid)
    async with reading(engine) as conn:
        return [LiveClaim(*r) for r in (await conn.execute(query)).all()]


async def node_gpus(engine: AsyncEngine, node: str) -> dict[str, LedgerGpu]:
    """The node's GPUs in the ledger (not retired), by device name."""
    query = select(gpus.c.uuid, gpus.c.index, gpus.c.memory_mib, gpus.c.compute_units).where(
        and_(gpus.c.node == node, gpus.c.retired_at.is_(None))
    )
    async with reading(engine) as conn:
        rows = (await conn.execute(query)).all()
    return {device_name(r.uuid): LedgerGpu(r.uuid, int(r.index), int(r.memory_mib), int(r.compute_units)) for r in rows}


@dataclass
class Unrecorded:
    """A claim allocation the ledger refused to record (no gate): since when, how often, whether alerted."""

    first_at: float
    attempts: int = 0
    alerted: bool = False


def recorded_late(pod: Pod, now: float) -> bool:
    """True when the pod has been bound for LATE_RECORD_S or longer (by its PodScheduled condition, which the
    Binding sets; a bound pod without one counts as bound long ago) (pure; `now`: epoch seconds).

    Such a record comes after kubelet may have asked the node agent to prepare the claim and been refused: the
    annotations are then written at once, because a pod update is what makes kubelet try again."""
    if not pods.node_name(pod):
        return False
    since = pods.scheduled_at(pod)
    return since is None or now - since.timestamp() >= LATE_RECORD_S


def _bounded(memory: dict[Any, Any]) -> None:
    """Forget the oldest entries of a memory past REMEMBERED_BOUND (dicts keep insertion order)."""
    while len(memory) > REMEMBERED_BOUND:
        memory.pop(next(iter(memory)))


def is_gated(results: list[dict[str, Any]]) -> bool:
    """Whether kube-scheduler waits for the ledger's verdict on this allocation: a result of a gated pool's device
    carries the binding condition `gpushare.io/LedgerReserved` (copied from the slice into the allocation)."""
    return any(RESERVED_CONDITION in (r.get("bindingConditions") or []) for r in results)


def refusal_reason(exc: ReservationError) -> str:
    """The condition reason of a ledger refusal."""
    if isinstance(exc, QuotaExceeded):
        return "QuotaExceeded"
    if isinstance(exc, InsufficientCapacity):
        return "InsufficientCapacity"
    if isinstance(exc, PathConflict):
        return "PathConflict"
    return "LedgerRefused"


class ClaimGate:
    """Follows ResourceClaims; records gpushare allocations before their pods bind; ends them with their claims."""

    def __init__(
        self,
        ledger: Ledger,
        api: client.ApiClient,
        *,
        unit: MemoryUnit,
        metrics: BinderMetrics,
        retry: RetryPolicy = RetryPolicy(),
        concurrency: int = 16,
        pods: PodIndex | None = None,
    ) -> None:
        self.ledger = ledger
        self.pods = pods  # the binder's pod watch (pod summaries with their claim fields): no GET before a record
        self.api = api
        self.unit = unit
        self.metrics = metrics
        self.retry = retry
        self.resource = client.ResourceV1Api(api)
        self.core = client.CoreV1Api(api)
        self.synced = asyncio.Event()
        self.served: bool | None = None  # whether the API server serves resource.k8s.io/v1 (None: not asked yet)
        self.passes = 0
        self._slots = asyncio.Semaphore(concurrency)
        self._latest: dict[str, tuple[str, dict[str, Any], int]] = {}  # claim UID -> (event type, claim, attempt)
        self._running: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._bound: dict[str, None] = {}  # pods marked bound (or being marked)
        self._recorded: dict[str, tuple[uuid.UUID, str, str]] = {}  # pod UID -> (allocation, node, claim UID)
        self._ended: dict[str, None] = {}  # pods whose allocation this gate ended with its claim (and none since)
        self._held: dict[str, Held] = {}  # claim UID -> what the ledger holds for it (absent: seen without one)
        self._unrecorded: dict[str, Unrecorded] = {}  # claim UID -> an allocation the ledger refused (no gate)
        self._gated_pods: dict[str, bool] = {}  # pods recorded at a gated pool's gate, until bound (the node nudge)
        self._fresh: set[str] = set()  # claims created in this term (after the claim watch listed them all)
        self._quota_namespaces: set[str] = set()  # namespaces with a GPU quota (their claims may hold quota)
        self._node_gpus: dict[str, tuple[float, dict[str, LedgerGpu]]] = {}  # node -> (when read, its GPUs)
        # allocations recorded here in this term whose pods' annotations wait for `assigned` (`record_of`)
        self._records: dict[uuid.UUID, PodRecord] = {}
        # allocation -> (pod UID, node) of the claim allocations this gate recorded or found (facts that never change)
        self._owners: dict[uuid.UUID, tuple[str, str]] = {}
        # called with a node once a gated pod bound there (the binder's CapacityNudger): see `on_pod`
        self.nudge: Callable[[str], None] | None = None
        # nobody waits for a DRA pod's `bound` (kube-scheduler bound it): the marks linger to share transactions
        self.bound: GroupCommit[tuple[uuid.UUID, str, str, datetime], bool] = GroupCommit(
            lambda marks: ledger.mark_bound_many([m[:3] for m in marks], at=[m[3] for m in marks]),
            what="claim_bound",
            linger_s=BOUND_LINGER_S,
        )
        self.holds_ended: GroupCommit[str, bool] = GroupCommit(
            lambda uids: end_holds(ledger.engine, uids), what="claim_holds_ended"
        )

    # -- following claims ---------------------------------------------------------------------------------------
    async def watch(self, stop: asyncio.Event) -> None:
        """Follow every ResourceClaim until `stop`; after each (re)list the ledger is reconciled with the claims
        (claims deleted while no watch was open are not reported by the watch). Without `resource.k8s.io/v1`
        (Kubernetes before 1.34, or DRA turned off) there is nothing to follow: the gate stays idle."""
        self._held.clear()  # a new term: another leader may have recorded or ended allocations meanwhile
        self._unrecorded.clear()
        self._fresh.clear()
        self.served = await self._ask_served(stop)
        if self.served is None:
            return  # stopped before the API server answered
        if not self.served:
            log.info(
                "the API server does not serve resource.k8s.io/v1: no DRA claims to gate (device-plugin path only)"
            )
            self.synced.set()
            await stop.wait()
            return
        async for event in watch_objects(
            self.resource.list_resource_claim_for_all_namespaces, what="resourceclaims", stop=stop
        ):
            if event.type == SYNCED:
                try:
                    await self.reconcile_once()
                except Exception as exc:  # the next relist or periodic pass tries again
                    log.warning("claim reconciliation failed: %r", exc)
                self.synced.set()
                continue
            claim = event.object
            uid = str((claim.get("metadata") or {}).get("uid") or "")
            if not (requests_gpushare(claim, DEVICE_CLASS) or our_results(claim) or uid in self._held):
                continue  # another driver's claim: nothing of it is gpushare's
            if event.type == DELETED:
                self._fresh.discard(uid)
            elif event.type == ADDED and self.synced.is_set():
                self._fresh.add(uid)  # created in this term: the ledger holds nothing of it but what it is told here
            if self._settled(event.type, claim, uid):
                continue
            self.submit(event.type, claim)

    def _settled(self, event_type: str, claim: dict[str, Any], uid: str) -> bool:
        """Whether handling this event could only find nothing to do: a claim with no allocation (or deleted) that
        holds nothing in the ledger as far as this term learnt, none of its events in hand, no refusal pending and
        no quota to give back. Most of a claim's events are such (created, a finalizer added or removed, deleted);
        they are settled here, without a task each."""
        if uid in self._running or uid in self._unrecorded or self._held.get(uid) is not None:
            return False
        if event_type == DELETED:
            if str((claim.get("metadata") or {}).get("namespace")) in self._quota_namespaces:
                return False  # the quota it took at creation comes back
            self._held.pop(uid, None)
            return True
        return not our_results(claim)

    async def _ask_served(self, stop: asyncio.Event) -> bool | None:
        """Whether there are claims to gate, asked until the API server answers (None: `stop` came first). A
        throttled or unreachable API server (429, 5xx, connection failures, past their retries) is asked again
        every ASK_AGAIN_S: it must not end the binder's term, and with it the binder (before: six 429s in a row at
        the start of a term stopped the binder)."""
        while not stop.is_set():
            try:
                return await self._kube(self._resource_api_served, "GET /apis/resource.k8s.io/v1")
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                log.warning(
                    "cannot tell yet whether the API server serves resource.k8s.io/v1 (%s); asking again in %.0fs",
                    describe_failure(exc),
                    ASK_AGAIN_S,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ASK_AGAIN_S)
        return None

    async def _resource_api_served(self) -> bool:
        """Whether there are claims to gate: resource.k8s.io/v1 served, and the binder allowed to list claims (a
        binder whose RBAC predates DRA says so once and keeps serving the device-plugin path)."""
        try:
            await read_json(await self.resource.get_api_resources(_preload_content=False))
            await read_json(await self.resource.list_resource_claim_for_all_namespaces(limit=1, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return False
            if exc.status == 403:
                log.error(
                    "the binder may not list resourceclaims: DRA claims are not gated, so pods on DRA nodes stay "
                    "Pending; grant the rules of k8s/base/rbac.yaml (gpushare-binder) and restart the binder"
                )
                return False
            raise
        return True

    def submit(self, event_type: str, claim: dict[str, Any], attempt: int = 0) -> None:
        """Handle a claim event; events of one claim are handled in order, the latest one wins."""
        uid = str((claim.get("metadata") or {}).get("uid") or "")
        if not uid:
            return
        self._latest[uid] = (event_type, claim, attempt)
        if uid not in self._running:
            self._running.add(uid)
            task = asyncio.create_task(self._drain(uid), name=f"claim-{uid}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drain(self, uid: str) -> None:
        try:
            while uid in self._latest:
                event_type, claim, attempt = self._latest.pop(uid)
                try:
                    async with self._slots:
                        if event_type == DELETED:
                            self._unrecorded.pop(uid, None)
                            await self.claim_ended(uid, "claim deleted", gone=True)
                            if str((claim.get("metadata") or {}).get("namespace")) in self._quota_namespaces:
                                await self.holds_ended.submit(uid)  # the quota it took at creation comes back
                        else:
                            await self.gate(claim)
                except Exception as exc:  # the ledger or the API is away: again later (reconciliation too)
                    log.warning("claim %s not handled yet: %r", claim_key(claim), exc, extra={"claim_uid": uid})
                    if attempt + 1 < MAX_ATTEMPTS and uid not in self._latest:
                        await asyncio.sleep(min(10.0, 0.2 * 2**attempt))
                        if uid not in self._latest:
                            self._latest[uid] = (event_type, claim, attempt + 1)
        finally:
            self._running.discard(uid)

    async def close(self) -> None:
        """Cancel claim handling in flight."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- recording ----------------------------------------------------------------------------------------------
    async def gate(self, claim: dict[str, Any]) -> str:
        """Bring the ledger (and, on a gated pool, the claim's status) to agree about one claim; returns what was
        done."""
        meta = claim.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        results = our_results(claim)
        if not results:
            self._unrecorded.pop(uid, None)
            return await self.claim_ended(uid, "claim deallocated")
        expected = allocation_id(uid, [str(r.get("shareID") or "") for r in results])
        gate = is_gated(results)
        verdict = decided(claim, results) if gate else None
        node = str(results[0].get("pool") or "")
        if self._held.get(uid) == expected and (verdict == RESERVED or not gate):  # recorded before, in this term
            await self._follow(claim, expected, node)
            return self._count("reserved_already")
        if uid in self._fresh and uid not in self._held:
            live = None  # created in this term and never recorded: the ledger holds nothing of it
        else:
            (live,) = (await live_claim_allocations(self.ledger.engine, uid)) or (None,)
        if live is not None and live.id != expected:  # allocated anew (after a refusal, a timeout, a new pod)
            await self._end(live, "claim allocated anew")
            live = None
        self._held[uid] = live.id if live is not None else None
        if live is not None:
            self._own(live.id, live.pod_uid, live.node)
        if verdict == REFUSED:
            return self._count("refused_already")
        if live is not None and (verdict == RESERVED or not gate):
            self._unrecorded.pop(uid, None)
            await self._follow(claim, live.id, node)
            return self._count("reserved_already")
        try:
            consumer = pod_consumer(claim)
        except ClaimRefused as exc:
            return await self._refuse(claim, results, exc.reason, exc.message, gate=gate, lasting=True)
        if consumer is None:
            return self._count("waiting_for_pod")  # the scheduler writes allocation and reservation together
        pod = self._watched_pod(str(meta.get("namespace")), consumer)
        watched = pod is not None
        if pod is None:
            pod = await self._get_pod(str(meta.get("namespace")), consumer)
            if pod is None:
                return self._count("pod_gone")
        gpus_of_node = await self._gpus_of(node)
        try:
            try:
                allocation = read_claim(claim, pod, gpus_of_node, self.unit)
            except ClaimRefused as exc:
                if exc.reason == "UnknownDevice":
                    gpus_of_node = await self._gpus_of(node, fresh=True)  # the node's inventory changed meanwhile
                elif watched:  # the watch's summary may trail the pod: read the pod itself
                    pod = await self._get_pod(str(meta.get("namespace")), consumer)
                    if pod is None:
                        return self._count("pod_gone")
                else:
                    raise
                allocation = read_claim(claim, pod, gpus_of_node, self.unit)
        except ClaimRefused as exc:
            return await self._refuse(claim, results, exc.reason, exc.message, gate=gate, lasting=True)
        started = time.monotonic()
        try:
            reservation = await self.ledger.reserve_claim(allocation.event(source="binder"))
            self._held[uid] = allocation.allocation_id
            self._own(allocation.allocation_id, allocation.pod_uid, node)
        except ClaimAllocationEnded as exc:
            log.warning("claim %s: %s", claim_key(claim), exc, extra={"claim_uid": uid})
            return self._count("ended_already")
        except ReservationError as exc:
            self._fresh.discard(uid)  # the next try asks the ledger what it holds
            return await self._refuse(claim, results, refusal_reason(exc), str(exc), gate=gate, lasting=False)
        earlier = self._unrecorded.pop(uid, None)
        now_pod = (self.pods.by_uid(allocation.pod_uid) if self.pods is not None else None) or pod
        memory = {g.uuid: g.memory_mib for g in gpus_of_node.values()}
        if gate or recorded_late(now_pod, time.time()):  # else written once, with the assigned flag (AnnotationSync)
            parts = list(allocation.parts)
            annotations = binding_annotations(allocation.allocation_id, node, parts, memory, self.unit)
            annotations[CLAIM_ANNOTATION] = uid
            await self._annotate(now_pod, annotations)
        if gate and verdict != RESERVED:
            self._gated_pods[allocation.pod_uid] = True
            _bounded(self._gated_pods)
            data = {
                s.device: {
                    "gpuUUID": s.gpu_uuid,
                    "gpuIndex": s.gpu_index,
                    "allocationID": str(allocation.allocation_id),
                }
                for s in allocation.shares
            }
            message = f"recorded in the gpushare ledger as allocation {allocation.allocation_id}"
            await self._apply_status(
                claim, status_apply(claim, results, reserved=True, reason="Recorded", message=message, data=data)
            )
        elif reservation.created:  # AnnotationSync writes it at `assigned` from this record, not a ledger read
            self._records[allocation.allocation_id] = claim_record(
                allocation.allocation_id,
                pod_uid=allocation.pod_uid,
                namespace=allocation.namespace,
                pod_name=allocation.pod_name,
                node=node,
                parts=allocation.parts,
                gpu_memory=memory,
                claim_uid=uid,
            )
            _bounded(self._records)
        # bound before the record reached it (no gate), or adopted after a restart; else the pod watch marks it
        self._remember_pod(allocation.pod_uid, allocation.allocation_id, node, uid)
        self._mark_if_bound(allocation.pod_uid, pod, recorded_now=True)
        self.metrics.bind_seconds.observe(time.monotonic() - started)
        log.info(
            "claim %s of %s/%s recorded on %s (%d MiB)%s%s",
            claim_key(claim),
            allocation.namespace,
            allocation.pod_name,
            node,
            allocation.pod_memory_mib(),
            "" if reservation.created else " (recorded before)",
            "" if earlier is None else f" after {earlier.attempts} refusal(s)",
            extra={
                "claim_uid": uid,
                "pod": f"{allocation.namespace}/{allocation.pod_name}",
                "node": node,
                "allocation_id": str(allocation.allocation_id),
                "gated": gate,
            },
        )
        return self._count("reserved" if reservation.created else "reserved_before")

    async def _gpus_of(self, node: str, *, fresh: bool = False) -> dict[str, LedgerGpu]:
        """The node's GPUs in the ledger, read at most every NODE_GPUS_TTL_S (an inventory changes seldom; the
        record's statements and CHECKs judge capacity anyway)."""
        cached = self._node_gpus.get(node)
        now = time.monotonic()
        if cached is None or fresh or now - cached[0] > NODE_GPUS_TTL_S:
            cached = self._node_gpus[node] = (now, await node_gpus(self.ledger.engine, node))
        return cached[1]

    async def follow_quotas(self, bus: EventBus, stop: asyncio.Event) -> None:
        """Keep the set of namespaces with a GPU quota (whose claims may hold quota at creation, `claim_holds`) as
        the quota events change it, until `stop`; each (re)list reads it whole again (`reconcile_once`)."""

        async def on_message(msg: Any) -> None:
            with contextlib.suppress(EventDecodeError):
                event = decode_event(msg.data)
                if isinstance(event, QuotaEvent):
                    if event.memory_mib is None and event.compute is None:
                        self._quota_namespaces.discard(event.namespace)
                    else:
                        self._quota_namespaces.add(event.namespace)

        sub = await bus.nc.subscribe(bus.names.subject("quota", ">"), cb=on_message)
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def released_with_pod(self, claim_uid: str) -> None:
        """The pod watch released the pod's allocation (the pod ended): the claim holds nothing in the ledger now,
        so its deallocation that follows costs no query."""
        if claim_uid in self._held:
            held = self._held[claim_uid]
            if isinstance(held, uuid.UUID):
                self._records.pop(held, None)
            self._held[claim_uid] = None

    def record_of(self, allocation_id: uuid.UUID) -> PodRecord | None:
        """The record of a claim allocation this gate recorded and has not seen end, once (None: read the ledger).

        The binder's AnnotationSync writes a DRA pod's annotations from it when the allocation is first `assigned`:
        the very record the ledger was just given (a claim's record has one version: it is never exchanged), so the
        ledger need not be read back. Taken once: a sync that must try again reads the ledger."""
        return self._records.pop(allocation_id, None)

    async def _refuse(
        self,
        claim: dict[str, Any],
        results: list[dict[str, Any]],
        reason: str,
        message: str,
        *,
        gate: bool,
        lasting: bool,
    ) -> str:
        """The ledger will not record the claim's allocation. On a gated pool: `LedgerRefused` on the claim's
        devices (kube-scheduler gives the allocation up and tries again; nothing was written). Without the gate the
        pod is bound or about to be: `_unrecorded` (an alert, and a new try)."""
        if not gate:
            return await self._unrecorded_claim(claim, reason, message, lasting=lasting)
        await self._apply_status(claim, status_apply(claim, results, reserved=False, reason=reason, message=message))
        log.warning(
            "claim %s refused by the ledger (%s): %s",
            claim_key(claim),
            reason,
            message,
            extra={"claim_uid": (claim.get("metadata") or {}).get("uid"), "reason": reason},
        )
        return self._count(f"refused_{reason}")

    async def _unrecorded_claim(self, claim: dict[str, Any], reason: str, message: str, *, lasting: bool) -> str:
        """kube-scheduler allocated the claim and the ledger refused to record it (it should never happen: the
        allocator keeps each device within its capacity; a release the ledger has not applied yet can make it
        happen for a moment). Counted and logged at once; tried again with backoff while the claim stays allocated
        (`lasting`: a claim shape that cannot change, tried again only at its next event); once it has lasted
        `ALERT_AFTER_S` (at once when `lasting`), an error log line and a Warning event on the pod say that its
        containers will not start (the node agent prepares no claim the ledger does not hold)."""
        meta = claim.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        now = time.monotonic()
        state = self._unrecorded.get(uid)
        if state is None:
            state = self._unrecorded[uid] = Unrecorded(first_at=now)
        state.attempts += 1
        self.metrics.claim_record_refusals.labels(reason=reason).inc()
        due = lasting or now - state.first_at >= ALERT_AFTER_S
        extra = {"claim_uid": uid, "reason": reason, "attempts": state.attempts}
        if due and not state.alerted:
            state.alerted = True
            log.error(
                "ALERT: claim %s is allocated by kube-scheduler but the gpushare ledger refuses to record it (%s): %s; "
                "its pod's containers will not start until it is recorded",
                claim_key(claim),
                reason,
                message,
                extra=extra,
            )
            await self._alert_pod(claim, reason, message)
        else:
            log.warning("claim %s not recorded yet (%s): %s", claim_key(claim), reason, message, extra=extra)
        if not lasting:
            delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (state.attempts - 1))
            task = asyncio.create_task(self._again(uid, claim, delay), name=f"claim-again-{uid}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return self._count(f"unrecorded_{reason}")

    async def _again(self, uid: str, claim: dict[str, Any], delay: float) -> None:
        """Try an unrecorded claim again after `delay`, unless it was recorded, deallocated or deleted meanwhile
        (a newer event of the claim is handled in its place)."""
        await asyncio.sleep(delay)
        if uid in self._unrecorded and uid not in self._latest and uid not in self._running:
            self.submit("MODIFIED", claim)

    async def _alert_pod(self, claim: dict[str, Any], reason: str, message: str) -> None:
        """A Warning event on the claim's pod: the allocation is not in the ledger, the containers will not start."""
        meta = claim.get("metadata") or {}
        consumers = (claim.get("status") or {}).get("reservedFor") or []
        pod = next((c for c in consumers if c.get("resource") == "pods"), None)
        if pod is None:
            return
        text = (
            f"kube-scheduler allocated claim {meta.get('name')}, but the gpushare ledger refuses to record it "
            f"({reason}): {message}. The node agent prepares no claim the ledger does not hold, so the containers "
            "wait; gpushare tries again (gpushare_binder_claim_record_refusals_total)"
        )
        body = event_body(
            str(meta.get("namespace") or ""),
            str(pod.get("name") or ""),
            str(pod.get("uid") or ""),
            reason="LedgerRefused",
            message=text,
            component="gpushare-binder",
        )
        await post_pod_event(self.api, body)

    async def claim_ended(self, claim_uid: str, reason: str, *, gone: bool = False) -> str:
        """The claim lost its allocation or is gone (`gone`): its live ledger allocation ends (if it has one)."""
        held = self._held.get(claim_uid)
        if gone:
            self._held.pop(claim_uid, None)
        if held is None:  # nothing recorded for it, as far as this term saw
            return "nothing"
        known = held if isinstance(held, uuid.UUID) else None
        owner = self._owners.get(known) if known is not None else None
        if known is not None and owner is not None and await self._end_known(known, owner[0], owner[1], reason):
            ended = 1  # the allocation the gate knows it holds, ended without a lookup
        else:  # not known here, or ended meanwhile (then whatever the claim holds now is looked up)
            ended = 0
            for live in await live_claim_allocations(self.ledger.engine, claim_uid):
                ended += await self._end(live, reason)
        if not gone:
            self._held[claim_uid] = None
        return self._count("ended") if ended else "nothing"

    async def _end(self, live: LiveClaim, reason: str) -> int:
        if live.state == AllocationState.RESERVED.value:  # the pod never bound: the reservation failed
            changed = await self.ledger.mark_failed(live.id, live.pod_uid, live.node, reason)
            ended = AllocationState.FAILED if changed else None
        else:
            changed = await self.ledger.release(live.id, live.pod_uid, live.node, reason)
            ended = AllocationState.RELEASED if changed else None
        self._ended_now(live.id, live.pod_uid, live.claim_uid, ended, reason)
        return int(changed)

    async def _end_known(self, allocation_id: uuid.UUID, pod_uid: str, node: str, reason: str) -> bool:
        """End the allocation this gate knows the claim holds, with no lookup (`Ledger.end_allocation`: failed while
        its pod never bound, released otherwise); False when it had ended meanwhile (the caller then looks up)."""
        ended = await self.ledger.end_allocation(allocation_id, pod_uid, node, reason)
        if ended is not None:
            self._ended_now(allocation_id, pod_uid, None, ended, reason)
        return ended is not None

    def _ended_now(
        self, allocation_id: uuid.UUID, pod_uid: str, claim_uid: str | None, ended: AllocationState | None, reason: str
    ) -> None:
        """What the gate learns when it ended a claim allocation (`ended`: its end state, None: someone else ended it
        before): the pod holds nothing live, and the allocation's record is not written on the pod."""
        self._records.pop(allocation_id, None)
        self._ended[pod_uid] = None
        _bounded(self._ended)
        if ended is None:
            return
        if ended is AllocationState.RELEASED:
            self.metrics.released.labels(reason=reason.replace(" ", "_")).inc()
        log.info(
            "allocation %s of claim %s ended (%s): %s",
            allocation_id,
            claim_uid or "-",
            ended.value,
            reason,
            extra={"claim_uid": claim_uid} if claim_uid else {},
        )

    # -- Kubernetes writes --------------------------------------------------------------------------------------
    async def _kube(self, fn, what: str):  # type: ignore[no-untyped-def]
        return await call_with_retry(
            fn, policy=self.retry, what=what, on_retry=lambda _: self.metrics.kube_retries.inc()
        )

    async def _annotate(self, pod: Pod, annotations: dict[str, str]) -> None:
        current = pods.annotations(pod)
        if current.get(ALLOCATION) == annotations[ALLOCATION] and current.get(CLAIM_ANNOTATION):
            return  # written before (the assigned flag may have moved on since)
        meta = pods.metadata(pod)
        body = {"metadata": {"annotations": annotations}}
        with contextlib.suppress(ApiException):  # a pod gone meanwhile: its claim is cleaned up with it
            await self._kube(
                lambda: self.core.patch_namespaced_pod(
                    meta.get("name"), meta.get("namespace"), body, _preload_content=False
                ),
                "PATCH pod annotations",
            )

    async def _apply_status(self, claim: dict[str, Any], body: dict[str, Any]) -> None:
        meta = claim.get("metadata") or {}
        try:
            await self._kube(
                lambda: self._patch_status(str(meta.get("name")), str(meta.get("namespace")), body),
                "apply claim status",
            )
        except ApiException as exc:
            if exc.status not in (404, 409, 422):
                raise
            # gone, or allocated anew meanwhile (the entry no longer matches a result): the next event decides
            log.info("claim %s status not written (%s): %s", claim_key(claim), exc.status, exc.body or exc.reason)

    async def _patch_status(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        resp = await self.resource.patch_namespaced_resource_claim_status(
            name,
            namespace,
            body,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type=APPLY_PATCH,
            _preload_content=False,
        )
        await read_json(resp)

    # -- pods ---------------------------------------------------------------------------------------------------
    def claim_of(self, pod_uid: str) -> str | None:
        """The claim whose allocation this gate recorded for the pod (in this term), or None."""
        recorded = self._recorded.get(pod_uid)
        return recorded[2] if recorded is not None else None

    def ended_with_claim(self, pod_uid: str) -> bool:
        """Whether this gate ended the pod's allocation with its claim and recorded none for it since: the pod then
        holds nothing live (a pod holds at most one live allocation), and the pod watch's release at the pod's end
        needs no query. A gate whose memory does not reach back that far says False (the query then runs)."""
        return pod_uid in self._ended

    def recorded(self, pod_uid: str) -> tuple[uuid.UUID, str] | None:
        """The claim allocation (and its node) this gate recorded or found for the pod, or None. It may have ended
        since: a caller that ends it and finds it ended already looks the pod's allocations up."""
        recorded = self._recorded.get(pod_uid)
        return (recorded[0], recorded[1]) if recorded is not None else None

    def _own(self, allocation_id: uuid.UUID, pod_uid: str, node: str) -> None:
        self._owners[allocation_id] = (pod_uid, node)
        _bounded(self._owners)

    def _remember_pod(self, pod_uid: str, allocation: uuid.UUID, node: str, claim_uid: str) -> None:
        self._ended.pop(pod_uid, None)
        self._recorded[pod_uid] = (allocation, node, claim_uid)
        _bounded(self._recorded)

    async def _follow(self, claim: dict[str, Any], allocation: uuid.UUID, node: str) -> None:
        """A claim the ledger holds: remember its pod, and mark it bound if the pod watch shows it bound (after a
        restart the pod may have bound while nobody watched)."""
        consumer = None
        with contextlib.suppress(ClaimRefused):
            consumer = pod_consumer(claim)
        if consumer is None:
            return
        pod_uid = str(consumer.get("uid") or "")
        if pod_uid in self._bound:
            return
        self._remember_pod(pod_uid, allocation, node, str((claim.get("metadata") or {}).get("uid") or ""))
        self._mark_if_bound(pod_uid, None)

    def _mark_if_bound(self, pod_uid: str, pod: Pod | None, *, recorded_now: bool = False) -> None:
        """Mark the pod's recorded allocation bound when the pod (as the watch shows it now, else `pod`) is bound
        on the allocation's node. Called right after `_remember_pod`, with no await between: the pod watch's
        `on_pod` marks any later bind. Once marked (or tried) it is not tried again, but right after a record
        (`recorded_now`): the pod watch may have tried before the ledger held the allocation (after a restart, an
        annotated pod whose allocation the ledger had lost)."""
        watched = self.pods.by_uid(pod_uid) if self.pods is not None else None
        current = watched if watched is not None else pod
        recorded = self._recorded.get(pod_uid)
        if current is None or recorded is None or pods.node_name(current) != recorded[1]:
            return
        if pod_uid in self._bound and not recorded_now:
            return
        self._mark_bound(pod_uid, recorded[0], recorded[1])

    def _mark_bound(self, pod_uid: str, allocation: uuid.UUID, node: str) -> bool:
        """Start marking the pod's allocation `bound` (in the background: `BOUND_LINGER_S`); True when started."""
        self._bound[pod_uid] = None
        _bounded(self._bound)
        task = asyncio.create_task(self._bound_now(pod_uid, allocation, node, datetime.now(UTC)), name="claim-bound")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _bound_now(self, pod_uid: str, allocation: uuid.UUID, node: str, seen: datetime) -> None:
        try:
            marked = await self.bound.submit((allocation, pod_uid, node, seen))
        except Exception as exc:  # the pod's next event tries again (reconciliation too)
            self._bound.pop(pod_uid, None)
            log.warning("allocation %s not marked bound yet: %r", allocation, exc, extra={"pod_uid": pod_uid})
            return
        if marked and self.nudge is not None and self._gated_pods.pop(pod_uid, False):
            self.nudge(node)

    def _watched_pod(self, namespace: str, consumer: dict[str, Any]) -> Pod | None:
        """The claim's pod as the binder's pod watch last showed it (with its claim fields), or None."""
        pod = self.pods.get(namespace, str(consumer.get("name") or "")) if self.pods is not None else None
        if pod is None or pods.pod_uid(pod) != consumer.get("uid") or "resourceClaims" not in (pod.get("spec") or {}):
            return None
        return pod

    async def _get_pod(self, namespace: str, consumer: dict[str, Any]) -> Pod | None:
        """The claim's pod read from the API server; None when it is gone (or another pod of that name)."""
        pod = await self._kube(lambda: pods.get_pod(self.api, namespace, str(consumer.get("name") or "")), "GET pod")
        return pod if pod is not None and pods.pod_uid(pod) == consumer.get("uid") else None

    async def on_pod(self, event_type: str, pod: Pod) -> bool:
        """The pod watch's hook: a DRA pod that kube-scheduler bound is marked `bound` in the ledger (True when the
        mark was started; it goes in the background, so the pod watch does not wait for it).

        A pod of a gated pool is then nudged (a label stamp, which makes kube-scheduler retry the pods waiting for
        DRA devices): while a pod waits in PreBind for its binding conditions, kube-scheduler 1.37.2 counts its
        claim's consumed capacity twice (the claim is still in flight and already in the informer's allocated state:
        `claimTracker.GatherAllocatedState`, in flight until PreBind returns), so pods placed meanwhile may have
        been found not to fit; no claim event requeues them once the first pod is bound."""
        ann = pods.annotations(pod)
        uid = pods.pod_uid(pod)
        node = pods.node_name(pod)
        if not node or event_type == DELETED or uid in self._bound:
            return False
        if CLAIM_ANNOTATION in ann:
            try:
                allocation, recorded_node, _ = parse_allocation(ann.get(ALLOCATION, ""))
            except ValueError:
                return False
        elif uid in self._recorded:  # recorded by this gate, not annotated yet
            allocation, recorded_node, _ = self._recorded[uid]
        else:
            return False
        if recorded_node != node:
            return False
        return self._mark_bound(uid, allocation, node)

    # -- reconciliation -----------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """Reconcile every `interval_s` (the watch reconciles at each relist too)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            if stop.is_set():
                return
            try:
                await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("claim reconciliation failed: %r; next pass in %.0fs", exc, interval_s)

    async def reconcile_once(self) -> None:
        """Read the ledger's live claim allocations and older quota holds, then list the claims, and make them
        agree."""
        if not self.served:
            return
        live = await live_claim_allocations(self.ledger.engine)
        self._quota_namespaces = await quota_namespaces(self.ledger.engine)
        holds = await holds_older_than(self.ledger.engine, HOLD_GRACE_S)
        body = await read_json(
            await self.resource.list_resource_claim_for_all_namespaces(_preload_content=False, _request_timeout=120)
        )
        claims = {str((c.get("metadata") or {}).get("uid")): c for c in body.get("items") or []}
        await self._reconcile_with(claims, live)
        stale = [uid for uid in holds if uid not in claims]
        if stale:
            await end_holds(self.ledger.engine, stale)
            log.info(
                "ended %d quota hold(s) of claims that do not exist (%s)",
                len(stale),
                ", ".join(f"{holds[u][0]}/{holds[u][1]}" for u in stale[:10]),
            )

    async def _reconcile_with(self, claims: dict[str, dict[str, Any]], live: list[LiveClaim]) -> None:
        """`live` was read before `claims` was listed: a live allocation whose claim is not listed is gone."""
        held = {a.claim_uid: a for a in live}
        for a in live:
            if a.claim_uid not in claims:
                self._held.pop(a.claim_uid, None)
                await self._end(a, "claim deleted")
        for uid, claim in claims.items():
            results = our_results(claim)
            if not results:
                if uid in held:
                    self._held[uid] = CHECK
                    self.submit("MODIFIED", claim)  # deallocated while nobody watched
                continue
            if not is_gated(results):
                if uid in held:  # recorded: later events of the claim cost no query
                    self._held.setdefault(uid, held[uid].id)
                else:
                    self._held[uid] = CHECK
                    self.submit("MODIFIED", claim)  # not recorded yet, or recorded in a ledger that lost it: adopt
                continue
            verdict = decided(claim, results)
            if verdict is None or (verdict == RESERVED and uid not in held):
                self._held[uid] = CHECK
                self.submit("MODIFIED", claim)  # not gated yet, or recorded in a ledger that lost it: adopt
        self.passes += 1

    def _count(self, outcome: str) -> str:
        self.metrics.claims.labels(reason=outcome).inc()
        return outcome
