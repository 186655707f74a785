"""Pod annotations follow the ledger: after an assignment or an exchange, both pods' records are rewritten.

The ledger is the source of every record; this consumer of the `assigned` and `exchanged` events (a durable
one, so a crash between the ledger write and the patch only delays the patch) reads the allocation's current
record and brings the pod's annotations to it: gpushare's `ALIYUN_COM_GPU_MEM_IDX` / `_DEV` / `_POD`, the
project's `gpushare.io/allocation` (with the allocation's version) and the assigned flag. A patch never puts an
older record over a newer one: it is skipped when the pod already carries the ledger's version or a later
one, and it is conditional on the pod's resourceVersion, so two binders cannot interleave a read and a write.
A DRA pod's annotations (with `gpushare.io/claim`) are first written here, in one patch with the assigned flag,
once its node agent prepared the claim (services/binder/claims.py says when they are written earlier).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.binder import reads
from services.binder.metrics import BinderMetrics
from services.binder.reads import PodRecord
from shared.annotations import ALLOCATION, GPU_MEM_ASSIGNED, GPU_MEM_ASSUME_TIME, record_annotations, record_version
from shared.dra import CLAIM_ANNOTATION
from shared.events.catalogue import AssignedEvent, Event, ExchangedEvent
from shared.kube import pods
from shared.kube.pod_index import PodIndex
from shared.kube.pods import Pod, get_pod
from shared.kube.raw import read_json
from shared.kube.retry import RetryPolicy, call_with_retry
from shared.ledger.rules import is_live
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

CONFLICT_ROUNDS = 5


def annotation_patch(record: PodRecord, current: dict[str, str], unit: MemoryUnit, now_ns: int) -> dict[str, str]:
    """The annotations to change so the pod tells the ledger's record (pure; empty: nothing to do).

    Nothing when the pod already carries a newer record than `record` (a later exchange was written first).
    """
    if record_version(current.get(ALLOCATION)) > record.version:
        return {}
    wanted = record_annotations(
        record.allocation_id, record.node, record.parts, record.gpu_memory, unit, version=record.version
    )
    if record.claim_uid:
        wanted[CLAIM_ANNOTATION] = record.claim_uid  # a DRA pod's annotations are first written here
    if record.assigned and current.get(GPU_MEM_ASSIGNED) != "true":
        wanted[GPU_MEM_ASSIGNED] = "true"
        wanted[GPU_MEM_ASSUME_TIME] = str(now_ns)
    return {key: value for key, value in wanted.items() if current.get(key) != value}


class AnnotationSync:
    """Handles `assigned` and `exchanged` events (idempotent: it writes the ledger's current record)."""

    def __init__(
        self,
        engine: object,
        api: client.ApiClient,
        *,
        unit: MemoryUnit,
        metrics: BinderMetrics,
        retry: RetryPolicy = RetryPolicy(),
        pods: PodIndex | None = None,
        recorded: Callable[[uuid.UUID], PodRecord | None] | None = None,
    ) -> None:
        self.engine = engine
        self.api = api
        self.unit = unit
        self.metrics = metrics
        self.retry = retry
        self.pods = pods  # the binder's pod watch: the pod as last seen, instead of a GET before the first patch
        # the claim gate's records of the claim allocations it just recorded (ClaimGate.record_of)
        self.recorded = recorded

    async def __call__(self, event: Event) -> None:
        if isinstance(event, AssignedEvent):
            if not await self.flag(event):
                known = self.recorded(event.allocation_id) if self.recorded is not None else None
                await self.sync(event.allocation_id, known.assigned_now() if known is not None else None)
        elif isinstance(event, ExchangedEvent):
            for allocation_id in dict.fromkeys((event.first_allocation_id, event.second_allocation_id)):
                await self.sync(allocation_id)

    async def sync(self, allocation_id: uuid.UUID, known: PodRecord | None = None) -> str:
        """Bring one pod's annotations to its allocation's record (`known`, else read from the ledger); returns what
        happened (the metric's reason)."""
        record = known if known is not None else await reads.pod_record(self.engine, allocation_id)  # type: ignore[arg-type]
        if record is None or not is_live(record.state):
            return self._count("skipped_ended")
        for attempt in range(CONFLICT_ROUNDS):
            pod = self._watched(record) if attempt == 0 else None
            if pod is None:
                pod = await self._kube(lambda: get_pod(self.api, record.namespace, record.pod_name), "GET pod")
                if pod is None or pods.pod_uid(pod) != record.pod_uid:
                    return self._count("skipped_pod_gone")
            patch = annotation_patch(record, pods.annotations(pod), self.unit, time.time_ns())
            if not patch:
                return self._count("up_to_date")
            # a claim's record has one version and is never exchanged: its first write needs no resourceVersion
            # (that conflicted with every other change of the pod around its start), only the pod's UID
            first_claim_write = bool(record.claim_uid) and ALLOCATION not in pods.annotations(pod)
            try:
                await self._kube(
                    functools.partial(self._patch, pod, patch, versioned=not first_claim_write), "PATCH pod annotations"
                )
            except ApiException as exc:
                if exc.status == 409 or (exc.status == 422 and first_claim_write):
                    continue  # the pod changed since it was read (or is another pod of that name): read, compare
                if exc.status == 404:
                    return self._count("skipped_pod_gone")
                raise
            log.info(
                "annotations of %s/%s follow the ledger (version %d): %s",
                record.namespace,
                record.pod_name,
                record.version,
                ", ".join(sorted(patch)),
                extra={"pod": f"{record.namespace}/{record.pod_name}", "allocation_id": str(allocation_id)},
            )
            return self._count("patched")
        raise RuntimeError(f"annotations of {record.namespace}/{record.pod_name} kept conflicting; will retry")

    async def flag(self, event: AssignedEvent) -> bool:
        """The assigned flag alone, from the pod as the binder's watch shows it, without reading the ledger: the
        event says the allocation was assigned, and the pod's record annotations are the `exchanged` events' to
        bring forward. Done (True): the pod carries the flag (now, or already); False: the pod is not watched, or it
        changed since the watch saw it (the patch conflicts), and `sync` reads ledger and pod."""
        pod = self.pods.by_uid(event.pod_uid) if self.pods is not None else None
        if pod is None or not pods.metadata(pod).get("resourceVersion") or ALLOCATION not in pods.annotations(pod):
            return False  # not watched, or a DRA pod whose record is not written yet: `sync` writes all of it
        if pods.annotations(pod).get(GPU_MEM_ASSIGNED) == "true":
            self._count("up_to_date")
            return True
        patch = {GPU_MEM_ASSIGNED: "true", GPU_MEM_ASSUME_TIME: str(time.time_ns())}
        try:
            await self._kube(lambda: self._patch(pod, patch), "PATCH pod annotations")
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        self._count("patched")
        return True

    def _watched(self, record: PodRecord) -> Pod | None:
        """The pod as the binder's watch last showed it, when that is this very pod. Its annotations can only be
        older than the pod's (the binder's writes move them forward): when they already tell the ledger's record,
        so does the pod; otherwise the patch is conditional on the resourceVersion seen, and a conflict reads the
        pod."""
        pod = self.pods.get(record.namespace, record.pod_name) if self.pods is not None else None
        if pod is None or pods.pod_uid(pod) != record.pod_uid or not pods.metadata(pod).get("resourceVersion"):
            return None
        return pod

    async def _patch(self, pod: Pod, patch: dict[str, str], *, versioned: bool = True) -> None:
        """Merge `patch` into the pod's annotations, on the resourceVersion seen (`versioned`) or on its UID only
        (a pod of that name with another UID refuses it: UID is immutable)."""
        meta = pods.metadata(pod)
        guard = {"resourceVersion": meta.get("resourceVersion")} if versioned else {"uid": meta.get("uid")}
        body = {"metadata": {**guard, "annotations": patch}}
        # raw JSON back: building the client's models of the whole pod cost more than the request itself
        await read_json(
            await client.CoreV1Api(self.api).patch_namespaced_pod(
                meta.get("name"), meta.get("namespace"), body, _preload_content=False
            )
        )

    async def _kube(self, fn, what: str):  # type: ignore[no-untyped-def]
        return await call_with_retry(
            fn, policy=self.retry, what=what, on_retry=lambda _: self.metrics.kube_retries.inc()
        )

    def _count(self, outcome: str) -> str:
        self.metrics.annotations.labels(reason=outcome).inc()
        return outcome
