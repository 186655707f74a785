"""The Service stand-in of `gpushare up --replicas` (`devstack/stack/service_proxy.py`) behaves as a Service with
kube-proxy: new connections go to Ready endpoints at random, a connection stays with its endpoint, an endpoint
whose process is gone stops getting connections, and a Service without endpoints refuses."""

from __future__ import annotations

import asyncio
import contextlib
import random

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from devstack.embedded import free_port
from devstack.stack.service_proxy import Endpoint, ServiceProxy
from tests.waiting import eventually


class Replica:
    """A small HTTP server answering its own name (and /readyz while `ready`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.ready = True
        app = FastAPI()
        app.get("/who")(lambda: {"name": self.name})
        app.get("/readyz")(self._readyz)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None))
        self.task: asyncio.Task[None] | None = None

    async def _readyz(self):  # type: ignore[no-untyped-def]
        from fastapi.responses import JSONResponse

        return JSONResponse({}, status_code=200 if self.ready else 503)

    async def start(self) -> Replica:
        self.task = asyncio.create_task(self.server.serve())
        await eventually(lambda: self.server.started, what=f"replica {self.name} listening", within=10, interval=0.02)
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task

    def endpoint(self) -> Endpoint:
        return Endpoint("127.0.0.1", self.port, f"http://127.0.0.1:{self.port}/readyz")


async def _who(url: str) -> str:
    async with httpx.AsyncClient(timeout=3) as http:  # a new connection per call
        return (await http.get(url + "/who")).json()["name"]


async def test_connections_spread_over_ready_replicas_and_leave_one_that_died() -> None:
    a, b = await Replica("a").start(), await Replica("b").start()
    # the probe's timeout is its period: 1 s leaves room for replicas sharing this test's event loop on a busy machine
    proxy = await ServiceProxy("svc", [a.endpoint(), b.endpoint()], probe_period_s=1.0, rng=random.Random(1)).start()
    url = f"http://{proxy.address}"
    try:
        seen = [await _who(url) for _ in range(40)]
        assert set(seen) == {"a", "b"} and 8 <= seen.count("a") <= 32  # random: about half each

        async with httpx.AsyncClient(timeout=3) as kept:  # one kept-alive connection: one replica
            first = (await kept.get(url + "/who")).json()["name"]
            assert {(await kept.get(url + "/who")).json()["name"] for _ in range(10)} == {first}

        b.ready = False  # not Ready: no new connections, once a probe has seen it
        await eventually(lambda: not proxy.endpoints[1].ready, what="the proxy to take b out", within=10)
        assert {await _who(url) for _ in range(10)} == {"a"}
        b.ready = True
        await eventually(lambda: proxy.endpoints[1].ready, what="the proxy to take b back", within=10)

        await a.stop()  # the process is gone: at most one connection fails, then it is no endpoint
        failures = 0
        for _ in range(20):
            try:
                assert await _who(url) == "b"
            except httpx.HTTPError:
                failures += 1
        assert failures <= 1 and [e.ready for e in proxy.endpoints] == [False, True]

        await b.stop()  # no endpoints: refused
        await asyncio.sleep(0.5)
        with pytest.raises(httpx.HTTPError):
            await _who(url)
    finally:
        await proxy.stop()
        await a.stop()
        await b.stop()
