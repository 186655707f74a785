"""Namespace quotas (`/v1/quotas`): read by anyone, written through the ledger with the admin token; the list
also shows the cluster's ResourceQuotas on gpushare's resources."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.events.catalogue import MAX_COMPUTE, MAX_MIB, QuotaEvent

from .. import queries
from ..deps import Admin, AppSettings, Conn, Engine, MaybeLedger, MaybeResourceQuotas, found, writable
from ..params import Namespace
from ..schemas import Quota, QuotaDeleted, QuotaList, lookup, refusals

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/quotas", tags=["quotas"])


class QuotaBody(BaseModel):
    """A namespace quota: GPU memory in MiB and/or compute in percent of one GPU (at least one)."""

    model_config = ConfigDict(extra="forbid")

    memory_mib: int | None = Field(default=None, ge=0, le=MAX_MIB)
    compute: int | None = Field(default=None, ge=0, le=MAX_COMPUTE)

    @model_validator(mode="after")
    def _one_limit(self) -> QuotaBody:
        if self.memory_mib is None and self.compute is None:
            raise ValueError("give memory_mib and/or compute (to remove a quota, DELETE it)")
        return self


def _no_quota(namespace: str) -> str:
    return f"namespace {namespace} has no GPU quota"


def _change(summary: str, answer: type[BaseModel], *refused: int) -> dict[str, Any]:
    """Route arguments of a quota change: the admin token, the answer's model, the documented refusals."""
    return {
        "summary": f"{summary} (bearer token)",
        "dependencies": [Admin],
        "response_model": answer,
        "responses": refusals(401, 403, 404, 422, 503, *refused),
    }


NO_KUBERNETES = "accounting runs without Kubernetes access (gpushare accounting --no-kubernetes)"


@router.get("", summary="Every namespace quota, and the cluster's ResourceQuotas on GPUs", response_model=QuotaList)
async def quotas(conn: Conn, settings: AppSettings, resource_quotas: MaybeResourceQuotas) -> dict[str, Any]:
    native, unavailable = await resource_quotas.read() if resource_quotas is not None else ([], NO_KUBERNETES)
    return {
        "items": await queries.list_quotas(conn),
        "resource_quotas": native,
        "resource_quotas_unavailable": unavailable,
        "memory_unit": settings.resource_memory_unit.value,
    }


@router.get("/{namespace}", **lookup("One namespace's quota", Quota))
async def quota(conn: Conn, namespace: Namespace) -> dict[str, Any]:
    return found(await queries.get_quota(conn, namespace), _no_quota(namespace))


@router.put("/{namespace}", **_change("Set a namespace's quota", Quota, 400))
async def put_quota(engine: Engine, ledger: MaybeLedger, namespace: Namespace, body: QuotaBody) -> dict[str, Any]:
    await writable(ledger).record(QuotaEvent(namespace=namespace, memory_mib=body.memory_mib, compute=body.compute))
    log.info("quota set", extra={"namespace": namespace, "memory_mib": body.memory_mib, "compute": body.compute})
    async with engine.connect() as conn:  # not found: removed again by a concurrent DELETE
        return found(await queries.get_quota(conn, namespace), _no_quota(namespace))


@router.delete("/{namespace}", **_change("Remove a namespace's quota", QuotaDeleted))
async def delete_quota(engine: Engine, ledger: MaybeLedger, namespace: Namespace) -> dict[str, Any]:
    async with engine.connect() as conn:
        found(await queries.get_quota(conn, namespace), _no_quota(namespace))
    await writable(ledger).record(QuotaEvent(namespace=namespace))
    log.info("quota removed", extra={"namespace": namespace})
    return {"namespace": namespace, "deleted": True}
