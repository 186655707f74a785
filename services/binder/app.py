"""The binder's small HTTP face: /healthz, /readyz, /metrics and a JSON summary at /status."""

from __future__ import annotations

from fastapi import FastAPI

from services.binder.service import Binder
from shared.http import BodyLimitMiddleware, install_common


def make_app(binder: Binder) -> FastAPI:
    """A FastAPI app serving the binder's health, readiness and metrics."""
    app = FastAPI(title="gpushare binder", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=64 * 1024)
    install_common(app, ready=binder.ready, registry=binder.metrics.registry, role=binder.describe)

    @app.get("/status")
    async def status() -> dict[str, object]:
        m = binder.metrics
        return {
            **binder.describe(),
            "ready": binder.ready(),
            "applied": binder.consumer.applied,
            "parked": binder.consumer.parked,
            "reconciliations": binder.reconciler.passes,
            "adopted": m.value("gpushare_binder_adopted_total"),
            "open_conflicts": m.value("gpushare_binder_open_conflicts"),
        }

    return app
