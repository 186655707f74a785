"""The common shell of a service process: database, bus, outbox relay, ledger, HTTP, clean stop.

    async with ServiceRuntime("binder", settings, listen=Listen(port=8081)) as rt:
        rt.spawn(consumer.run(rt.stop))
        await rt.serve(app)      # returns when SIGTERM / SIGINT arrives

With `listen`, the HTTP port serves from the start: `/healthz` answers 200 (alive) and `/readyz` 503 while the
runtime waits for NATS and PostgreSQL, with capped exponential backoff and one log line per attempt, for as long
as they are away (a service started before its servers waits instead of crash-looping). It then waits in the same
way for a ledger schema this build runs on (`shared/ledger/schema_version.py`): on an older one it says to run
`gpushare migrate`, and goes on once the schema has been migrated. `/readyz` says what it waits for.
`serve(app)` then hands the same port to the service's app. Everything started here is stopped in reverse order
on exit.

Every wait on PostgreSQL has a deadline (`GPUSHARE_DB_TIMEOUT`, `shared.ledger.deadlines`), and the runtime
watches whether the ledger can commit (`shared.ledger.commit_watch`: real commits and a probe every few seconds):
while it cannot, `/readyz` answers 503 on every port with the reason (a synchronous standby that does not
confirm, say), whatever the service's own readiness, and `ledger_metrics()` says so; both recover by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.events.auth import NatsAuth
from shared.events.bus import BusNames, EventBus
from shared.events.streams import StreamLimits
from shared.http import install_common
from shared.ledger.commit_watch import CommitWatch, watch_of
from shared.ledger.db import make_engine
from shared.ledger.deadlines import Deadlines
from shared.ledger.ledger import Ledger
from shared.ledger.migrate import history
from shared.ledger.outbox import OutboxRelay
from shared.ledger.schema_version import judge, read_state
from shared.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

EVENT_LOOP_ENV = "GPUSHARE_EVENT_LOOP"


@dataclass(frozen=True)
class Listen:
    """Where a service serves HTTP (HTTPS with a certificate and key; then, with `tls_client_ca`, only to
    clients presenting a certificate that CA signed: mutual TLS)."""

    host: str = "0.0.0.0"
    port: int = 8080
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff between attempts to reach a server."""

    first_s: float = 0.5
    max_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return min(self.max_s, self.first_s * 2 ** (attempt - 1))


class StartupAborted(SystemExit):
    """SIGTERM / SIGINT arrived while the service was still waiting for its servers (a clean exit)."""


class SchemaNotReady(RuntimeError):
    """The ledger schema is one this build does not run on (the message says why and what fixes it)."""


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (the runtime has its own), saying when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the runtime's handlers set `stop`, which stops the server
        yield

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.up.set()


class _Switchable:
    """An ASGI app that forwards to whichever app it holds: the waiting page first, the service's app later.
    While `not_ready()` names a reason, `/readyz` answers 503 with it instead."""

    def __init__(self, app: ASGIApp, not_ready: Callable[[], str | None] = lambda: None) -> None:
        self.app = app
        self.not_ready = not_ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/readyz" and (reason := self.not_ready()) is not None:
            await JSONResponse({"status": "not ready", "reason": reason}, status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)


STARTING = "starting"
"""/healthz's role while a service waits for its servers (it holds no other role yet)."""


def waiting_app(name: str, waiting_for: Callable[[], str | None] = lambda: None) -> FastAPI:
    """What a service serves while it waits for NATS, PostgreSQL and its schema: alive, not ready (and why), role
    `starting`."""
    app = FastAPI(title=f"gpushare {name} (starting)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/readyz", include_in_schema=False)  # before install_common's: the first route that matches answers
    async def readyz() -> JSONResponse:
        return JSONResponse({"status": "not ready", "reason": waiting_for() or "starting"}, status_code=503)

    install_common(app, ready=lambda: False, role=lambda: {"role": STARTING})
    return app


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

    def __init__(
        self,
        name: str,
        settings: Settings,
        *,
        database: bool = True,
        pool_size: int = 3,
        listen: Listen | None = None,
        probes: Listen | None = None,
        extra: tuple[Listen, ...] = (),
        backoff: Backoff = Backoff(),
    ) -> None:
        self.name = name
        self.settings = settings
        self.database = database
        self.pool_size = pool_size
        if (probes is not None or extra) and listen is None:
            raise ValueError("probes and extra ports are served beside the main port: give `listen` too")
        self.listen = listen
        self.probes = probes
        self.extra = extra
        self.backoff = backoff
        self.stop = asyncio.Event()
        self.engine: AsyncEngine | None = None
        self.bus: EventBus | None = None
        self.relay: OutboxRelay | None = None
        self.ledger: Ledger | None = None
        self.commits: CommitWatch | None = None  # whether the ledger can commit (`commit_watch`)
        self.waiting_for: str | None = None  # what start-up waits for now (the waiting app's /readyz says it)
        self._tasks: list[asyncio.Task[Any]] = []
        self._http: list[tuple[_Server, _Switchable, asyncio.Task[None]]] = []
        self._switches: dict[int, _Switchable] = {}  # id(Listen) -> the switch serving it

    @property
    def names(self) -> BusNames:
        """The stream and subject prefix in use."""
        return BusNames(self.settings.stream_name, self.settings.subject_prefix)

    async def __aenter__(self) -> ServiceRuntime:
        nats_url = self.settings.require_nats_url()
        database_url = self.settings.require_database_url() if self.database else None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            for where in (self.listen, self.probes, *self.extra):
                if where is not None:
                    await self._start_http(waiting_app(self.name, lambda: self.waiting_for), where)
            self.bus = await self._until_connected(
                "NATS",
                lambda: EventBus.connect(
                    nats_url,
                    self.names,
                    name=f"gpushare-{self.name}",
                    # the ledger writers manage the streams (their NATS users may create and update them); a node
                    # agent, without a database, only reads their state and never changes their replicas
                    replicas=self.settings.stream_replicas if self.database else 1,
                    limits=StreamLimits.from_settings(self.settings),
                    auth=NatsAuth.from_settings(self.settings),
                ),
            )
            if database_url is not None:
                size = self.settings.db_pool_size or self.pool_size
                # a hard cap (no overflow): the product's connections stay a fixed number, whatever the load
                self.engine = make_engine(
                    database_url,
                    pool_size=size,
                    max_overflow=0,
                    idle_transaction_timeout_s=self.settings.db_idle_transaction_timeout,
                    deadlines=Deadlines.from_seconds(self.settings.db_timeout),
                )
                await self._until_connected("PostgreSQL", self._probe_database)
                await self._until_connected("the ledger schema", self._check_schema)
                self.relay = OutboxRelay(self.engine, self.bus)
                self.ledger = Ledger(self.engine, prefix=self.names.prefix, source=self.name, on_commit=self.relay.kick)
                self.spawn(self.relay.run(self.stop))
                self.commits = watch_of(self.engine)
                assert self.commits is not None
                self.spawn(self.commits.run(self.stop))
        except BaseException:
            await self.__aexit__()
            raise
        log.info("%s started", self.name, extra={"service": self.name})
        return self

    def ledger_not_ready(self) -> str | None:
        """Why the ledger cannot commit now (None while it can, or without a database)."""
        return self.commits.reason if self.commits is not None else None

    def ledger_metrics(self) -> Collector:
        """The commit watch's metrics (`gpushare_ledger_can_commit`, ...), for the service's registry."""
        if self.commits is None:
            raise RuntimeError(f"{self.name} has no database")
        return self.commits.collector()

    async def _probe_database(self) -> None:
        assert self.engine is not None
        async with self.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def _check_schema(self) -> None:
        """Return when this build runs on the database's schema, else raise SchemaNotReady saying why."""
        assert self.engine is not None
        async with self.engine.connect() as conn:
            verdict = judge(await read_state(conn, history()), history())
        if not verdict.runs:
            raise SchemaNotReady(verdict.reason)
        log.info("%s: %s", self.name, verdict.reason, extra={"service": self.name})

    async def _until_connected(self, what: str, connect: Callable[[], Awaitable[T]]) -> T:
        """`connect()`, retried with capped backoff until it succeeds (one log line per attempt) or the
        service is asked to stop (then `StartupAborted`)."""
        attempt, started = 0, time.monotonic()
        while True:
            try:
                result = await connect()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                attempt += 1
                delay = self.backoff.delay(attempt)
                self.waiting_for = f"waiting for {what}: {_reason(exc)}"
                log.warning(
                    "%s: waiting for %s (attempt %d, %.0fs so far): %s; next try in %.1fs",
                    self.name,
                    what,
                    attempt,
                    time.monotonic() - started,
                    _reason(exc),
                    delay,
                    extra={"service": self.name, "attempt": attempt},
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), delay)
                if self.stop.is_set():
                    raise StartupAborted(0) from None
                continue
            self.waiting_for = None
            if attempt:
                log.info("%s: connected to %s after %d attempts", self.name, what, attempt + 1)
            return result

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

    async def _start_http(self, app: ASGIApp, listen: Listen) -> None:
        switch = _Switchable(app, self.ledger_not_ready)
        config = uvicorn.Config(
            switch,
            host=listen.host,
            port=listen.port,
            log_config=None,
            access_log=False,
            lifespan="off",
            ssl_certfile=listen.tls_cert,
            ssl_keyfile=listen.tls_key,
            ssl_ca_certs=listen.tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if listen.tls_client_ca else ssl.CERT_NONE,
            limit_concurrency=1000,
            timeout_keep_alive=30,
        )
        server = _Server(config)
        task = asyncio.create_task(server.serve())
        up = asyncio.create_task(server.up.wait())
        await asyncio.wait({task, up}, return_when=asyncio.FIRST_COMPLETED)
        up.cancel()
        if not server.started:  # the port is taken, say: uvicorn logged why
            with contextlib.suppress(BaseException):
                await task
            raise SystemExit(f"{self.name}: cannot listen on {listen.host}:{listen.port}")
        self._http.append((server, switch, task))
        self._switches[id(listen)] = switch
        log.info(
            "%s listening",
            self.name,
            extra={
                "service": self.name,
                "host": listen.host,
                "port": listen.port,
                "mutual_tls": bool(listen.tls_client_ca),
            },
        )

    async def serve(
        self, app: ASGIApp | None, *, probes_app: ASGIApp | None = None, extra_apps: tuple[ASGIApp, ...] = ()
    ) -> None:
        """Hand the ports that have answered since start to the service: `app` on `listen`, `probes_app` (only
        /healthz, /readyz and /metrics, for probes beside a mutual-TLS port) on `probes`, `extra_apps[i]` on
        `extra[i]`; return when the stop event is set (or a server ended)."""
        for where, served in ((self.listen, app), (self.probes, probes_app), *zip(self.extra, extra_apps, strict=True)):
            switch = self._switches.get(id(where)) if where is not None else None
            if switch is not None and served is not None:
                switch.app = served
        if not self._http:
            await self.stop.wait()
            return
        stopper = asyncio.create_task(self.stop.wait())
        await asyncio.wait({*(task for _, _, task in self._http), stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        self.stop.set()
        await self._stop_http()

    async def _stop_http(self) -> None:
        servers, self._http = self._http, []
        for server, _, _ in servers:
            server.should_exit = True
        for _, _, task in servers:
            with contextlib.suppress(Exception):
                await task

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await self._stop_http()
        if self.relay is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.relay.flush(), 5)
        for task in reversed(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bus is not None:
            await self.bus.close()
        if self.commits is not None:
            await self.commits.close()
        if self.engine is not None:
            await self.engine.dispose()
        log.info("%s stopped", self.name, extra={"service": self.name})


def _reason(exc: BaseException) -> str:
    """A short reason for a failed connection attempt (the driver's text, without a traceback)."""
    if isinstance(exc, SchemaNotReady):
        return str(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
