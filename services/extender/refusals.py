"""Refused events: when filter leaves a pod no node, say why on the bus (at most once per pod every 10 s)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from shared.events.bus import EventBus
from shared.events.catalogue import RefusedEvent
from shared.placement import PodDemand

log = logging.getLogger(__name__)

REFUSAL_THROTTLE_S = 10.0


class RefusalPublisher:
    """Publishes `RefusedEvent`s for accounting, throttled per pod UID (the last `size` pods remembered)."""

    def __init__(self, bus: EventBus | None, *, size: int = 10_000) -> None:
        self.bus = bus
        self.size = size
        self._refused_at: OrderedDict[str, float] = OrderedDict()

    async def publish(self, demand: PodDemand, quota_reason: str | None, reasons: dict[str, str]) -> None:
        """Explain why no node is left for the pod (never raises: a refusal must not fail the filter call)."""
        if self.bus is None or not demand.uid:
            return
        now = time.monotonic()
        last = self._refused_at.get(demand.uid)
        if last is not None and now - last < REFUSAL_THROTTLE_S:
            return
        self._refused_at[demand.uid] = now
        self._refused_at.move_to_end(demand.uid)
        while len(self._refused_at) > self.size:
            self._refused_at.popitem(last=False)
        if quota_reason:
            summary = quota_reason
        elif not reasons:
            summary = "no candidate node was offered"
        else:
            summary = f"no node can hold the pod's GPU request ({len(reasons)} node(s) refused)"
        short = {k[:253]: v[:2048] for k, v in list(sorted(reasons.items()))[:256]}
        try:
            event = RefusedEvent(
                pod_uid=demand.uid[:253],
                namespace=demand.namespace[:253],
                pod_name=(demand.name or demand.uid)[:253],
                summary=summary[:2048],
                reasons=short,
                source="extender",
            )
            await self.bus.publish(event)
        except Exception as exc:  # explaining a refusal must never fail the filter call
            log.warning("could not publish a refusal: %s", exc)
