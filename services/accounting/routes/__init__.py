"""Accounting's REST API, one router per area (`create_app` includes them all)."""

from __future__ import annotations

from fastapi import APIRouter

from . import allocations, cluster, dashboard, quotas, usage

ROUTERS: tuple[APIRouter, ...] = (cluster.router, allocations.router, usage.router, quotas.router, dashboard.router)
