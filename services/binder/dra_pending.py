"""Why a DRA pod is pending, for accounting's `/v1/pending` (a `refused` event, as the extender publishes for its pods).

On DRA nodes no gpushare code places the pod: kube-scheduler's DynamicResources plugin does, and says why it cannot
in the pod's `PodScheduled` condition (`False`, reason `Unschedulable`, or `SchedulerError` when PreBind failed, e.g.
the ledger refused the claim at the gate: `handleSchedulingFailure`, pkg/scheduler/schedule_one.go; it updates
the condition only when it changes). The binder's pod watch sees every pod; for the pods gpushare admission rewrote
(annotation `gpushare.io/dra-demand`) this publishes kube-scheduler's message as the pod's refusal whenever it
changes, and again every `REPUBLISH_S` while the pod waits (accounting hides refusals older than an hour), except
kube-scheduler's "ResourceClaim not created yet": a claim gpushare admission refused over the namespace's quota is
explained by the extender's refusal, which says why. A reservation of the pod (its claim recorded) clears it in
accounting, as for extender pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.dra.admission import DEMAND_ANNOTATION
from shared.events.bus import EventBus
from shared.events.catalogue import RefusedEvent
from shared.kube import pods
from shared.kube.watching import DELETED

log = logging.getLogger(__name__)

REPUBLISH_S = 600.0
# kube-scheduler's word for a pod whose claim the resourceclaim controller has not made (`resourceclaim.Name`,
# dynamic-resource-allocation@v0.37.2): when gpushare admission refused the claim over its namespace's quota, that
# refusal (published by the extender) says more, so this one is not published over it
CLAIM_NOT_CREATED = "ResourceClaim not created yet"


def scheduling_refusal(pod: dict[str, Any]) -> str | None:
    """kube-scheduler's reason why an unbound pod is not placed (None while it is not refused or is bound)."""
    condition = pods.unplaced_condition(pod)
    return None if condition is None else str(condition.get("message") or condition.get("reason"))


@dataclass
class _Waiting:
    namespace: str
    name: str
    summary: str
    published_at: float


class DraPending:
    """Publishes refusals of the DRA pods gpushare admission rewrote (the last `size` waiting pods remembered)."""

    def __init__(self, bus: EventBus | None, *, size: int = 10_000, clock: Callable[[], float] = time.monotonic):
        self.bus = bus
        self.size = size
        self.clock = clock
        self.waiting: OrderedDict[str, _Waiting] = OrderedDict()

    async def on_pod(self, event_type: str, pod: dict[str, Any]) -> bool:
        """Follow one pod event; returns whether a refusal was published."""
        if DEMAND_ANNOTATION not in pods.annotations(pod):
            return False
        uid = pods.pod_uid(pod)
        summary = None if event_type == DELETED else scheduling_refusal(pod)
        if summary is not None and CLAIM_NOT_CREATED in summary:
            return False
        if summary is None:
            self.waiting.pop(uid, None)
            return False
        known = self.waiting.get(uid)
        if known is not None and known.summary == summary:
            return False
        meta = pods.metadata(pod)
        self.waiting[uid] = _Waiting(str(meta.get("namespace") or ""), str(meta.get("name") or ""), summary, 0.0)
        self.waiting.move_to_end(uid)
        while len(self.waiting) > self.size:
            self.waiting.popitem(last=False)
        return await self._publish(uid)

    async def republish(self) -> int:
        """Publish again the refusals of pods still waiting after REPUBLISH_S; returns how many."""
        now = self.clock()
        due = [uid for uid, w in self.waiting.items() if now - w.published_at >= REPUBLISH_S]
        return sum([await self._publish(uid) for uid in due])

    async def run(self, stop: asyncio.Event, period_s: float = 60.0) -> None:
        """Republish due refusals until `stop`."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)
            if not stop.is_set():
                await self.republish()

    async def _publish(self, uid: str) -> bool:
        waiting = self.waiting[uid]
        waiting.published_at = self.clock()
        if self.bus is None:
            return False
        try:
            await self.bus.publish(
                RefusedEvent(
                    pod_uid=uid[:253],
                    namespace=waiting.namespace[:253],
                    pod_name=waiting.name[:253],
                    summary=f"kube-scheduler (DRA): {waiting.summary}"[:2048],
                    source="binder",
                )
            )
        except Exception as exc:  # explaining a wait must never stop the pod watch
            log.warning("could not publish why %s/%s waits: %s", waiting.namespace, waiting.name, exc)
            return False
        return True
