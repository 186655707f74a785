"""The dashboard page (`/ui`; `/` redirects to it). Not part of the OpenAPI document."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse

DASHBOARD = Path(__file__).resolve().parents[1] / "static" / "dashboard.html"

router = APIRouter(include_in_schema=False)


@router.get("/ui")
async def ui() -> HTMLResponse:
    return HTMLResponse(DASHBOARD.read_text(encoding="utf-8"))


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui")
