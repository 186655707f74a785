"""A TLS-terminating reverse proxy in front of the real kube-apiserver that can make it slow and throttling.

Clients (the binder, via a kubeconfig whose `server` is the proxy) talk HTTPS to the proxy, which serves the
apiserver's own certificate and forwards every request to the apiserver. While `pressure` is on, every request
waits a random 300-500 ms (as on an overloaded apiserver) and a seeded fraction of the short requests is answered
`429 Too Many Requests` with `Retry-After: 1`, as the apiserver's max-in-flight / priority-and-fairness filters
do: half of them with the plain-text body of 1.20's filter, half with a JSON `Status` (`reason: TooManyRequests`,
`details.retryAfterSeconds`), the shape client libraries parse. Long-running requests (watches) are exempt from
the limiter, as in the apiserver, and are streamed through chunk by chunk (only their start is delayed).

    proxy = ThrottleProxy(cluster.server_url, cert_file, key_file)
    url = await proxy.start()
    proxy.pressure = Pressure(delay_s=(0.3, 0.5), reject_fraction=0.3)
    ...
    proxy.pressure = None
    await proxy.stop()
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
TOO_MANY_REQUESTS_TEXT = "Too many requests, please try again later.\n"


@dataclass(frozen=True)
class Pressure:
    """How the proxy mistreats requests: a uniform delay in `delay_s` for every request, and 429 for
    `reject_fraction` of the short (non-watch) ones, advising `retry_after_s`."""

    delay_s: tuple[float, float] = (0.3, 0.5)
    reject_fraction: float = 0.3
    retry_after_s: int = 1


def is_long_running(request: web.BaseRequest) -> bool:
    """Watches (`?watch=true` or `/watch/` paths): exempt from the apiserver's in-flight limits."""
    return request.query.get("watch", "").lower() in ("true", "1") or "/watch/" in request.path


def too_many_requests(retry_after_s: int, as_status: bool) -> web.Response:
    """The 429 an overloaded apiserver answers: plain text (1.20's max-in-flight filter) or a JSON Status."""
    headers = {"Retry-After": str(retry_after_s), "X-Content-Type-Options": "nosniff"}
    if not as_status:
        return web.Response(status=429, text=TOO_MANY_REQUESTS_TEXT, content_type="text/plain", headers=headers)
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Too many requests, please try again later.",
        "reason": "TooManyRequests",
        "details": {"retryAfterSeconds": retry_after_s},
        "code": 429,
    }
    return web.Response(status=429, text=json.dumps(body), content_type="application/json", headers=headers)


class ThrottleProxy:
    """An HTTPS reverse proxy to `upstream` (the apiserver), serving `cert_file`/`key_file`; `pressure` (None:
    pass everything through untouched) can be changed at any time. `counts` tallies what it did: `requests`,
    `watches`, `delayed`, `rejected`, `upstream_errors`; `in_flight` is the number of requests it holds now and
    `peak_in_flight` the most it held at once."""

    def __init__(self, upstream: str, cert_file: Path, key_file: Path, *, seed: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self.cert_file = cert_file
        self.key_file = key_file
        self.pressure: Pressure | None = None
        self.counts: Counter[str] = Counter()
        self.in_flight = 0
        self.peak_in_flight = 0
        self._rng = random.Random(seed)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1") -> str:
        """Listen on a free port of `host`; returns the proxy's https:// URL."""
        server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ssl.load_cert_chain(self.cert_file, self.key_file)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            auto_decompress=False,
            connector=aiohttp.TCPConnector(ssl=False, limit=0),
        )
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        # stop() cuts open watches after 1 s instead of waiting the default 60 s for them to end
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0, ssl_context=server_ssl)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"https://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        """Close the listener, the open streams and the upstream connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.counts["requests"] += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._throttled(request)
        finally:
            self.in_flight -= 1

    async def _throttled(self, request: web.Request) -> web.StreamResponse:
        pressure = self.pressure
        long_running = is_long_running(request)
        self.counts["watches"] += long_running
        if pressure is not None:
            self.counts["delayed"] += 1
            await asyncio.sleep(self._rng.uniform(*pressure.delay_s))
            if not long_running and self._rng.random() < pressure.reject_fraction:
                self.counts["rejected"] += 1
                return too_many_requests(pressure.retry_after_s, as_status=self.counts["rejected"] % 2 == 0)
        return await self._pass_through(request)

    async def _pass_through(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP)
        body = await request.read()
        try:
            upstream = await self._session.request(
                request.method,
                self.upstream + request.rel_url.raw_path_qs,
                headers=headers,
                data=body or None,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError) as exc:
            self.counts["upstream_errors"] += 1
            return web.Response(status=502, text=f"apiserver unreachable: {exc!r}\n")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=_copy(upstream))
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():  # watch events go out as they come
                await response.write(chunk)
            await response.write_eof()
            return response


def _copy(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    """The upstream reply's end-to-end headers (repeated ones kept)."""
    return CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP)
