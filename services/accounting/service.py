"""The accounting process: projection consumers + REST API + dashboard + metrics + housekeeping (ledger snapshots,
pruning)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kubernetes_asyncio.config.config_exception import ConfigException
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.bus import EventBus
from shared.events.consumer import DurableConsumer
from shared.kube.client import api_client
from shared.runtime import Listen, ServiceRuntime
from shared.settings import Settings

from .api import create_app
from .housekeeping import Housekeeper, Retention
from .metrics import AccountingMetrics
from .owners import WorkloadNames
from .projections import Projector
from .resource_quotas import ResourceQuotas
from .scheduling import SchedulingWaits
from .tables import CONSUMER, SAMPLES_CONSUMER

log = logging.getLogger(__name__)

BATCH = 1000
LINGER_S = 0.25
# A batch held by a replica that died goes to another replica this long after its last heartbeat.
ACK_WAIT_S = 10.0
HEARTBEAT_S = 3.0


def build_consumers(engine: AsyncEngine, bus: EventBus, metrics: AccountingMetrics) -> list[DurableConsumer]:
    """The durable consumers "accounting" (every event of the ledger stream) and "accounting-samples" (usage
    and refusals from the samples stream), applying them to the projections."""
    projector = Projector(engine, on_latency=metrics.observe_latency)

    async def handle(event):  # type: ignore[no-untyped-def]
        if await projector.handle(event):
            metrics.events_applied.inc()

    async def handle_many(events):  # type: ignore[no-untyped-def]
        metrics.events_applied.inc(await projector.handle_many(events))

    # one transaction for whatever arrived within LINGER_S (up to BATCH events): a burst, or a backlog being
    # replayed, costs a commit and a few statements per batch (projections.apply_many) instead of a few per
    # event; the read models lag by at most LINGER_S. A failing batch is handled again one event at a time
    # (DurableConsumer.handle_batch), so a poison event is retried or parked on its own.
    return [
        DurableConsumer(
            bus,
            durable,
            handle,
            batch_handler=handle_many,
            batch=BATCH,
            linger_s=LINGER_S,
            stream=stream,
            ack_wait_s=ACK_WAIT_S,
            heartbeat_s=HEARTBEAT_S,
        )
        for durable, stream in ((CONSUMER, bus.names.stream), (SAMPLES_CONSUMER, bus.names.samples_stream))
    ]


async def serve(
    settings: Settings, *, host: str, port: int, kubernetes: bool = True, kubeconfig: str | None = None
) -> None:
    """Run until SIGTERM / SIGINT (`kubernetes`: show the cluster's ResourceQuotas, read with `kubeconfig`,
    default $KUBECONFIG or in-cluster)."""
    async with ServiceRuntime("accounting", settings, listen=Listen(host, port)) as rt:
        assert rt.engine is not None
        metrics = AccountingMetrics()
        metrics.registry.register(rt.ledger_metrics())
        assert rt.bus is not None
        consumers = build_consumers(rt.engine, rt.bus, metrics)
        for consumer in consumers:
            rt.spawn(consumer.run(rt.stop))
        housekeeper = Housekeeper(
            rt.engine,
            rt.bus,
            Retention.from_settings(settings),
            snapshot_interval_s=settings.snapshot_interval,
            snapshot_keep=settings.snapshot_keep,
            on_pruned=lambda table, rows: metrics.pruned_rows.labels(table=table).inc(rows),
            on_snapshot=lambda result: metrics.observe_snapshot(result.sequence, result.trimmed),
            on_failure=lambda task: metrics.housekeeping_failures.labels(task=task).inc(),
        )
        rt.spawn(housekeeper.run(rt.stop))
        resource_quotas = ResourceQuotas(kubeconfig) if kubernetes else None
        names = WorkloadNames(kubeconfig, kubernetes=kubernetes)
        scheduling = _watch_scheduling(rt, metrics, settings, kubeconfig) if kubernetes else None
        app = create_app(
            rt.engine,
            settings,
            ledger=rt.ledger,
            metrics=metrics,
            ready=lambda: all(c.ready.is_set() for c in consumers),
            resource_quotas=resource_quotas,
            workload_names=names,
            scheduling=scheduling,
        )
        try:
            await rt.serve(app)
        finally:
            await names.close()
            if resource_quotas is not None:
                await resource_quotas.close()


def _watch_scheduling(
    rt: ServiceRuntime, metrics: AccountingMetrics, settings: Settings, kubeconfig: str | None
) -> SchedulingWaits:
    """The pod watch behind the scheduling-wait histogram and pending pods' waits. Until the Kubernetes
    configuration can be read (a local control plane writes its kubeconfig after accounting started) it is tried
    again with capped backoff."""
    assert rt.engine is not None
    scheduling = SchedulingWaits(rt.engine, metrics.observe_wait, horizon_s=settings.dedupe_horizon)

    async def watch() -> None:
        backoff, said = 1.0, False
        while not rt.stop.is_set():
            try:
                api = await api_client(kubeconfig)
            except (ConfigException, OSError) as exc:
                if not said:
                    log.warning("no Kubernetes configuration yet (%s): scheduling waits wait for it", exc)
                    said = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(rt.stop.wait(), backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            try:
                await scheduling.run(api, rt.stop)
            finally:
                await api.close()

    rt.spawn(watch())
    return scheduling
