"""Following pods and nodes: give GPU shares back as soon as a pod ends, retire deleted nodes.

A pod ends when its object is deleted or it reaches phase Succeeded/Failed, never at its deletionTimestamp:
a terminating pod's containers may hold GPU memory for the whole grace period (or for ever, when the pod is
stuck Terminating), and kube-scheduler keeps counting it too. Its allocation is only marked terminating
(`Ledger.mark_terminating`), so that inspect and the pending views can say who holds a GPU on the way out.

Only pods that can hold GPU shares matter (they carry `gpushare.io/allocation` or gpushare's
`ALIYUN_COM_GPU_MEM_IDX`, or request an `aliyun.com/` resource); all others are dropped before any I/O, but for
pods with DRA claims not annotated yet: those go to the claim gate (which marks them bound), and their shares end
with their claims until their annotations come (services/binder/claims.py).
A release is a no-op in the ledger when the pod has no live allocation, so a repeated event is harmless;
a small memory of recently released (and marked) UIDs spares the database the repeats of a pod's updates.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from kubernetes_asyncio import client

from services.binder import reads
from services.binder.metrics import BinderMetrics
from services.binder.nudge import CapacityNudger
from services.binder.pod_index import PodIndex, binder_index, has_claims
from shared.annotations import ALLOCATION, GPU_MEM_IDX
from shared.dra import CLAIM_ANNOTATION
from shared.kube import pods
from shared.kube.pods import Pod
from shared.kube.watching import DELETED, SYNCED, WatchEvent, watch_objects
from shared.ledger.ledger import Ledger

log = logging.getLogger(__name__)

REMEMBERED_RELEASES = 10_000


def is_gpu_pod(pod: Pod) -> bool:
    """True when the pod may hold GPU shares (annotated by us or by gpushare, or asks for aliyun.com/*)."""
    ann = pods.annotations(pod)
    return ALLOCATION in ann or GPU_MEM_IDX in ann or pods.requests_resource_prefix(pod, "aliyun.com/")


def release_reason(event_type: str, pod: Pod) -> str | None:
    """Why a pod's allocation should end now (pure), or None while its containers may still run.

    A terminating pod (deletionTimestamp set, phase still Pending/Running) keeps its share.
    """
    if event_type == DELETED:
        return "pod deleted"
    if pods.is_terminated(pod):
        return f"pod {pods.phase(pod).lower()}"
    return None


class Lifecycle:
    """Pod and node watches that release allocations and retire nodes."""

    def __init__(
        self, ledger: Ledger, api: client.ApiClient, *, metrics: BinderMetrics, index: PodIndex | None = None
    ) -> None:
        self.ledger = ledger
        self.index = index if index is not None else binder_index()
        self.api = api
        self.metrics = metrics
        self.nudger = CapacityNudger(api)
        self.pods_synced = asyncio.Event()
        self.nodes_synced = asyncio.Event()
        self._released: OrderedDict[str, None] = OrderedDict()
        self._marked: OrderedDict[str, None] = OrderedDict()
        self.claims: Any = None  # the ClaimGate: marks DRA pods bound once kube-scheduler bound them
        self.dra_pending: Any = None  # DraPending: why the DRA pods gpushare admission rewrote are not placed
        self.templates: Any = None  # TemplateSweeper: which gpushare claim templates live pods use

    async def watch_pods(self, stop: asyncio.Event) -> None:
        """Follow every pod in the cluster until `stop`."""
        core = client.CoreV1Api(self.api)
        async for event in watch_objects(core.list_pod_for_all_namespaces, what="pods", stop=stop):
            if event.type == SYNCED:
                self.index.synced()
                self.pods_synced.set()
                if self.templates is not None:
                    self.templates.synced.set()
                continue
            try:
                await self.on_pod(event)
            except Exception as exc:  # the ledger may be briefly away; reconciliation catches up
                log.warning("could not process a %s pod event for %s: %r", event.type, pods.pod_key(event.object), exc)

    async def watch_nodes(self, stop: asyncio.Event) -> None:
        """Follow every node until `stop`."""
        core = client.CoreV1Api(self.api)
        async for event in watch_objects(core.list_node, what="nodes", stop=stop):
            if event.type == SYNCED:
                self.nodes_synced.set()
                continue
            try:
                await self.on_node(event)
            except Exception as exc:
                log.warning("could not process a %s node event: %r", event.type, exc)

    async def on_pod(self, event: WatchEvent) -> int:
        """Release the pod's allocation if it ended; returns how many allocations ended."""
        pod = event.object
        if self.dra_pending is not None:
            await self.dra_pending.on_pod(event.type, pod)
        if self.templates is not None:
            await self.templates.on_pod(event.type, pod)
        annotated = is_gpu_pod(pod)
        if not annotated and (self.claims is None or not has_claims(pod)):
            return 0
        self.index.update(event.type, pod)
        uid = pods.pod_uid(pod)
        claim_uid = pods.annotations(pod).get(CLAIM_ANNOTATION)
        if self.claims is not None:
            await self.claims.on_pod(event.type, pod)
            if not annotated:  # a DRA pod before its annotations: only one whose claim the gate recorded
                claim_uid = self.claims.claim_of(uid)
                if claim_uid is None:
                    return 0
        reason = release_reason(event.type, pod)
        if not uid or uid in self._released:
            return 0
        if reason is None:
            if pods.is_terminating(pod) and uid not in self._marked:
                await self._mark_terminating(pod, uid)
            return 0
        if self.claims is not None and self.claims.ended_with_claim(uid):
            self._remember(self._released, uid)  # its claim's deallocation ended its allocation: nothing to read
            return 0
        released = await self._release(uid, reason)
        self._remember(self._released, uid)
        if claim_uid and self.claims is not None:
            self.claims.released_with_pod(claim_uid)
        if released and not claim_uid:  # kube-scheduler requeues DRA pods itself when a claim is deallocated
            self.nudger.capacity_freed(pods.node_name(pod) or "")
        if released:
            self.metrics.released.labels(reason=reason.replace(" ", "_")).inc(released)
            log.info(
                "released %d allocation(s) of %s: %s",
                released,
                pods.pod_key(pod),
                reason,
                extra={"pod": pods.pod_key(pod), "pod_uid": uid, "reason": reason},
            )
        return released

    async def _release(self, uid: str, reason: str) -> int:
        """Release the pod's live allocation: the one its claim's record made, when the claim gate knows it, with no
        lookup (a pod holds at most one live allocation); else (or when that one had ended already) whatever the
        ledger holds for the pod."""
        known = self.claims.recorded(uid) if self.claims is not None else None
        if known is not None and await self.ledger.release(known[0], uid, known[1], reason):
            return 1
        return await self.ledger.release_pod(uid, reason)

    async def on_node(self, event: WatchEvent) -> int:
        """Retire a deleted node in the ledger; returns how many allocations ended."""
        if event.type != DELETED:
            return 0
        name = str((event.object.get("metadata") or {}).get("name") or "")
        if not name or not await reads.active_node(self.ledger.engine, name):
            return 0
        released = await self.ledger.retire_node(name, "node deleted")
        self.metrics.nodes_retired.inc()
        if released:
            self.metrics.released.labels(reason="node_deleted").inc(released)
        log.warning(
            "node %s deleted: retired its GPUs, released %d allocation(s)", name, released, extra={"node": name}
        )
        return released

    async def _mark_terminating(self, pod: Pod, uid: str) -> None:
        marked = await self.ledger.mark_terminating(uid)
        self._remember(self._marked, uid)
        if marked:
            self.metrics.terminating.inc(marked)
            log.info(
                "%s is terminating: its GPU share stays held until the pod is gone",
                pods.pod_key(pod),
                extra={"pod": pods.pod_key(pod), "pod_uid": uid, "node": pods.node_name(pod)},
            )

    @staticmethod
    def _remember(memory: OrderedDict[str, None], uid: str) -> None:
        memory[uid] = None
        while len(memory) > REMEMBERED_RELEASES:
            memory.popitem(last=False)
