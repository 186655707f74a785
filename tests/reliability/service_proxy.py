"""A Service's address as kube-proxy makes it, in front of a rolling set of local replicas.

Mirrors kube-proxy's iptables mode (k8s.io/kubernetes v1.37.2, pkg/proxy/iptables/proxier.go,
`writeServiceToEndpointRules`): each new TCP connection goes to one of the ready endpoints chosen at random
(`-m statistic --mode random`); an endpoint taken out (its pod not ready, or terminating) gets no new
connections, while connections already made to it (conntrack) carry on until either side closes them.

    proxy = ServiceProxy()
    port = await proxy.start()          # kube-scheduler's extender URL points here
    proxy.add(12345); proxy.remove(12346)
    await proxy.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import random


class ServiceProxy:
    """TCP on 127.0.0.1:`port`, each connection piped to a random ready endpoint (a local port)."""

    def __init__(self, port: int = 0, seed: int = 0) -> None:
        self.port = port
        self.endpoints: list[int] = []
        self.connections = 0
        self.refused = 0  # connections that found no ready endpoint (closed at once, as a Service without any)
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen; returns the port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def add(self, port: int) -> None:
        """An endpoint became ready."""
        if port not in self.endpoints:
            self.endpoints.append(port)

    def remove(self, port: int) -> None:
        """An endpoint is no longer ready (new connections avoid it; open ones carry on)."""
        if port in self.endpoints:
            self.endpoints.remove(port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if not self.endpoints:
            self.refused += 1
            writer.close()
            return
        port = self._rng.choice(self.endpoints)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            self.refused += 1
            writer.close()
            return
        pipes = [asyncio.create_task(_pipe(reader, up_writer)), asyncio.create_task(_pipe(up_reader, writer))]
        self._pipes.update(pipes)
        try:
            await asyncio.gather(*pipes, return_exceptions=True)  # each direction until its sender closes
        finally:
            for task in pipes:
                task.cancel()
                self._pipes.discard(task)
            for w in (writer, up_writer):
                w.close()

    async def stop(self) -> None:
        """Stop listening and close every piped connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.write_eof()
