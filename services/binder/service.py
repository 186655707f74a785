"""The binder assembled: reservation consumer, annotation follower, the node agents' ledger gateway, pod and node
watches, periodic reconciliation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from kubernetes_asyncio import client

from services.binder.annotate import AnnotationSync
from services.binder.claims import ClaimGate
from services.binder.dra_pending import DraPending
from services.binder.gateway import LedgerGateway
from services.binder.handler import BindHandler
from services.binder.lifecycle import Lifecycle
from services.binder.metrics import BinderMetrics
from services.binder.pod_index import binder_index
from services.binder.reconcile import Reconciler
from shared.events.bus import EventBus
from shared.events.catalogue import ReservedEvent, kind_of
from shared.events.consumer import DurableConsumer
from shared.kube.retry import RetryPolicy
from shared.ledger.ledger import Ledger
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

DURABLE = "binder"


@dataclass(frozen=True)
class BinderConfig:
    """Tunables of one binder process."""

    unit: MemoryUnit = MemoryUnit.GIB
    concurrency: int = 16
    reconcile_interval_s: float = 60.0
    reserve_grace_s: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    durable: str = DURABLE


class Binder:
    """Everything the binder runs; `run(stop)` until stopped, `ready()` for /readyz."""

    def __init__(self, ledger: Ledger, bus: EventBus, api: client.ApiClient, config: BinderConfig) -> None:
        self.config = config
        self.metrics = BinderMetrics()
        self.pods = binder_index()  # fed by the lifecycle's pod watch, read by the handler before binding
        self.handler = BindHandler(
            ledger, api, unit=config.unit, metrics=self.metrics, retry=config.retry, pods=self.pods
        )
        # a redelivery that overlaps a slow first delivery is serialised by the handler and then skipped
        self.consumer = DurableConsumer(
            bus,
            config.durable,
            self.handler,
            kinds=[kind_of(ReservedEvent)],
            concurrency=config.concurrency,
            batch=max(16, config.concurrency * 4),
            ack_wait_s=30.0,
            max_deliver=20,
        )
        self.annotations = AnnotationSync(
            ledger.engine, api, unit=config.unit, metrics=self.metrics, retry=config.retry
        )
        # assignments and exchanges rewrite pod annotations from the ledger's record (durable: a crash between
        # the ledger write and the patch only delays the patch)
        self.annotation_consumer = DurableConsumer(
            bus,
            f"{config.durable}-annotations",
            self.annotations,
            kinds=["assigned", "exchanged"],
            concurrency=max(1, config.concurrency // 2),
            batch=max(16, config.concurrency * 2),
            ack_wait_s=30.0,
            max_deliver=20,
        )
        self.gateway = LedgerGateway(ledger, bus, metrics=self.metrics, concurrency=config.concurrency)
        self.lifecycle = Lifecycle(ledger, api, metrics=self.metrics, index=self.pods)
        # DRA nodes: claim allocations are recorded before kube-scheduler binds their pods (services/binder/claims.py)
        self.claims = ClaimGate(ledger, api, unit=config.unit, metrics=self.metrics, retry=config.retry)
        self.lifecycle.claims = self.claims
        self.dra_pending = DraPending(bus)  # kube-scheduler's reasons for rewritten DRA pods, for /v1/pending
        self.lifecycle.dra_pending = self.dra_pending
        self.claims.nudge = self.lifecycle.nudger.capacity_freed
        self.reconciler = Reconciler(
            ledger,
            api,
            unit=config.unit,
            metrics=self.metrics,
            grace_s=config.reserve_grace_s,
            rebind=self.handler,
            annotate=self.annotations.sync,
        )

    def ready(self) -> bool:
        """Consuming, both watches listed, and one reconciliation done."""
        return (
            self.consumer.ready.is_set()
            and self.annotation_consumer.ready.is_set()
            and self.gateway.ready.is_set()
            and self.lifecycle.pods_synced.is_set()
            and self.lifecycle.nodes_synced.is_set()
            and self.reconciler.passes > 0
            and self.claims.synced.is_set()
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Run every part until `stop` is set; a part that crashes takes the others down (and is logged)."""
        tasks = [
            asyncio.create_task(self.reconciler.run(stop, self.config.reconcile_interval_s), name="reconcile"),
            asyncio.create_task(self.lifecycle.watch_pods(stop), name="pod-watch"),
            asyncio.create_task(self.lifecycle.watch_nodes(stop), name="node-watch"),
            asyncio.create_task(self.consumer.run(stop), name="consumer"),
            asyncio.create_task(self.annotation_consumer.run(stop), name="annotations"),
            asyncio.create_task(self.gateway.run(stop), name="agent-gateway"),
            asyncio.create_task(self.claims.watch(stop), name="claim-watch"),
            asyncio.create_task(self.claims.run(stop, self.config.reconcile_interval_s), name="claim-reconcile"),
            asyncio.create_task(self.dra_pending.run(stop), name="dra-pending"),
        ]
        stopper = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({*tasks, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in [*tasks, stopper]:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.lifecycle.nudger.close()
            await self.claims.close()
