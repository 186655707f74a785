"""Real servers for every test run.

PostgreSQL and NATS are the ones named by GPUSHARE_TEST_DATABASE_URL / GPUSHARE_TEST_NATS_URL when
set, otherwise throwaway embedded servers. Each run gets its own database and each test its own
stream and subject prefix, so runs and tests never collide.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.embedded import EmbeddedNats, EmbeddedPostgres, with_database
from shared.events.bus import BusNames, EventBus
from shared.ledger import migrate
from shared.ledger.db import make_engine

RUN_ID = uuid.uuid4().hex[:8]
LEDGER_TABLES = (
    "allocation_parts",
    "allocations",
    "gpus",
    "nodes",
    "quotas",
    "applied_events",
    "usage_samples",
    "outbox",
    "claim_holds",
)


def _run(coro):  # type: ignore[no-untyped-def]
    """Run a coroutine from sync fixture code, even if an event loop is running in this thread."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _admin(server_url: str, sql: str) -> None:
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def create_database(server_url: str, name: str) -> str:
    """Create a fresh, migrated database on the server; returns its URL."""
    _run(_admin(server_url, f'CREATE DATABASE "{name}"'))
    url = with_database(server_url, name)
    migrate.upgrade(url)
    return url


def drop_database(server_url: str, name: str) -> None:
    """Drop a test database, disconnecting whoever is still on it."""
    _run(_admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def pg_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL of a real PostgreSQL server's maintenance database."""
    configured = os.environ.get("GPUSHARE_TEST_DATABASE_URL")
    if configured:
        yield configured
        return
    # not under pytest's numbered temp dirs: another pytest run may prune those while this one runs
    server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="gpushare-pg-")) / "data", cleanup="delete")
    yield server.start()
    server.stop()


@pytest.fixture(scope="session")
def database_url(pg_server_url: str) -> Iterator[str]:
    """A migrated database private to this test run."""
    name = f"gpushare_test_{RUN_ID}"
    url = create_database(pg_server_url, name)
    yield url
    drop_database(pg_server_url, name)


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL of a real NATS server with JetStream."""
    configured = os.environ.get("GPUSHARE_TEST_NATS_URL")
    if configured:
        yield configured
        return
    data_dir = Path(tempfile.mkdtemp(prefix="gpushare-nats-"))
    server = EmbeddedNats(data_dir)
    yield server.start()
    server.stop()
    shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on the run's database, with the ledger tables emptied first."""
    eng = make_engine(database_url, pool_size=5)
    async with eng.begin() as conn:
        await conn.execute(text(f"TRUNCATE {', '.join(LEDGER_TABLES)} RESTART IDENTITY CASCADE"))
    yield eng
    await eng.dispose()


@pytest.fixture
def bus_names() -> BusNames:
    """A stream and subject prefix private to one test."""
    tag = uuid.uuid4().hex[:10]
    return BusNames(stream=f"GPUSHARE_T{tag}", prefix=f"gst{tag}")


@pytest.fixture
async def bus(nats_url: str, bus_names: BusNames) -> AsyncIterator[EventBus]:
    """A connected bus with this test's own streams (deleted afterwards)."""
    connected = await EventBus.connect(nats_url, bus_names, name="gpushare-test")
    yield connected
    await connected.delete_streams()
    await connected.close()
