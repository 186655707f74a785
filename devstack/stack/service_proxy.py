"""One address in front of a service's replicas, as a Kubernetes Service and kube-proxy give it (`gpushare up` with
`--replicas`: kube-scheduler reaches every extender replica through one URL, accounting's readers every
accounting replica).

It behaves as the real path does, read from the v1.37.2 sources:

* **Endpoints are the Ready replicas.** The EndpointSlice controller marks an endpoint ready when its pod is
  Ready (`k8s.io/endpointslice` `utils.go`, `podToEndpoint`: `ready = IsPodReady(pod) && !terminating`). Here a
  replica is Ready while its readiness URL answers 200, probed every `probe_period_s` (the kubelet's readiness
  probe); a replica whose process is gone is dropped at once, as the kubelet reports a container that is not
  running as not ready without waiting for a probe (`pkg/kubelet/status/generate.go`,
  `GenerateContainersReadyCondition`): here, at the first refused connection or failed probe.
* **Each new connection goes to one endpoint chosen at random** (`pkg/proxy/iptables/proxier.go`,
  `writeServiceToEndpointRules`: `-m statistic --mode random --probability 1/n` per endpoint). A connection
  stays with its endpoint for its life: an HTTP client that keeps its connection alive keeps talking to one
  replica until that connection breaks.
* **No retry elsewhere.** A connection whose endpoint does not answer is reset (kube-proxy rewrites the
  destination once; the client sees the failure). A Service without endpoints refuses connections (`REJECT`,
  "has no endpoints").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass, field

import httpx

log = logging.getLogger(__name__)


@dataclass
class Endpoint:
    """One replica: where it listens and the URL its readiness is read from."""

    host: str
    port: int
    ready_url: str
    ready: bool = False
    connections: int = 0  # connections handed to it so far


@dataclass
class ServiceProxy:
    """Listens on `port` and forwards each connection to a Ready endpoint chosen at random."""

    name: str
    endpoints: list[Endpoint]
    host: str = "127.0.0.1"
    port: int = 0
    probe_period_s: float = 1.0
    rng: random.Random = field(default_factory=random.Random)
    _server: asyncio.AbstractServer | None = None
    _prober: asyncio.Task[None] | None = None
    _pipes: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> ServiceProxy:
        """Probe the endpoints once, then listen."""
        await self._probe_all()
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._prober = asyncio.create_task(self._probe_forever(), name=f"{self.name}-probes")
        return self

    @property
    def address(self) -> str:
        """`host:port` of the Service."""
        return f"{self.host}:{self.port}"

    def ready_endpoints(self) -> list[Endpoint]:
        """The endpoints that take new connections now."""
        return [e for e in self.endpoints if e.ready]

    async def stop(self) -> None:
        """Stop listening, probing and forwarding."""
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_period_s)
            await self._probe_all()

    async def _probe_all(self) -> None:
        async with httpx.AsyncClient(timeout=min(1.0, self.probe_period_s)) as http:
            await asyncio.gather(*(self._probe(http, e) for e in self.endpoints))

    async def _probe(self, http: httpx.AsyncClient, endpoint: Endpoint) -> None:
        try:
            ready = (await http.get(endpoint.ready_url)).status_code == 200
        except httpx.HTTPError:
            ready = False
        self._set_ready(endpoint, ready)

    def _set_ready(self, endpoint: Endpoint, ready: bool) -> None:
        if endpoint.ready != ready:
            log.info("%s: endpoint %s:%d %s", self.name, endpoint.host, endpoint.port, "ready" if ready else "gone")
        endpoint.ready = ready

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._pipes.add(task)
        try:
            ready = self.ready_endpoints()
            if not ready:  # REJECT: the Service has no endpoints
                return
            endpoint = self.rng.choice(ready)
            endpoint.connections += 1
            try:
                up_reader, up_writer = await asyncio.open_connection(endpoint.host, endpoint.port)
            except OSError:
                self._set_ready(endpoint, False)  # the process is gone: its container is not running
                return
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            if task is not None:
                self._pipes.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream or a broken connection, then close the writing side."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
