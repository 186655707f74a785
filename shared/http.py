"""HTTP plumbing every service's FastAPI app shares: health, readiness, metrics, errors, limits."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from pydantic_core import PydanticSerializationError, to_json
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.ledger.deadlines import LedgerCannotCommit

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413 before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes, scope, send)
            return
        seen = 0
        refused = False

        async def limited_receive():  # type: ignore[no-untyped-def]
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if not refused:  # answered here: a framework that catches the error below cannot turn it
                        refused = True  # into its own 400 (FastAPI does for the bodies it parses)
                        await too_large(self.max_bytes, scope, send)
                    raise _BodyTooLarge
            return message

        async def guarded_send(message):  # type: ignore[no-untyped-def]
            if not refused:
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            if not refused:
                await too_large(self.max_bytes, scope, send)


class _BodyTooLarge(Exception):
    pass


async def too_large(limit: int, scope: Scope, send: Send) -> None:
    """Answer 413 with a JSON body naming the limit (and log it)."""
    log.warning("refused an oversized request body", extra={"path": scope.get("path"), "limit": limit})
    response = JSONResponse({"error": f"request body larger than {limit} bytes"}, status_code=413)
    await response(scope, _empty_receive, send)


async def _empty_receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


async def exposition(registry: Collector) -> AsyncIterator[bytes]:
    """The registry in Prometheus' text format (the bytes of `generate_latest`), one metric family at a time:
    accounting's per-GPU families are 40,000 samples each at 5,000 nodes, and a scrape that rendered the whole
    page at once held every family, every line and the page twice over."""
    for family in registry.collect():
        yield generate_latest(_OneFamily(family))


class _OneFamily(Collector):
    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterable[Metric]:
        return (self.family,)


def dump_json(value: Any) -> bytes:
    """JSON bytes exactly as FastAPI's JSONResponse renders plain JSON values (compact, UTF-8).

    Rendered by pydantic-core (Rust, ~3x `json.dumps` on a 5,000-name filter answer): the same bytes for the
    strings, integers, booleans, nulls, lists and dicts the services answer with (it would write a float
    NaN as null, but no answer of theirs holds a float). Whatever it refuses goes through `json.dumps`.
    """
    try:
        return to_json(value)
    except (PydanticSerializationError, ValueError):
        return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


ACTIVE = "active"
"""The role of a replica that does all of its service's work (every extender, accounting and node agent)."""


def active_role() -> dict[str, object]:
    """/healthz's role of a process without leader election."""
    return {"role": ACTIVE}


def install_common(
    app: FastAPI,
    *,
    ready: Callable[[], bool] = lambda: True,
    registry: CollectorRegistry = REGISTRY,
    role: Callable[[], Mapping[str, object]] = active_role,
) -> None:
    """Add `/healthz`, `/readyz`, `/metrics` and JSON error handlers (4xx with a reason, never a
    traceback; a write while the ledger cannot commit is answered 503 saying why; an unexpected error is logged
    and answered 500 with a generic JSON body). `/healthz` also says
    which role the process holds (`role()`: `{"role": "active"}`, or a leader election's `leader` / `standby`
    with its lease and holder)."""

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, object]:
        return {"status": "ok", **role()}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        ok = ready()
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> StreamingResponse:
        # `?name[]=a&name[]=b` keeps only those samples, as prometheus_client's own exporters do: names are
        # sample names (`x_count` of a histogram `x`, `y_total` of a counter `y`); families of custom
        # collectors, which declare no names up front, are left out of a filtered page.
        names = request.query_params.getlist("name[]")
        chosen = registry.restricted_registry(names) if names else registry
        return StreamingResponse(exposition(chosen), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {"field": ".".join(str(p) for p in err.get("loc", ())), "problem": err.get("msg", "invalid")}
            for err in exc.errors()[:20]
        ]
        log.info("rejected an invalid request", extra={"path": request.url.path, "problems": problems[:5]})
        return JSONResponse({"error": "invalid request", "details": problems}, status_code=422)

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        log.warning("refused a request nested too deeply", extra={"path": request.url.path})
        return JSONResponse({"error": "request body is nested too deeply"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(LedgerCannotCommit)
    async def _cannot_commit(request: Request, exc: LedgerCannotCommit) -> JSONResponse:
        log.warning("could not write to the ledger serving %s: %s", request.url.path, exc)
        return JSONResponse({"error": str(exc)}, status_code=503)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return JSONResponse({"error": "internal error; see the service log"}, status_code=500)
