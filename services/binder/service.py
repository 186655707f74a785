"""The binder assembled: reservation consumer, annotation follower, the node agents' ledger gateway, pod and node
watches, periodic reconciliation.

Every replica serves the shared work: the durable consumers (each reservation and each annotation update goes to
one replica) and the agents' gateway (a queue group). The watches, reconciliation and node nudges are cluster-wide
duties that one replica does: the holder of the `gpushare-binder` Lease (`shared.kube.leases`), or, without
leader election, the one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

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
from services.binder.templates import TemplateSweeper
from shared.events.bus import EventBus
from shared.events.catalogue import ReservedEvent, kind_of
from shared.events.consumer import DurableConsumer
from shared.kube.leases import ElectionConfig, LeaderElector
from shared.kube.retry import RetryPolicy
from shared.ledger.ledger import Ledger
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

DURABLE = "binder"
# A reservation held by a replica that died is delivered to another one this long after its last heartbeat; while a
# replica works on it, the heartbeat keeps it from being delivered twice.
ACK_WAIT_S = 5.0
HEARTBEAT_S = 1.5


@dataclass(frozen=True)
class BinderConfig:
    """Tunables of one binder process."""

    unit: MemoryUnit = MemoryUnit.GIB
    concurrency: int = 16
    reconcile_interval_s: float = 60.0
    reserve_grace_s: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    durable: str = DURABLE
    election: ElectionConfig | None = None  # None: this process leads alone (one replica)
    # gpushare admission's claim templates no live pod has named for this long are deleted (0: never)
    template_grace_s: float = 600.0


class Binder:
    """Everything the binder runs; `run(stop)` until stopped, `ready()` for /readyz."""

    def __init__(self, ledger: Ledger, bus: EventBus, api: client.ApiClient, config: BinderConfig) -> None:
        self.config = config
        self.bus = bus
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
            ack_wait_s=ACK_WAIT_S,
            heartbeat_s=HEARTBEAT_S,
            max_deliver=20,
        )
        # DRA nodes: claim allocations are recorded as they appear (services/binder/claims.py); their pods'
        # annotations are written at `assigned` from the gate's record
        self.claims = ClaimGate(ledger, api, unit=config.unit, metrics=self.metrics, retry=config.retry, pods=self.pods)
        self.annotations = AnnotationSync(
            ledger.engine,
            api,
            unit=config.unit,
            metrics=self.metrics,
            retry=config.retry,
            pods=self.pods,
            recorded=self.claims.record_of,
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
            ack_wait_s=ACK_WAIT_S,
            heartbeat_s=HEARTBEAT_S,
            max_deliver=20,
        )
        # an applied exchange rewrites both pods' annotations at once, not behind the consumer's queue of
        # `assigned` events (the consumer above stays the durable path)
        self.gateway = LedgerGateway(
            ledger, bus, metrics=self.metrics, concurrency=config.concurrency, on_exchanged=self.annotations
        )
        self.lifecycle = Lifecycle(ledger, api, metrics=self.metrics, index=self.pods)
        self.lifecycle.claims = self.claims
        self.dra_pending = DraPending(bus)  # kube-scheduler's reasons for rewritten DRA pods, for /v1/pending
        self.lifecycle.dra_pending = self.dra_pending
        self.claims.nudge = self.lifecycle.nudger.capacity_freed
        interval_s = min(300.0, max(1.0, config.template_grace_s / 2))
        self.templates = TemplateSweeper(
            api,
            grace_s=config.template_grace_s,
            interval_s=interval_s,
            on_outcome=lambda outcome: self.metrics.claim_templates.labels(outcome=outcome).inc(),
        )
        if config.template_grace_s > 0:
            self.lifecycle.templates = self.templates
        self.reconciler = Reconciler(
            ledger,
            api,
            unit=config.unit,
            metrics=self.metrics,
            grace_s=config.reserve_grace_s,
            rebind=self.handler,
            annotate=self.annotations.sync,
        )
        self.elector = (
            LeaderElector(api, config.election, on_change=self.metrics.leadership) if config.election else None
        )
        if self.elector is None:
            self.metrics.leader.set(1)
        self._term_passes = 0  # reconciliation passes before the current term began

    @property
    def leading(self) -> bool:
        """Whether this replica does the cluster-wide duties now."""
        return self.elector is None or self.elector.is_leader

    @property
    def role(self) -> str:
        """`leader` or `standby` (`leader` without leader election)."""
        return "leader" if self.leading else "standby"

    def describe(self) -> dict[str, object]:
        """The role and, with leader election, the lease and its holder (for /healthz and /status)."""
        return self.elector.describe() if self.elector is not None else {"role": self.role}

    def ready(self) -> bool:
        """Every duty of this replica's role is up, once the election has told it its role: the consumers and the
        gateway on every replica; on the leader also both watches listed and one reconciliation done in its term."""
        if self.elector is not None and not self.elector.decided:
            return False
        shared = (
            self.consumer.ready.is_set() and self.annotation_consumer.ready.is_set() and self.gateway.ready.is_set()
        )
        if not self.leading:
            return shared
        return (
            shared
            and self.lifecycle.pods_synced.is_set()
            and self.lifecycle.nodes_synced.is_set()
            and self.reconciler.passes > self._term_passes
            and self.claims.synced.is_set()
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Run every part until `stop` is set; a part that crashes takes the others down (and is logged)."""
        lead = self.elector.run(stop, self.lead) if self.elector is not None else self.lead(stop)
        await _together(
            {
                "consumer": self.consumer.run(stop),
                "annotations": self.annotation_consumer.run(stop),
                "agent-gateway": self.gateway.run(stop),
                "election" if self.elector is not None else "lead": lead,
            },
            stop,
        )

    async def lead(self, term_ended: asyncio.Event) -> None:
        """The cluster-wide duties, for one term of leadership: reconciliation, the pod and node watches (and the
        nudges that follow releases), the DRA claim gate (its watch and reconciliation) and the reasons DRA pods
        wait (fed by the pod watch). When the term ends, what the watches showed is forgotten: a standby binds from
        fresh reads, and a later term lists again."""
        self._term_passes = self.reconciler.passes
        try:
            await _together(
                {
                    "reconcile": self.reconciler.run(term_ended, self.config.reconcile_interval_s),
                    "pod-watch": self.lifecycle.watch_pods(term_ended),
                    "node-watch": self.lifecycle.watch_nodes(term_ended),
                    "claim-watch": self.claims.watch(term_ended),
                    "claim-reconcile": self.claims.run(term_ended, self.config.reconcile_interval_s),
                    "quota-follow": self.claims.follow_quotas(self.bus, term_ended),
                    "dra-pending": self.dra_pending.run(term_ended),
                    **({"claim-templates": self.templates.run(term_ended)} if self.lifecycle.templates else {}),
                },
                term_ended,
            )
        finally:
            self.lifecycle.pods_synced.clear()
            self.lifecycle.nodes_synced.clear()
            self.pods.reset()
            await self.lifecycle.nudger.close()
            self.claims.synced.clear()
            await self.claims.close()
            self.templates.reset()


async def _together(parts: dict[str, Coroutine[Any, Any, None]], stop: asyncio.Event) -> None:
    """Run `parts` until `stop` is set; the first that fails takes the others down and its error is raised."""
    tasks = [asyncio.create_task(coro, name=name) for name, coro in parts.items()]
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
