"""Accounting's REST API (FastAPI, under /v1), the dashboard at /ui, and /metrics."""

from __future__ import annotations

import hmac
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import QuotaEvent
from shared.http import install_common
from shared.ledger.ledger import Ledger
from shared.settings import Settings

from . import queries
from .metrics import AccountingMetrics
from .rightsizing import DEFAULT_HEADROOM

log = logging.getLogger(__name__)

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"
NAMESPACE_RE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
NAME_RE = r"^[a-zA-Z0-9]([-a-zA-Z0-9_.]{0,251}[a-zA-Z0-9])?$"
DEFAULT_WINDOW = timedelta(days=7)
MAX_PAGE = 1000

Namespace = Annotated[str, PathParam(pattern=NAMESPACE_RE, description="Kubernetes namespace")]
NsFilter = Annotated[str | None, Query(pattern=NAMESPACE_RE, description="only this namespace")]
Since = Annotated[datetime | None, Query(description="range start (ISO 8601; naive means UTC)")]
Until = Annotated[datetime | None, Query(description="range end (ISO 8601; naive means UTC; default now)")]


class QuotaBody(BaseModel):
    """A namespace quota: GPU memory in MiB and/or compute in percent of one GPU (at least one)."""

    model_config = ConfigDict(extra="forbid")

    memory_mib: int | None = Field(default=None, ge=0, le=16 * 1024 * 1024)
    compute: int | None = Field(default=None, ge=0, le=6400)

    @model_validator(mode="after")
    def _one_limit(self) -> QuotaBody:
        if self.memory_mib is None and self.compute is None:
            raise ValueError("give memory_mib and/or compute (to remove a quota, DELETE it)")
        return self


def _utc(ts: datetime | None) -> datetime | None:
    if ts is None:
        return None
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def _range(since: datetime | None, until: datetime | None, *, default_window: bool) -> tuple[Any, Any]:
    """Normalise a time range; 422 when it is backwards or out of bounds."""
    try:
        since, until = _utc(since), _utc(until)
        if default_window:
            until = until or datetime.now(UTC)
            since = since or until - DEFAULT_WINDOW
    except (OverflowError, ValueError) as exc:
        raise HTTPException(422, f"time range out of bounds: {exc}") from None
    if since is not None and until is not None and since > until:
        raise HTTPException(422, f"since ({since.isoformat()}) is after until ({until.isoformat()})")
    return since, until


def create_app(
    engine: AsyncEngine,
    settings: Settings,
    *,
    ledger: Ledger | None = None,
    metrics: AccountingMetrics | None = None,
    ready: Any = lambda: True,
) -> FastAPI:
    """The accounting application over a ledger database (`ledger` is needed for quota writes)."""
    metrics = metrics or AccountingMetrics()
    unit = settings.resource_memory_unit
    app = FastAPI(
        title="gpushare accounting",
        version="1",
        description="Who holds which GPU memory, who uses it, why pods wait, what to resize.",
    )
    install_common(app, ready=ready, registry=metrics.registry)
    app.state.metrics = metrics

    @app.middleware("http")
    async def _refresh_metrics(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path == "/metrics":
            try:
                await metrics.refresh(engine)
            except Exception as exc:  # serve the last snapshot rather than fail the scrape
                log.warning("could not refresh metrics from the ledger: %s", exc)
        return await call_next(request)

    def require_admin(request: Request) -> None:
        configured = settings.admin_token.get_secret_value() if settings.admin_token else ""
        if not configured:
            raise HTTPException(403, "quota changes are disabled: no admin token is configured (GPUSHARE_ADMIN_TOKEN)")
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), configured.encode()):
            log.warning("refused a quota change with a wrong token", extra={"path": request.url.path})
            raise HTTPException(403, "invalid token")

    @app.get("/v1/cluster", tags=["cluster"], summary="Cluster totals")
    async def cluster() -> dict[str, Any]:
        async with engine.connect() as conn:
            return await queries.cluster_totals(conn, unit.value)

    @app.get("/v1/nodes", tags=["cluster"], summary="Nodes with their GPUs")
    async def nodes(include_retired: bool = False) -> dict[str, Any]:
        async with engine.connect() as conn:
            items = await queries.list_nodes(conn, include_retired=include_retired)
        return {"items": items, "memory_unit": unit.value}

    @app.get("/v1/nodes/{name}", tags=["cluster"], summary="One node, its GPUs and their allocations")
    async def node(name: Annotated[str, PathParam(pattern=NAME_RE)]) -> dict[str, Any]:
        async with engine.connect() as conn:
            found = await queries.node_detail(conn, name)
        if found is None:
            raise HTTPException(404, f"no node {name!r} in the ledger")
        return {**found, "memory_unit": unit.value}

    @app.get("/v1/allocations", tags=["allocations"], summary="Allocations, filtered and paginated")
    async def allocations(
        namespace: NsFilter = None,
        node: Annotated[str | None, Query(pattern=NAME_RE)] = None,
        state: Literal["reserved", "bound", "assigned", "released", "failed", "live"] | None = None,
        pod: Annotated[str | None, Query(pattern=NAME_RE, description="pod name or UID")] = None,
        since: Since = None,
        until: Until = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    ) -> dict[str, Any]:
        since, until = _range(since, until, default_window=False)
        f = queries.AllocationFilter(namespace, node, state, pod, since, until)
        async with engine.connect() as conn:
            items, total = await queries.list_allocations(conn, f, limit=limit, offset=offset)
        nxt = offset + len(items)
        return {
            "items": items,
            "total": total,
            "limit": limit,
            "offset": offset,
            "next_offset": nxt if nxt < total else None,
        }

    @app.get("/v1/pods/{namespace}/{name}", tags=["allocations"], summary="A pod: allocation, timeline, reasons")
    async def pod(namespace: Namespace, name: Annotated[str, PathParam(pattern=NAME_RE)]) -> dict[str, Any]:
        async with engine.connect() as conn:
            found = await queries.pod_view(conn, namespace, name)
        if found is None:
            raise HTTPException(404, f"accounting knows no pod {namespace}/{name}")
        return found

    @app.get("/v1/pending", tags=["allocations"], summary="Pods waiting for GPUs, with the latest reasons")
    async def pending(namespace: NsFilter = None) -> dict[str, Any]:
        async with engine.connect() as conn:
            return {"items": await queries.list_pending(conn, namespace=namespace)}

    @app.get("/v1/usage/namespaces", tags=["usage"], summary="GPU-memory-hours allocated vs used per namespace")
    async def usage_namespaces(since: Since = None, until: Until = None, namespace: NsFilter = None) -> dict[str, Any]:
        since, until = _range(since, until, default_window=True)
        async with engine.connect() as conn:
            items = await queries.usage(conn, since=since, until=until, by="namespace", namespace=namespace)
        return {"since": since.isoformat(), "until": until.isoformat(), "items": items}

    @app.get("/v1/usage/workloads", tags=["usage"], summary="GPU-memory-hours allocated vs used per workload")
    async def usage_workloads(since: Since = None, until: Until = None, namespace: NsFilter = None) -> dict[str, Any]:
        since, until = _range(since, until, default_window=True)
        async with engine.connect() as conn:
            items = await queries.usage(conn, since=since, until=until, by="workload", namespace=namespace)
        return {"since": since.isoformat(), "until": until.isoformat(), "items": items}

    @app.get("/v1/rightsizing", tags=["usage"], summary="Right-sizing suggestions per workload")
    async def rightsizing(
        since: Since = None,
        until: Until = None,
        namespace: NsFilter = None,
        headroom: Annotated[float, Query(ge=0, le=10, description="fraction added to the peak")] = DEFAULT_HEADROOM,
        step_mib: Annotated[
            int | None, Query(ge=1, le=1024 * 1024, description="rounding step (default: the resource unit)")
        ] = None,
    ) -> dict[str, Any]:
        since, until = _range(since, until, default_window=True)
        step = step_mib or unit.mib
        async with engine.connect() as conn:
            items = await queries.rightsizing(
                conn, since=since, until=until, step_mib=step, headroom=headroom, namespace=namespace
            )
        return {"since": since.isoformat(), "until": until.isoformat(), "step_mib": step, "items": items}

    @app.get("/v1/quotas", tags=["quotas"], summary="Every namespace quota")
    async def quotas() -> dict[str, Any]:
        async with engine.connect() as conn:
            return {"items": await queries.list_quotas(conn)}

    @app.get("/v1/quotas/{namespace}", tags=["quotas"], summary="One namespace's quota")
    async def quota(namespace: Namespace) -> dict[str, Any]:
        async with engine.connect() as conn:
            found = await queries.get_quota(conn, namespace)
        if found is None:
            raise HTTPException(404, f"namespace {namespace} has no GPU quota")
        return found

    def _writer() -> Ledger:
        if ledger is None:
            raise HTTPException(503, "this accounting instance cannot write to the ledger")
        return ledger

    @app.put(
        "/v1/quotas/{namespace}",
        tags=["quotas"],
        summary="Set a namespace's quota (bearer token)",
        dependencies=[Depends(require_admin)],
    )
    async def put_quota(namespace: Namespace, body: QuotaBody) -> dict[str, Any]:
        await _writer().record(QuotaEvent(namespace=namespace, memory_mib=body.memory_mib, compute=body.compute))
        log.info("quota set", extra={"namespace": namespace, "memory_mib": body.memory_mib, "compute": body.compute})
        async with engine.connect() as conn:
            return await queries.get_quota(conn, namespace) or {}

    @app.delete(
        "/v1/quotas/{namespace}",
        tags=["quotas"],
        summary="Remove a namespace's quota (bearer token)",
        dependencies=[Depends(require_admin)],
    )
    async def delete_quota(namespace: Namespace) -> dict[str, Any]:
        async with engine.connect() as conn:
            existing = await queries.get_quota(conn, namespace)
        if existing is None:
            raise HTTPException(404, f"namespace {namespace} has no GPU quota")
        await _writer().record(QuotaEvent(namespace=namespace))
        log.info("quota removed", extra={"namespace": namespace})
        return {"namespace": namespace, "deleted": True}

    @app.get("/ui", include_in_schema=False)
    async def ui() -> HTMLResponse:
        return HTMLResponse(DASHBOARD.read_text(encoding="utf-8"))

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui")

    return app
