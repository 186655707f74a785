"""A PostgreSQL server a test may stop and start again (or start late), on its own data directory."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from devstack.embedded import EmbeddedPostgres, with_database
from shared.ledger import migrate


@dataclass
class PrivatePostgres:
    """A real PostgreSQL server with a migrated `gpushare` database; `stop()` / `start()` at will."""

    server: EmbeddedPostgres
    url: str  # the migrated database's URL (valid while the server is down, too)

    async def stop(self) -> None:
        """Fast shutdown: every session ends, the socket goes away."""
        await asyncio.to_thread(self.server.stop)

    async def start(self) -> None:
        """Start it again on the same data."""
        await asyncio.to_thread(self.server.start)


@asynccontextmanager
async def private_postgres() -> AsyncIterator[PrivatePostgres]:
    """Start a server in a fresh directory, create and migrate `gpushare`; stop and delete it at the end."""
    root = Path(tempfile.mkdtemp(prefix="gpushare-pg-private-"))
    server = EmbeddedPostgres(root / "data", cleanup="stop")
    try:
        admin_url = await asyncio.to_thread(server.start)
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute('CREATE DATABASE "gpushare"')
        finally:
            await conn.close()
        url = with_database(admin_url, "gpushare")
        await asyncio.to_thread(migrate.upgrade, url)
        yield PrivatePostgres(server, url)
    finally:
        await asyncio.to_thread(server.stop)
        shutil.rmtree(root, ignore_errors=True)
