"""GPU-memory-hours and right-sizing (`/v1/usage/*`, `/v1/rightsizing`; the last 7 days by default), and each live
GPU pod's latest usage (`/v1/usage/pods`). Workloads are named by their controllers (`owners`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel

from .. import queries
from ..deps import AppSettings, Conn, Names
from ..params import NsFilter, Since, Until, window
from ..rightsizing import DEFAULT_HEADROOM
from ..schemas import LivePodList, NamespaceUsageList, Suggestions, WorkloadUsageList, refusals

router = APIRouter(prefix="/v1", tags=["usage"], responses=refusals(422))


def _usage_route(by: str, answer: type[BaseModel], summary: str) -> None:
    """`GET /v1/usage/<by>s`: GPU-memory-hours allocated vs used per namespace or per workload."""

    async def usage(
        conn: Conn, names: Names, since: Since = None, until: Until = None, namespace: NsFilter = None
    ) -> dict[str, Any]:
        since, until = window(since, until)
        items = await queries.usage(conn, since=since, until=until, by=by, namespace=namespace, owners=names.resolve)
        return {"since": since.isoformat(), "until": until.isoformat(), "items": items}

    router.add_api_route(
        f"/usage/{by}s", usage, methods=["GET"], name=f"usage_{by}s", summary=summary, response_model=answer
    )


_usage_route("namespace", NamespaceUsageList, "GPU-memory-hours allocated vs used per namespace")
_usage_route("workload", WorkloadUsageList, "GPU-memory-hours allocated vs used per workload")


@router.get(
    "/usage/pods", summary="Each live GPU pod: held vs used memory and SM utilisation", response_model=LivePodList
)
async def pods(conn: Conn, names: Names, namespace: NsFilter = None) -> dict[str, Any]:
    return {"items": await queries.live_pod_usage(conn, namespace=namespace, owners=names.resolve)}


@router.get("/rightsizing", summary="Right-sizing suggestions per workload", response_model=Suggestions)
async def rightsizing(
    conn: Conn,
    settings: AppSettings,
    names: Names,
    since: Since = None,
    until: Until = None,
    namespace: NsFilter = None,
    headroom: Annotated[float, Query(ge=0, le=10, description="fraction added to the peak")] = DEFAULT_HEADROOM,
    step_mib: Annotated[
        int | None, Query(ge=1, le=1024 * 1024, description="rounding step (default: the resource unit)")
    ] = None,
) -> dict[str, Any]:
    since, until = window(since, until)
    step = step_mib or settings.resource_memory_unit.mib
    items = await queries.rightsizing(
        conn, since=since, until=until, step_mib=step, headroom=headroom, namespace=namespace, owners=names.resolve
    )
    return {"since": since.isoformat(), "until": until.isoformat(), "step_mib": step, "items": items}
