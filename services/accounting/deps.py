"""What accounting's routes depend on (FastAPI `Depends`): the engine and a connection, the settings, the
ledger writer, the ResourceQuota reader, and the admin token that quota writes need (an `Authorization: Bearer`
header)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from typing import Annotated, TypeVar

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.ledger.ledger import Ledger
from shared.settings import Settings

from .owners import WorkloadNames
from .resource_quotas import ResourceQuotas
from .scheduling import SchedulingWaits

log = logging.getLogger(__name__)

T = TypeVar("T")


def found(value: T | None, missing: str) -> T:
    """`value`, or 404 with `missing` as the error when there is none."""
    if value is None:
        raise HTTPException(404, missing)
    return value


def get_engine(request: Request) -> AsyncEngine:
    """The ledger database (`create_app`'s engine)."""
    return request.app.state.engine


Engine = Annotated[AsyncEngine, Depends(get_engine)]


async def get_connection(engine: Engine) -> AsyncIterator[AsyncConnection]:
    """One connection for the request's reads."""
    async with engine.connect() as conn:
        yield conn


Conn = Annotated[AsyncConnection, Depends(get_connection)]


def get_settings(request: Request) -> Settings:
    """The process's settings (`create_app`'s)."""
    return request.app.state.settings


AppSettings = Annotated[Settings, Depends(get_settings)]


def get_ledger(request: Request) -> Ledger | None:
    """The ledger writer, when this instance has one (see `writable`)."""
    return request.app.state.ledger


MaybeLedger = Annotated[Ledger | None, Depends(get_ledger)]


def writable(ledger: Ledger | None) -> Ledger:
    """The ledger writer, or 503 when this instance cannot write."""
    if ledger is None:
        raise HTTPException(503, "this accounting instance cannot write to the ledger")
    return ledger


def get_resource_quotas(request: Request) -> ResourceQuotas | None:
    """The reader of the cluster's ResourceQuotas, when this instance has Kubernetes access configured."""
    return request.app.state.resource_quotas


MaybeResourceQuotas = Annotated[ResourceQuotas | None, Depends(get_resource_quotas)]


def get_workload_names(request: Request) -> WorkloadNames:
    """What names a recorded owner (a ReplicaSet) by its workload (its Deployment)."""
    return request.app.state.workload_names


Names = Annotated[WorkloadNames, Depends(get_workload_names)]


def get_scheduling(request: Request) -> SchedulingWaits | None:
    """The pod watch that knows pending pods' creation times (None without Kubernetes access)."""
    return request.app.state.scheduling


MaybeScheduling = Annotated[SchedulingWaits | None, Depends(get_scheduling)]


bearer = HTTPBearer(auto_error=False, description="GPUSHARE_ADMIN_TOKEN, for quota changes")


def require_admin(
    request: Request,
    settings: AppSettings,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    """403 without a configured admin token; 401 without a bearer token; 403 with a wrong one (compared in
    constant time)."""
    configured = settings.admin_token.get_secret_value() if settings.admin_token else ""
    if not configured:
        raise HTTPException(403, "quota changes are disabled: no admin token is configured (GPUSHARE_ADMIN_TOKEN)")
    token = credentials.credentials.strip() if credentials is not None else ""
    if not token:
        raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.encode(), configured.encode()):
        log.warning("refused a quota change with a wrong token", extra={"path": request.url.path})
        raise HTTPException(403, "invalid token")


Admin = Depends(require_admin)
