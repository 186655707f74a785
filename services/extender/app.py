"""The HTTP face of the extender: kube-scheduler's verbs under a configurable prefix, plus inspect."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.extender import metrics
from services.extender.service import ExtenderService
from services.extender.wire import (
    BINDING_ARGS_SCHEMA,
    BINDING_RESULT_SCHEMA,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PREFIX,
    ERROR_SCHEMA,
    EXTENDER_ARGS_SCHEMA,
    FILTER_RESULT_SCHEMA,
    HOST_PRIORITY_LIST_SCHEMA,
    INSPECT_SCHEMA,
    PREEMPTION_ARGS_SCHEMA,
    PREEMPTION_RESULT_SCHEMA,
    WireError,
    dump_json,
    dump_priorities,
    load_json,
    parse_binding_args,
    parse_extender_args,
    parse_preemption_args,
)
from shared.http import BodyLimitMiddleware, install_common

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("gpushare")
    except Exception:
        return "unknown"


def _bad(request: Request, exc: WireError, error_key: bool = True) -> JSONResponse:
    log.info("rejected a malformed extender request", extra={"path": request.url.path, "problem": str(exc)})
    body: dict[str, Any] = {"error": str(exc)}
    if error_key:
        body["Error"] = str(exc)
    return JSONResponse(body, status_code=400)


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _documented(
    answer: dict[str, Any], body: dict[str, Any] | None = None, refusals: dict[int, str] | None = None
) -> dict[str, Any]:
    """Route arguments that put the wire format into /openapi.json: the JSON request body (read by the wire
    parsers, not by FastAPI), the 200 answer and each refusal ({status: description}, an `ERROR_SCHEMA` body)."""
    responses: dict[int | str, dict[str, Any]] = {200: {"description": "the answer", **_json_content(answer)}}
    for code, description in (refusals or {}).items():
        responses[code] = {"description": description, **_json_content(ERROR_SCHEMA)}
    extra = {"requestBody": {"required": True, **_json_content(body)}} if body is not None else None
    return {"response_model": None, "responses": responses, "openapi_extra": extra}


_REFUSED = {400: "the body is not what kube-scheduler sends", 413: "the body is too large"}


def _json(value: Any) -> Response:
    """A JSON answer rendered directly (FastAPI's jsonable_encoder walk costs ~10x json.dumps on big lists)."""
    return Response(dump_json(value), media_type="application/json")


def create_app(
    service: ExtenderService,
    *,
    prefix: str = DEFAULT_PREFIX,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app; `service` must be started (and closed) by the caller."""
    prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
    app = FastAPI(title="gpushare scheduler extender", version=_version())
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    install_common(app, ready=lambda: service.ready)
    router = APIRouter(prefix=prefix)

    async def timed(histogram: Any, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return await work()
        finally:
            histogram.observe(time.perf_counter() - start)

    @router.post("/filter", **_documented(FILTER_RESULT_SCHEMA, EXTENDER_ARGS_SCHEMA, _REFUSED))
    async def filter_(request: Request) -> Any:
        async def work() -> Any:
            try:
                args = parse_extender_args(load_json(await request.body()))
            except WireError as exc:
                return _bad(request, exc)
            return _json(await service.filter(args))

        return await timed(metrics.FILTER_SECONDS, work)

    @router.post("/prioritize", **_documented(HOST_PRIORITY_LIST_SCHEMA, EXTENDER_ARGS_SCHEMA, _REFUSED))
    async def prioritize(request: Request) -> Any:
        async def work() -> Any:
            try:
                args = parse_extender_args(load_json(await request.body()))
            except WireError as exc:
                return _bad(request, exc, error_key=False)
            return Response(dump_priorities(service.prioritize(args)), media_type="application/json")

        return await timed(metrics.PRIORITIZE_SECONDS, work)

    @router.post("/bind", **_documented(BINDING_RESULT_SCHEMA, BINDING_ARGS_SCHEMA, _REFUSED))
    async def bind(request: Request) -> Any:
        async def work() -> Any:
            try:
                args = parse_binding_args(load_json(await request.body()))
            except WireError as exc:
                metrics.BIND_OUTCOMES.labels(reason="invalid").inc()
                return _bad(request, exc)
            try:
                error = await service.bind(args)
            except Exception as exc:  # the ledger or bus is away: an answer, not a 500 (a retry finds any reservation)
                log.exception("bind failed unexpectedly", extra={"pod": f"{args.pod_namespace}/{args.pod_name}"})
                metrics.BIND_OUTCOMES.labels(reason="failed").inc()
                error = f"bind failed: an internal error in the gpushare extender ({type(exc).__name__}; see its log)"
            if error:
                log.info(
                    "bind refused",
                    extra={"pod": f"{args.pod_namespace}/{args.pod_name}", "node": args.node, "reason": error},
                )
            return _json({"Error": error})

        return await timed(metrics.BIND_SECONDS, work)

    @router.post("/preempt", **_documented(PREEMPTION_RESULT_SCHEMA, PREEMPTION_ARGS_SCHEMA, _REFUSED))
    async def preempt(request: Request) -> Any:
        async def work() -> Any:
            try:
                args = parse_preemption_args(load_json(await request.body()))
            except WireError as exc:
                return _bad(request, exc, error_key=False)
            return _json(service.preempt(args))

        return await timed(metrics.PREEMPT_SECONDS, work)

    @router.get("/inspect", **_documented(INSPECT_SCHEMA))
    async def inspect_all() -> Any:
        return service.inspect()

    @router.get("/inspect/{node}", **_documented(INSPECT_SCHEMA, refusals={404: "the node has no gpushare GPUs"}))
    async def inspect_node(node: str) -> Any:
        found = service.inspect(node)
        if not found["nodes"]:
            return JSONResponse({"error": f"node {node} has no gpushare GPUs"}, status_code=404)
        return found

    app.include_router(router)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    return app


def create_health_app(service: ExtenderService) -> FastAPI:
    """Only `/healthz`, `/readyz` and `/metrics` (for a plain-HTTP port beside a mutual-TLS one)."""
    app = FastAPI(title="gpushare scheduler extender (health)", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=64 * 1024)
    install_common(app, ready=lambda: service.ready)
    return app
