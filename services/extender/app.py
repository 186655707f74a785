"""The HTTP face of the extender: kube-scheduler's verbs under a configurable prefix, plus inspect."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
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
    dump_priorities,
    load_json,
    parse_binding_args,
    parse_extender_args,
    parse_preemption_args,
)
from shared.hot_path import Handler, HotPath
from shared.http import BodyLimitMiddleware, dump_json, install_common

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("gpushare")
    except Exception:
        return "unknown"


def _bad(path: str, exc: WireError, error_key: bool = True) -> tuple[int, bytes]:
    log.info("rejected a malformed extender request", extra={"path": path, "problem": str(exc)})
    body: dict[str, Any] = {"error": str(exc)}
    if error_key:
        body["Error"] = str(exc)
    return 400, dump_json(body)


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


def _answer(answer: tuple[int, bytes]) -> Response:
    status, payload = answer
    return Response(payload, status_code=status, media_type="application/json")


def verbs(service: ExtenderService, prefix: str) -> dict[str, Handler]:
    """kube-scheduler's verbs as body-in, JSON-out handlers, by full path (served by `HotPath` and by the
    FastAPI routes alike). JSON is rendered directly: FastAPI's jsonable_encoder walk costs ~10x json.dumps."""

    def verb(
        name: str,
        histogram: Any,
        parse: Callable[[dict[str, Any]], Any],
        answer: Callable[[Any], Awaitable[bytes]],
        *,
        error_key: bool = True,
        on_invalid: Callable[[], None] = lambda: None,
    ) -> tuple[str, Handler]:
        """(path, handler): parse the body (400 naming the problem when it is not what kube-scheduler sends),
        answer, time it."""
        path = f"{prefix}/{name}"

        async def handler(body: bytes) -> tuple[int, bytes]:
            start = time.perf_counter()
            try:
                try:
                    args = parse(load_json(body))
                except WireError as exc:
                    on_invalid()
                    return _bad(path, exc, error_key)
                return 200, await answer(args)
            finally:
                histogram.observe(time.perf_counter() - start)

        return path, handler

    async def filter_(args: Any) -> bytes:
        return dump_json(await service.filter(args))

    async def prioritize(args: Any) -> bytes:
        return dump_priorities(service.prioritize(args))

    async def bind(args: Any) -> bytes:
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
        return dump_json({"Error": error})

    async def preempt(args: Any) -> bytes:
        return dump_json(await service.preempt(args))

    def invalid_bind() -> None:
        metrics.BIND_OUTCOMES.labels(reason="invalid").inc()

    return dict(
        [
            verb("filter", metrics.FILTER_SECONDS, parse_extender_args, filter_),
            verb("prioritize", metrics.PRIORITIZE_SECONDS, parse_extender_args, prioritize, error_key=False),
            verb("bind", metrics.BIND_SECONDS, parse_binding_args, bind, on_invalid=invalid_bind),
            verb("preempt", metrics.PREEMPT_SECONDS, parse_preemption_args, preempt, error_key=False),
        ]
    )


def create_app(
    service: ExtenderService,
    *,
    prefix: str = DEFAULT_PREFIX,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> HotPath:
    """The extender's ASGI app: the verbs on the lean path (`HotPath`), everything else (and the same verbs, for
    /openapi.json and any other method) in FastAPI; `service` must be started (and closed) by the caller."""
    prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
    app = FastAPI(title="gpushare scheduler extender", version=_version())
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    install_common(app, ready=lambda: service.ready)
    router = APIRouter(prefix=prefix)
    handlers = verbs(service, prefix)

    @router.post("/filter", **_documented(FILTER_RESULT_SCHEMA, EXTENDER_ARGS_SCHEMA, _REFUSED))
    async def filter_(request: Request) -> Response:
        return _answer(await handlers[f"{prefix}/filter"](await request.body()))

    @router.post("/prioritize", **_documented(HOST_PRIORITY_LIST_SCHEMA, EXTENDER_ARGS_SCHEMA, _REFUSED))
    async def prioritize(request: Request) -> Response:
        return _answer(await handlers[f"{prefix}/prioritize"](await request.body()))

    @router.post("/bind", **_documented(BINDING_RESULT_SCHEMA, BINDING_ARGS_SCHEMA, _REFUSED))
    async def bind(request: Request) -> Response:
        return _answer(await handlers[f"{prefix}/bind"](await request.body()))

    @router.post("/preempt", **_documented(PREEMPTION_RESULT_SCHEMA, PREEMPTION_ARGS_SCHEMA, _REFUSED))
    async def preempt(request: Request) -> Response:
        return _answer(await handlers[f"{prefix}/preempt"](await request.body()))

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

    return HotPath(app, handlers, max_body_bytes=max_body_bytes)


def create_health_app(service: ExtenderService) -> FastAPI:
    """Only `/healthz`, `/readyz` and `/metrics` (for a plain-HTTP port beside a mutual-TLS one)."""
    app = FastAPI(title="gpushare scheduler extender (health)", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=64 * 1024)
    install_common(app, ready=lambda: service.ready)
    return app
