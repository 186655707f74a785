"""Accounting's REST API (FastAPI, under /v1), the dashboard at /ui, and /metrics.

The routes live in `services/accounting/routes/` (one router per area), their dependencies (engine,
settings, ledger writer, admin token) in `deps.py`, their answers' models in `schemas.py`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.http import BodyLimitMiddleware, install_common
from shared.ledger.ledger import Ledger
from shared.settings import Settings

from .metrics import AccountingMetrics
from .owners import WorkloadNames
from .resource_quotas import ResourceQuotas
from .routes import ROUTERS
from .scheduling import SchedulingWaits

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024  # the largest body accounting takes is a quota ({"memory_mib": ..., "compute": ...})


def create_app(
    engine: AsyncEngine,
    settings: Settings,
    *,
    ledger: Ledger | None = None,
    metrics: AccountingMetrics | None = None,
    ready: Any = lambda: True,
    resource_quotas: ResourceQuotas | None = None,
    workload_names: WorkloadNames | None = None,
    scheduling: SchedulingWaits | None = None,
) -> FastAPI:
    """The accounting application over a ledger database (`ledger` is needed for quota writes,
    `resource_quotas` to show the cluster's ResourceQuotas beside them, `workload_names` to name ReplicaSets'
    pods by their Deployments through the API server (without: by their names), `scheduling` for the waits of
    pending pods)."""
    metrics = metrics or AccountingMetrics()
    app = FastAPI(
        title="gpushare accounting",
        version="1",
        description="Who holds which GPU memory, who uses it, why pods wait, what to resize.",
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES)
    install_common(app, ready=ready, registry=metrics.registry)
    app.state.engine = engine
    app.state.settings = settings
    app.state.ledger = ledger
    app.state.metrics = metrics
    app.state.resource_quotas = resource_quotas
    app.state.workload_names = workload_names or WorkloadNames(kubernetes=False)
    app.state.scheduling = scheduling

    @app.middleware("http")
    async def _refresh_metrics(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path == "/metrics":
            try:
                await metrics.refresh(engine, owners=app.state.workload_names.resolve, scheduling=app.state.scheduling)
            except Exception as exc:  # serve the last snapshot rather than fail the scrape
                log.warning("could not refresh metrics from the ledger: %s", exc)
        return await call_next(request)

    for router in ROUTERS:
        app.include_router(router)
    return app
