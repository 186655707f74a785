"""Allocations, pods and pending pods (`/v1/allocations`, `/v1/pods`, `/v1/pending`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from .. import pending_pods, queries
from ..deps import Conn, MaybeScheduling, found
from ..params import MAX_PAGE, NAME_RE, Name, Namespace, NsFilter, Since, StateFilter, Until, time_range
from ..schemas import AllocationPage, PendingList, PodView, lookup, refusals

router = APIRouter(prefix="/v1", tags=["allocations"])


@router.get(
    "/allocations",
    summary="Allocations, filtered and paginated",
    response_model=AllocationPage,
    responses=refusals(422),
)
async def allocations(
    conn: Conn,
    namespace: NsFilter = None,
    node: Annotated[str | None, Query(pattern=NAME_RE)] = None,
    state: StateFilter | None = None,
    pod: Annotated[str | None, Query(pattern=NAME_RE, description="pod name or UID")] = None,
    since: Since = None,
    until: Until = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> dict[str, Any]:
    since, until = time_range(since, until, default_window=False)
    f = queries.AllocationFilter(namespace, node, state, pod, since, until)
    items, total = await queries.list_allocations(conn, f, limit=limit, offset=offset)
    nxt = offset + len(items)
    return {
        "items": items,
        "total": total,
        "limit": limit,
        "offset": offset,
        "next_offset": nxt if nxt < total else None,
    }


@router.get("/pods/{namespace}/{name}", **lookup("A pod: allocation, timeline, reasons", PodView))
async def pod(conn: Conn, scheduling: MaybeScheduling, namespace: Namespace, name: Name) -> dict[str, Any]:
    view = await pending_pods.pod_view(conn, scheduling, namespace, name)
    return found(view, f"accounting knows no pod {namespace}/{name}")


@router.get(
    "/pending",
    summary="GPU pods waiting for a node, with the latest reasons (the extender's and kube-scheduler's)",
    response_model=PendingList,
    responses=refusals(422),
)
async def pending(conn: Conn, scheduling: MaybeScheduling, namespace: NsFilter = None) -> dict[str, Any]:
    return {"items": await pending_pods.pending_items(conn, scheduling, namespace=namespace)}
