"""Path and query parameters of accounting's REST API, validated by FastAPI, and time ranges."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from fastapi import HTTPException, Query
from fastapi import Path as PathParam

from .schemas import STATE_NAMES

NAMESPACE_RE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
NAME_RE = r"^[a-zA-Z0-9]([-a-zA-Z0-9_.]{0,251}[a-zA-Z0-9])?$"
DEFAULT_WINDOW = timedelta(days=7)
MAX_PAGE = 1000

Namespace = Annotated[str, PathParam(pattern=NAMESPACE_RE, description="Kubernetes namespace")]
Name = Annotated[str, PathParam(pattern=NAME_RE)]
NsFilter = Annotated[str | None, Query(pattern=NAMESPACE_RE, description="only this namespace")]
Since = Annotated[datetime | None, Query(description="range start (ISO 8601; naive means UTC)")]
Until = Annotated[datetime | None, Query(description="range end (ISO 8601; naive means UTC; default now)")]
StateFilter = Literal[(*STATE_NAMES, "live")]  # type: ignore[valid-type]


def _utc(ts: datetime | None) -> datetime | None:
    if ts is None:
        return None
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def time_range(
    since: datetime | None, until: datetime | None, *, default_window: bool
) -> tuple[datetime | None, datetime | None]:
    """Normalise a time range (to UTC; with `default_window`, the last 7 days unless given); 422 when it is
    backwards or out of bounds."""
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


def window(since: datetime | None, until: datetime | None) -> tuple[datetime, datetime]:
    """`time_range` with the default window: both ends known."""
    since, until = time_range(since, until, default_window=True)
    assert since is not None and until is not None
    return since, until
