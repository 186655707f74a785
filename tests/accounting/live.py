"""Accounting's real app served by uvicorn on a real port, in a thread with its own event loop and engine."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import uvicorn

from devstack.embedded import free_port
from services.accounting.api import create_app
from services.accounting.metrics import AccountingMetrics
from shared.ledger.db import make_engine
from shared.ledger.ledger import Ledger
from shared.settings import Settings


class LiveServer:
    """Accounting's app served by uvicorn in a thread with its own event loop and engine (on `host`)."""

    def __init__(self, database_url: str, settings: Settings, host: str = "127.0.0.1", scheduling: Any = None) -> None:
        self.host = host
        self.scheduling = scheduling  # what knows pending pods' waits (`scheduling.SchedulingWaits`), if any
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.database_url = database_url
        self.settings = settings
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            engine = make_engine(self.database_url, pool_size=4)
            ledger = Ledger(engine, prefix=self.settings.subject_prefix, source="live-test")
            app = create_app(
                engine, self.settings, ledger=ledger, metrics=AccountingMetrics(), scheduling=self.scheduling
            )
            config = uvicorn.Config(app, host=self.host, port=self.port, log_config=None, access_log=False)
            self.server = uvicorn.Server(config)
            try:
                await self.server.serve()
            finally:
                await engine.dispose()

        asyncio.run(main())

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise TimeoutError("the live accounting server did not start")

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(timeout=10)
