"""The extender's wiring: one shared view, and each kube-scheduler verb in its own module over it.

| verb / duty | module |
|---|---|
| filter | `services.extender.filter` |
| prioritize | `services.extender.prioritize` |
| bind | `services.extender.bind` |
| preempt | `services.extender.preempt` |
| inspect | `services.extender.inspection` |
| pod specs for bind (from the Kubernetes API: a watch of unbound pods, else a GET) | `services.extender.pods` |
| the pods and PodDisruptionBudgets preempt needs (from the Kubernetes API) | `services.extender.victims` |
| bus events, reloads | `services.extender.resync` |
| refused events | `services.extender.refusals` |
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender.bind import Bind
from services.extender.filter import Filter
from services.extender.inspection import inspect
from services.extender.outcomes import OutcomeWaiter
from services.extender.pods import DEFAULT_MAX_BYTES, PodCache
from services.extender.preempt import Evictions, nodes_to_read, preempt
from services.extender.prioritize import prioritize
from services.extender.refusals import RefusalPublisher
from services.extender.resync import ViewSync
from services.extender.scores import ScoreCache
from services.extender.victims import read_facts
from services.extender.view import ClusterView
from services.extender.wire import BindingArgs, ExtenderArgs, PreemptionArgs
from shared.events.bus import EventBus
from shared.kube.pods import pod_uid
from shared.ledger.ledger import Ledger
from shared.placement import Policy
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)


class ExtenderService:
    """Everything behind the HTTP routes; start() loads the view and subscribes to the bus."""

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        ledger: Ledger,
        bus: EventBus | None,
        unit: MemoryUnit = MemoryUnit.GIB,
        policy: Policy = Policy.BINPACK,
        bind_timeout_s: float = 20.0,
        resync_s: float = 30.0,
        kubeconfig: str | None = None,
        kube_enabled: bool = True,
        pod_cache_size: int = 10_000,
        pod_cache_bytes: int = DEFAULT_MAX_BYTES,
        poll_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.ledger = ledger
        self.bus = bus
        self.unit = unit
        self.policy = policy
        self.view = ClusterView()
        self.scores = ScoreCache()
        self.waiter = OutcomeWaiter(engine, poll_s=poll_s)
        # kube_enabled=False (`--trust-filter-pods`): bind takes the pod filter saw, unverified (development only)
        self.pods = PodCache(
            size=pod_cache_size, max_bytes=pod_cache_bytes, kubeconfig=kubeconfig, kube_enabled=kube_enabled
        )
        self.sync = ViewSync(self.view, engine, self.waiter, period_s=resync_s)
        self.evictions = Evictions(size=pod_cache_size)  # preempt's own recent answers (a preemptor waits for them)
        refusals = RefusalPublisher(bus, size=pod_cache_size)
        self._filter = Filter(self.view, self.scores, self.pods, refusals, unit, policy)
        self._bind = Bind(self.view, self.sync, ledger, engine, self.waiter, self.pods, unit, policy, bind_timeout_s)
        self._sub: Any = None
        self._tasks: list[asyncio.Task[Any]] = []

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Subscribe to ledger events, load the view, and start the periodic resync."""
        if self.bus is not None:
            self._sub = await self.bus.nc.subscribe(f"{self.bus.names.prefix}.>", cb=self.sync.on_message)
        await self.resync("start")
        self._tasks.append(asyncio.create_task(self.sync.run()))
        self._tasks.append(asyncio.create_task(self.pods.watch(), name="unbound-pod-watch"))

    async def close(self) -> None:
        """Stop background work (the caller owns the engine and the bus)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await self.pods.close()

    @property
    def ready(self) -> bool:
        """Ready once the view has been loaded."""
        return self.view.loaded

    @property
    def bind_timeout_s(self) -> float:
        """Seconds bind waits for the binder before answering (the reservation is kept)."""
        return self._bind.timeout_s

    @bind_timeout_s.setter
    def bind_timeout_s(self, seconds: float) -> None:
        self._bind.timeout_s = seconds

    async def resync(self, reason: str, *, settle: bool = True) -> None:
        """Reload the view from the ledger (see `ViewSync.resync`)."""
        await self.sync.resync(reason, settle=settle)

    # ---- the verbs -----------------------------------------------------------------------------
    async def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        """Answer a filter call (`services.extender.filter`)."""
        return await self._filter(args)

    def prioritize(self, args: ExtenderArgs) -> list[tuple[str, int]]:
        """Answer a prioritize call (`services.extender.prioritize`)."""
        return prioritize(self.view, self.scores, args, unit=self.unit, policy=self.policy)

    async def bind(self, args: BindingArgs) -> str:
        """Answer a bind call: "" once bound, else the error text (`services.extender.bind`)."""
        return await self._bind(args)

    async def preempt(self, args: PreemptionArgs) -> dict[str, Any]:
        """Answer a preempt call (`services.extender.preempt`) with the candidate nodes' pods and the
        PodDisruptionBudgets read from the API (`services.extender.victims`)."""
        api = None if self.pods.trust_filter else self.pods.api
        uid = pod_uid(args.pod)
        answered = self.evictions.recent(uid)
        facts = await read_facts(api, nodes_to_read(args, answered))
        answer = preempt(self.view, args, facts, unit=self.unit, policy=self.policy, answered=answered)
        self.evictions.remember(uid, answer)
        meta = args.pod.get("metadata") or {}
        log.info(
            "preempt %s/%s: %d candidate node(s), victims offered on %s",
            meta.get("namespace"),
            meta.get("name"),
            len(args.victims),
            ", ".join(sorted(answer["NodeNameToMetaVictims"]))
            or "none (waiting for an earlier preemption, or no eviction frees a GPU)",
            extra={
                "candidates": sorted(args.victims),
                "answered": sorted(answered),
                "pods_known": facts.pods is not None,
            },
        )
        return answer

    def inspect(self, node_name: str | None = None) -> dict[str, Any]:
        """gpushare's inspect JSON (`services.extender.inspection`)."""
        return inspect(self.view, self.unit, node_name)
