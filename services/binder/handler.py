"""The consumer side of binding: one `reserved` event in, a Binding and a bound/failed ledger write out.

Order of effects, chosen so a crash or an error at any point leaves nothing stale:
1. read the allocation's state and the GPUs' memory in one query (skip unless `reserved`: duplicates and
   allocations the extender gave up on);
2. GET the pod and decide (`decide.py`): gone / replaced / bound elsewhere / terminating -> `mark_failed`;
   skipped on API servers that enforce the Binding's `metadata.uid` (1.23, 1.24, 1.27+; 1.20 does not);
3. POST the Binding with every annotation inside it (one API write: the annotations exist iff the pod is bound)
   and the pod UID; when the API server refuses it, GET the pod and decide as in 2 (already on the node ->
   mark bound);
4. `mark_bound`, committed together with the other binds in flight (group commit; the outbox publishes
   `bound`; the extender waits for it); the consumer acks after this.
A crash between 3 and 4 is repaired on redelivery: the GET (or the refused POST, then the GET) finds the pod
on the reserved node, so it is marked bound.
429/5xx/connection errors are retried with backoff, then raised so the message is redelivered later.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.binder import reads
from services.binder.decide import Action, Decision, binding_checks_uid, decide
from services.binder.metrics import BinderMetrics
from shared.annotations import binding_annotations
from shared.events.catalogue import Event, ReservedEvent
from shared.kube.binding import create_binding
from shared.kube.pod_index import PodIndex
from shared.kube.pods import get_pod
from shared.kube.raw import status_message
from shared.kube.retry import RetryPolicy, call_with_retry
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.rules import AllocationState
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

MAX_CONFLICT_ROUNDS = 3


class BindHandler:
    """Handles `reserved` events (idempotent; safe to run with concurrency)."""

    def __init__(
        self,
        ledger: Ledger,
        api: client.ApiClient,
        *,
        unit: MemoryUnit,
        metrics: BinderMetrics,
        retry: RetryPolicy = RetryPolicy(),
        pods: PodIndex | None = None,
    ) -> None:
        self.ledger = ledger
        self.pods = pods
        self.api = api
        self.unit = unit
        self.metrics = metrics
        self.retry = retry
        self._locks: dict[uuid.UUID, tuple[asyncio.Lock, int]] = {}
        # None until asked: True when the API server refuses a Binding whose metadata.uid is not the pod's
        self.uid_precondition: bool | None = None
        # group commit: the ledger reads that open each binding, and the `bound` writes that close it, that arrive
        # while one is in flight go together in the next statement pair / transaction
        self.facts: GroupCommit[tuple[uuid.UUID, list[str]], reads.BindFacts] = GroupCommit(
            lambda asks: reads.bind_facts_many(ledger.engine, asks), what="bind_facts"
        )
        self.bound: GroupCommit[tuple[uuid.UUID, str, str], bool] = GroupCommit(ledger.mark_bound_many, what="bound")

    async def __call__(self, event: Event) -> None:
        if not isinstance(event, ReservedEvent):
            return
        key = event.allocation_id
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:  # a redelivery overlapping the first delivery waits, then sees `bound`
                await self._handle(event)
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def _kube(self, fn, what: str):  # type: ignore[no-untyped-def]
        return await call_with_retry(
            fn, policy=self.retry, what=what, on_retry=lambda _: self.metrics.kube_retries.inc()
        )

    async def _handle(self, event: ReservedEvent) -> None:
        started = time.monotonic()
        ns, name = event.namespace, event.pod_name
        gpu_uuids = sorted({p.gpu_uuid for p in event.parts})
        facts = await self.facts.submit((event.allocation_id, gpu_uuids))
        if facts.state != AllocationState.RESERVED:
            self._finish(decide(state=facts.state, pod=None, pod_uid=event.pod_uid, node=event.node), event, started)
            return
        bind = Decision(Action.BIND, "bound", f"binding to {event.node}")
        uid_checked = await self._binding_checks_uid()
        for _ in range(MAX_CONFLICT_ROUNDS):
            if not uid_checked:  # the API server would bind a same-named replacement: look first
                decision = await self._seen_or_read_and_decide(event)
                if decision.action is not Action.BIND:
                    await self._apply(decision, event, started)
                    return
            try:
                await self._kube(lambda: self._bind(event, facts.gpu_memory), f"bind {ns}/{name} to {event.node}")
            except ApiException as exc:
                if exc.status == 404:
                    await self._apply(Decision(Action.FAIL, "failed_pod_gone", "pod no longer exists"), event, started)
                    return
                log.info("binding %s/%s refused (%s: %s); reading the pod", ns, name, exc.status, status_message(exc))
                decision = await self._read_and_decide(event)
                if decision.action is not Action.BIND:
                    await self._apply(decision, event, started)
                    return
                if exc.status == 409:  # the pod still looks bindable: a passing conflict, try again
                    continue
                if exc.status in (400, 403, 422):
                    reason = f"API server refused the binding: {status_message(exc)}"
                    await self._apply(Decision(Action.FAIL, "failed_refused", reason), event, started)
                    return
                raise
            await self._apply(bind, event, started)
            return
        raise RuntimeError(f"binding {ns}/{name} kept conflicting; will retry on redelivery")

    async def _seen_or_read_and_decide(self, event: ReservedEvent) -> Decision:
        """Decide from the pod watch when it shows this very pod ready to bind, else from a fresh read."""
        seen = self.pods.get(event.namespace, event.pod_name) if self.pods is not None else None
        if seen is not None:
            decision = decide(state=AllocationState.RESERVED, pod=seen, pod_uid=event.pod_uid, node=event.node)
            if decision.action is Action.BIND:
                self.metrics.pod_reads_saved.inc()
                return decision
        return await self._read_and_decide(event)

    async def _read_and_decide(self, event: ReservedEvent) -> Decision:
        ns, name = event.namespace, event.pod_name
        pod = await self._kube(lambda: get_pod(self.api, ns, name), f"GET pod {ns}/{name}")
        return decide(state=AllocationState.RESERVED, pod=pod, pod_uid=event.pod_uid, node=event.node)

    async def _binding_checks_uid(self) -> bool:
        """Whether the API server enforces the Binding's `metadata.uid` (asked once; False when unknown)."""
        if self.uid_precondition is None:
            try:
                info = await client.VersionApi(self.api).get_code(_request_timeout=5)
                self.uid_precondition = binding_checks_uid(info.major, info.minor)
            except Exception as exc:  # not cached: asked again on the next reservation
                log.info("could not read the API server version (%r); reading each pod before binding it", exc)
                return False
            log.info(
                "API server %s.%s: %s",
                info.major,
                info.minor,
                "Binding first, pod read only on refusal"
                if self.uid_precondition
                else "it ignores the Binding's UID, so each pod is read before binding",
            )
        return self.uid_precondition

    async def _bind(self, event: ReservedEvent, memory: dict[str, int]) -> None:
        annotations = binding_annotations(event.allocation_id, event.node, list(event.parts), memory, self.unit)
        await create_binding(
            self.api, event.namespace, event.pod_name, event.node, uid=event.pod_uid, annotations=annotations
        )

    async def _apply(self, decision: Decision, event: ReservedEvent, started: float) -> None:
        if decision.action in (Action.BIND, Action.MARK_BOUND):
            await self.bound.submit((event.allocation_id, event.pod_uid, event.node))
        elif decision.action is Action.FAIL:
            await self.ledger.mark_failed(event.allocation_id, event.pod_uid, event.node, decision.reason)
        self._finish(decision, event, started)

    def _finish(self, decision: Decision, event: ReservedEvent, started: float) -> None:
        self.metrics.bindings.labels(reason=decision.outcome).inc()
        if decision.action is not Action.SKIP:
            self.metrics.bind_seconds.observe(time.monotonic() - started)
        level = logging.WARNING if decision.action is Action.FAIL else logging.INFO
        log.log(
            level,
            "%s/%s: %s (%s)",
            event.namespace,
            event.pod_name,
            decision.outcome,
            decision.reason,
            extra={
                "namespace": event.namespace,
                "pod": event.pod_name,
                "node": event.node,
                "allocation_id": str(event.allocation_id),
                "reason": decision.outcome,
            },
        )
