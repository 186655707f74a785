"""Scheduling wait: how long each GPU pod waited from its creation until it was bound, read from the pod itself.

A pod's wait is its `metadata.creationTimestamp` to the `lastTransitionTime` of its `PodScheduled` condition once
that is True (kube-apiserver sets it when it accepts the Binding: pkg/registry/core/pod/storage/storage.go,
`UpdatePodCondition` with PodScheduled True, `LastTransitionTime = metav1.Now()`), so accounting measures nothing
itself and a restart loses nothing: pods still pending keep their creation time, and pods bound while accounting
was away are found by the next listing. Kubernetes writes both timestamps in whole seconds, so a wait is known to
the second (a pod bound within its first second waited 0 s).

Every GPU pod (one asking for an `aliyun.com/` resource) that kube-scheduler binds is observed once, with outcome
`bound`; one deleted before it was bound, with outcome `deleted` (wait until its `deletionTimestamp`, or until the
deletion was seen). Pods created with `spec.nodeName` (no PodScheduled condition) were never scheduled and are
left out. "Once" holds across restarts and replicas: each observation claims the pod in `applied_events`
(consumer `accounting-scheduling`, pruned after the dedupe horizon), and a listing only considers pods bound
within that horizon. Pending pods' creation times are kept in memory for `/v1/pending` and the dashboard, with
kube-scheduler's own verdict on each: the `PodScheduled` condition it writes False when a scheduling attempt fails
(`handleSchedulingFailure` -> `updatePod` in pkg/scheduler/schedule_one.go: reason `Unschedulable`, or
`SchedulerError`, and the FailedScheduling message), which names what its own filters refused (`Insufficient
aliyun.com/gpu-mem` for a node short of GPU memory in total, which the extender never sees) as well as what the
extender said.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes_asyncio import client
from sqlalchemy import bindparam, func, literal, select
from sqlalchemy.dialects.postgresql import ARRAY, UUID, insert
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.kube import pods
from shared.kube.pods import Pod, parse_time, scheduled_at
from shared.kube.watching import DELETED, SYNCED, WatchEvent, watch_objects
from shared.ledger.models import applied_events

log = logging.getLogger(__name__)

CONSUMER = "accounting-scheduling"
BOUND = "bound"
DELETED_UNBOUND = "deleted"
OUTCOMES = (BOUND, DELETED_UNBOUND)
WAIT_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600)
_IDS = uuid.UUID("3c8f5f0e-2f7d-4c1e-9d7a-6a4f0c1b2e93")
LINGER_S = 0.25
MAX_BACKLOG = 100_000


def created_at(pod: Pod) -> datetime | None:
    """The pod's `metadata.creationTimestamp`."""
    return parse_time(pods.metadata(pod).get("creationTimestamp"))


MAX_MESSAGE = 4096


@dataclass(frozen=True)
class SchedulerVerdict:
    """Why kube-scheduler's latest attempt did not place a pod: its `PodScheduled` condition (status False)."""

    reason: str  # Unschedulable or SchedulerError
    message: str  # kube-scheduler's FailedScheduling message (cut at MAX_MESSAGE characters, marked so)
    since: datetime | None  # the condition's lastTransitionTime: when the pod first became unschedulable

    @property
    def short_of_gpu(self) -> bool:
        """Whether its own filters found some node short of a gpushare resource in total (NodeResourcesFit)."""
        return "Insufficient aliyun.com/" in self.message

    def as_dict(self) -> dict[str, Any]:
        """The verdict as `/v1/pending` shows it."""
        return {
            "reason": self.reason,
            "message": self.message,
            "since": self.since.isoformat() if self.since else None,
        }


def scheduler_verdict(pod: Pod) -> SchedulerVerdict | None:
    """kube-scheduler's verdict on an unbound pod, or None when it has not refused it (not tried yet, gated, bound)."""
    condition = pods.unplaced_condition(pod)
    if condition is None:
        return None
    message = str(condition.get("message") or condition.get("reason"))
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 15] + " ... (cut here)"
    # interned: pods refused alike (a Deployment's replicas) share one message
    verdict = SchedulerVerdict(
        str(condition["reason"]), sys.intern(message), parse_time(condition.get("lastTransitionTime"))
    )
    return verdict


def is_gpu_pod(pod: Pod) -> bool:
    """Whether the pod asks for one of gpushare's resources."""
    return pods.requests_resource_prefix(pod)


@dataclass(frozen=True)
class Waited:
    """A finished wait: the pod, how it ended (`bound` or `deleted`) and how long it took."""

    pod_uid: str
    namespace: str
    pod_name: str
    outcome: str
    seconds: float
    ended_at: datetime


def finished_wait(event_type: str, pod: Pod, now: datetime) -> Waited | None:
    """The wait a watch event finishes (pure): a GPU pod seen bound, or deleted while unbound; None otherwise."""
    created = created_at(pod)
    if created is None or not is_gpu_pod(pod):
        return None
    meta = pods.metadata(pod)
    bound = scheduled_at(pod)
    if bound is not None:
        outcome, ended = BOUND, bound
    elif event_type == DELETED and not pods.node_name(pod):
        outcome, ended = DELETED_UNBOUND, parse_time(meta.get("deletionTimestamp")) or now
    else:
        return None
    return Waited(
        pod_uid=pods.pod_uid(pod),
        namespace=str(meta.get("namespace") or ""),
        pod_name=str(meta.get("name") or ""),
        outcome=outcome,
        seconds=max((ended - created).total_seconds(), 0.0),
        ended_at=ended,
    )


@dataclass(frozen=True)
class Waiting:
    """A GPU pod not bound yet, since its creation, and kube-scheduler's verdict on it (None: none yet)."""

    namespace: str
    pod_name: str
    created_at: datetime
    verdict: SchedulerVerdict | None = None


def claim_id(pod_uid: str) -> uuid.UUID:
    """The id under which a pod's wait is claimed in `applied_events` (one per pod)."""
    return uuid.uuid5(_IDS, pod_uid)


class SchedulingWaits:
    """Follows every pod (list-then-watch), records each GPU pod's wait once in `observe(namespace, outcome,
    seconds)` and keeps the creation time of those still pending (`waiting`)."""

    def __init__(
        self,
        engine: AsyncEngine,
        observe: Callable[[str, str, float], None],
        *,
        horizon_s: float,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.engine = engine
        self.observe = observe
        self.horizon = timedelta(seconds=horizon_s)
        self.clock = clock
        self.pending: dict[str, Waiting] = {}
        self.observed: set[str] = set()  # live pods whose wait is recorded (by this or another replica)
        self.synced = asyncio.Event()
        self._listed: set[str] = set()
        self._todo: dict[str, Waited] = {}
        self._kick = asyncio.Event()

    def waiting(self, pod_uid: str) -> tuple[datetime, float] | None:
        """(creation time, seconds waited so far) of a pending GPU pod; None when it is not known to wait."""
        w = self.pending.get(pod_uid)
        if w is None:
            return None
        return w.created_at, max((self.clock() - w.created_at).total_seconds(), 0.0)

    def refused(self, namespace: str | None = None) -> dict[str, Waiting]:
        """Pending GPU pods kube-scheduler has refused (by UID), in one namespace or all."""
        return {
            uid: w
            for uid, w in list(self.pending.items())
            if w.verdict is not None and (namespace is None or w.namespace == namespace)
        }

    def handle(self, event: WatchEvent) -> None:
        """Apply one watch event (pure bookkeeping; finished waits are queued for `flush`)."""
        if event.type == SYNCED:
            self.pending = {uid: w for uid, w in self.pending.items() if uid in self._listed}
            self.observed &= self._listed
            self._listed = set()
            self.synced.set()
            return
        pod = event.object
        uid = pods.pod_uid(pod)
        if not uid:
            return
        self._listed.add(uid)
        done = finished_wait(event.type, pod, self.clock())
        if done is None:
            if event.type != DELETED and is_gpu_pod(pod) and not pods.node_name(pod):
                created = created_at(pod)
                meta = pods.metadata(pod)
                if created is not None:
                    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
                    self.pending[uid] = Waiting(namespace, name, created, scheduler_verdict(pod))
            else:
                self.pending.pop(uid, None)
            if event.type == DELETED:
                self.observed.discard(uid)
            return
        self.pending.pop(uid, None)
        if uid in self.observed:  # recorded already (a status update, a relist, its deletion once bound)
            if event.type == DELETED:
                self.observed.discard(uid)
            return
        if event.type != DELETED:
            self.observed.add(uid)
        if done.ended_at < self.clock() - self.horizon:
            return  # older than the claims remembered: it may have been counted before
        if len(self._todo) < MAX_BACKLOG:
            self._todo[uid] = done
            self._kick.set()

    async def flush(self) -> int:
        """Claim the queued waits in one statement and observe those no one claimed before; returns how many."""
        if not self._todo:
            return 0
        batch = dict(self._todo)
        ids = {claim_id(uid): w for uid, w in batch.items()}
        rows = select(literal(CONSUMER).label("consumer"), func.unnest(bindparam("ids", list(ids), ARRAY(UUID(True)))))
        async with self.engine.begin() as conn:
            result = await conn.execute(
                insert(applied_events)
                .from_select(["consumer", "event_id"], rows)
                .on_conflict_do_nothing()
                .returning(applied_events.c.event_id)
            )
            claimed = set(result.scalars())
        for uid in batch:
            self._todo.pop(uid, None)
        for claim, w in ids.items():
            if claim in claimed:
                self.observe(w.namespace, w.outcome, w.seconds)
        return len(claimed)

    async def run(self, api: client.ApiClient, stop: asyncio.Event) -> None:
        """Watch every pod until `stop`, flushing finished waits as they come (a database outage is waited out)."""
        flusher = asyncio.create_task(self._flush_loop(stop))
        try:
            core = client.CoreV1Api(api)
            async for event in watch_objects(core.list_pod_for_all_namespaces, what="pods", stop=stop):
                self.handle(event)
        finally:
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)

    async def _flush_loop(self, stop: asyncio.Event) -> None:
        backoff = 0.5
        while not stop.is_set():
            await self._kick.wait()
            await asyncio.sleep(LINGER_S)
            self._kick.clear()
            try:
                await self.flush()
                backoff = 0.5
            except Exception as exc:
                log.warning("could not record scheduling waits (%r); retrying in %.1fs", exc, backoff)
                self._kick.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
