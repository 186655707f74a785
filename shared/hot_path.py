"""The leanest ASGI path for a service's hottest POST routes, in front of its FastAPI app.

kube-scheduler calls the extender's filter, prioritize and bind for every GPU pod. FastAPI's routing, its
middleware stack and the request/response objects cost about a tenth of the extender's CPU per pod in the bind
benchmark (docs/benchmarks.md), for routes that read raw bytes and answer raw JSON anyway. `HotPath` answers
those routes itself: the body (under the same size limit and with the same 413 answer as `BodyLimitMiddleware`),
the handler, one JSON response. Everything else (other paths and methods, /openapi.json, /metrics, probes)
goes to the FastAPI app, whose routes call the same handlers, so the contract is the same either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from shared.http import too_large

log = logging.getLogger(__name__)

Handler = Callable[[bytes], Awaitable[tuple[int, bytes]]]
"""A route's work: the request body in, (HTTP status, JSON bytes) out."""

INTERNAL_ERROR = b'{"error":"internal error; see the service log"}'
TOO_DEEP = b'{"error":"request body is nested too deeply"}'


class HotPath:
    """ASGI app: POSTs to `routes` (exact paths) go straight to their handler, the rest to `app`."""

    def __init__(self, app: ASGIApp, routes: dict[str, Handler], *, max_body_bytes: int) -> None:
        self.app = app
        self.routes = routes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if handler is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body = await self._body(scope, receive, send)
        if body is None:
            return
        try:
            status, payload = await handler(body)
        except RecursionError:  # as `install_common`'s handler answers it
            log.warning("refused a request nested too deeply", extra={"path": scope.get("path")})
            status, payload = 400, TOO_DEEP
        except Exception:
            log.exception("unexpected error serving %s", scope.get("path"))
            status, payload = 500, INTERNAL_ERROR
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when it was refused (413, answered here) or the client went away."""
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await too_large(self.max_body_bytes, scope, send)
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await too_large(self.max_body_bytes, scope, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
