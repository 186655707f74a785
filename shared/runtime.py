"""The common shell of a service process: database, bus, outbox relay, ledger, HTTP, clean stop.

    async with ServiceRuntime("binder", settings) as rt:
        rt.spawn(consumer.run(rt.stop))
        await rt.serve(app, port=8081)      # returns when SIGTERM / SIGINT arrives

Everything started here is stopped in reverse order on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.auth import NatsAuth
from shared.events.bus import BusNames, EventBus
from shared.ledger.db import make_engine
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import OutboxRelay
from shared.settings import Settings

log = logging.getLogger(__name__)

EVENT_LOOP_ENV = "GPUSHARE_EVENT_LOOP"


def loop_factory(choice: str | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed and not refused (`GPUSHARE_EVENT_LOOP=asyncio`), else None (stock loop).

    uvloop roughly halves the per-message cost of the event loop (HTTP, NATS, asyncpg callbacks).
    """
    choice = (choice if choice is not None else os.environ.get(EVENT_LOOP_ENV, "uvloop")).strip().lower()
    if choice in ("asyncio", "stock", "default"):
        return None
    if choice != "uvloop":
        raise ValueError(f"{EVENT_LOOP_ENV} must be 'uvloop' or 'asyncio', not {choice!r}")
    try:
        import uvloop
    except ImportError:
        log.info("uvloop is not installed; using the stock asyncio event loop")
        return None
    return uvloop.new_event_loop


def run_main(main: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run(main)` on the event loop `loop_factory` chooses."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


class ServiceRuntime:
    """Connections and background tasks of one service process."""

    def __init__(self, name: str, settings: Settings, *, database: bool = True, pool_size: int = 3) -> None:
        self.name = name
        self.settings = settings
        self.database = database
        self.pool_size = pool_size
        self.stop = asyncio.Event()
        self.engine: AsyncEngine | None = None
        self.bus: EventBus | None = None
        self.relay: OutboxRelay | None = None
        self.ledger: Ledger | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def names(self) -> BusNames:
        """The stream and subject prefix in use."""
        return BusNames(self.settings.stream_name, self.settings.subject_prefix)

    async def __aenter__(self) -> ServiceRuntime:
        self.bus = await EventBus.connect(
            self.settings.require_nats_url(),
            self.names,
            name=f"gpushare-{self.name}",
            replicas=self.settings.stream_replicas,
            auth=NatsAuth.from_settings(self.settings),
        )
        if self.database:
            size = self.settings.db_pool_size or self.pool_size
            # a hard cap (no overflow): the product's connections stay a fixed number, whatever the load
            self.engine = make_engine(self.settings.require_database_url(), pool_size=size, max_overflow=0)
            self.relay = OutboxRelay(self.engine, self.bus)
            self.ledger = Ledger(self.engine, prefix=self.names.prefix, source=self.name, on_commit=self.relay.kick)
            self.spawn(self.relay.run(self.stop))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        log.info("%s started", self.name, extra={"service": self.name})
        return self

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s: %s received, stopping", self.name, sig.name)
        self.stop.set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a background task until the runtime stops; a crash in it is logged and stops the service."""
        task = asyncio.create_task(coro)

        def _done(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("%s: background task failed: %r", self.name, t.exception(), exc_info=t.exception())
                self.stop.set()

        task.add_done_callback(_done)
        self._tasks.append(task)
        return task

    async def serve(
        self,
        app: FastAPI | None,
        *,
        host: str = "0.0.0.0",
        port: int | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        also: tuple[FastAPI, int] | None = None,
    ) -> None:
        """Serve `app` (if given) until the stop event is set; HTTPS when a certificate and key are given, and then
        only to clients presenting a certificate signed by `tls_client_ca` when one is given (mutual TLS).
        `also` = (app, port): a second, plain-HTTP server (probes and metrics beside a mutual-TLS port)."""
        if app is None or port is None:
            await self.stop.wait()
            return
        servers = [_server(app, host, port, tls_cert, tls_key, tls_client_ca)]
        if also is not None:
            servers.append(_server(also[0], host, also[1], None, None, None))
        serving = [asyncio.create_task(server.serve()) for server in servers]
        log.info(
            "%s listening",
            self.name,
            extra={"service": self.name, "host": host, "port": port, "mutual_tls": bool(tls_client_ca)},
        )
        stopper = asyncio.create_task(self.stop.wait())
        await asyncio.wait({*serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*serving)
        stopper.cancel()
        self.stop.set()

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        if self.relay is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.relay.flush(), 5)
        for task in reversed(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bus is not None:
            await self.bus.close()
        if self.engine is not None:
            await self.engine.dispose()
        log.info("%s stopped", self.name, extra={"service": self.name})


def _server(
    app: FastAPI, host: str, port: int, cert: str | None, key: str | None, client_ca: str | None
) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="off",
        ssl_certfile=cert,
        ssl_keyfile=key,
        ssl_ca_certs=client_ca,
        ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
        limit_concurrency=1000,
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    return server
