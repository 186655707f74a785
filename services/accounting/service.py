"""The accounting process: projection consumer + REST API + dashboard + metrics."""

from __future__ import annotations

import logging

from shared.events.consumer import DurableConsumer
from shared.runtime import ServiceRuntime
from shared.settings import Settings

from .api import create_app
from .metrics import AccountingMetrics
from .projections import Projector
from .resource_quotas import ResourceQuotas
from .tables import CONSUMER

log = logging.getLogger(__name__)

BATCH = 256
LINGER_S = 0.25


def build_consumer(rt: ServiceRuntime, metrics: AccountingMetrics) -> DurableConsumer:
    """The durable "accounting" consumer of every event, applying them to the projections."""
    assert rt.engine is not None and rt.bus is not None
    projector = Projector(rt.engine, on_latency=metrics.observe_latency)

    async def handle(event):  # type: ignore[no-untyped-def]
        if await projector.handle(event):
            metrics.events_applied.inc()

    async def handle_many(events):  # type: ignore[no-untyped-def]
        metrics.events_applied.inc(await projector.handle_many(events))

    # one transaction for whatever arrived within LINGER_S (up to BATCH events): a burst, or a backlog being
    # replayed, costs a commit per batch instead of one per event; the read models lag by at most LINGER_S
    return DurableConsumer(rt.bus, CONSUMER, handle, batch_handler=handle_many, batch=BATCH, linger_s=LINGER_S)


async def serve(
    settings: Settings, *, host: str, port: int, kubernetes: bool = True, kubeconfig: str | None = None
) -> None:
    """Run until SIGTERM / SIGINT (`kubernetes`: show the cluster's ResourceQuotas, read with `kubeconfig`,
    default $KUBECONFIG or in-cluster)."""
    async with ServiceRuntime("accounting", settings) as rt:
        assert rt.engine is not None
        metrics = AccountingMetrics()
        consumer = build_consumer(rt, metrics)
        rt.spawn(consumer.run(rt.stop))
        resource_quotas = ResourceQuotas(kubeconfig) if kubernetes else None
        app = create_app(
            rt.engine,
            settings,
            ledger=rt.ledger,
            metrics=metrics,
            ready=consumer.ready.is_set,
            resource_quotas=resource_quotas,
        )
        try:
            await rt.serve(app, host=host, port=port)
        finally:
            if resource_quotas is not None:
                await resource_quotas.close()
