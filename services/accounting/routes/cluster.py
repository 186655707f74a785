"""Cluster totals and nodes with their GPUs (`/v1/cluster`, `/v1/nodes`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from .. import queries
from ..deps import AppSettings, Conn, found
from ..params import Name
from ..schemas import Cluster, NodeDetail, NodeList, lookup, refusals

router = APIRouter(prefix="/v1", tags=["cluster"])


@router.get("/cluster", summary="Cluster totals", response_model=Cluster)
async def cluster(conn: Conn, settings: AppSettings) -> dict[str, Any]:
    return await queries.cluster_totals(conn, settings.resource_memory_unit.value)


@router.get("/nodes", summary="Nodes with their GPUs", response_model=NodeList, responses=refusals(422))
async def nodes(conn: Conn, settings: AppSettings, include_retired: bool = False) -> dict[str, Any]:
    items = await queries.list_nodes(conn, include_retired=include_retired)
    return {"items": items, "memory_unit": settings.resource_memory_unit.value}


@router.get("/nodes/{name}", **lookup("One node, its GPUs and their allocations", NodeDetail))
async def node(conn: Conn, settings: AppSettings, name: Name) -> dict[str, Any]:
    detail = found(await queries.node_detail(conn, name), f"no node {name!r} in the ledger")
    return {**detail, "memory_unit": settings.resource_memory_unit.value}
