"""Reads through `shared.ledger.db.reading` cost one round trip each (real PostgreSQL): no BEGIN before the
statement and no ROLLBACK when the connection goes back to the pool, which `engine.connect()` sends through
SQLAlchemy's asyncpg adapter (three round trips for a one-statement read). The hot paths' reads (the binder's, the
extender's, `Ledger.release_pod`) go through it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.ledger import driver
from shared.ledger.commit_watch import watch_of
from shared.ledger.db import make_engine, reading
from shared.ledger.ledger import Ledger


async def _sent(conn: AsyncConnection, log: list[str]) -> Any:
    """Log every query asyncpg sends on `conn`'s connection (BEGIN and ROLLBACK included) into `log`; returns the
    driver connection, to stop logging with `remove_query_logger`."""
    raw = (await conn.get_raw_connection()).driver_connection

    def logged(record: Any) -> None:
        log.append(" ".join(record.query.split()).upper())

    raw.add_query_logger(logged)
    return raw, logged


def _around(log: list[str]) -> list[str]:
    """The transaction statements among the queries logged."""
    return [q for q in log if q.startswith(("BEGIN", "ROLLBACK", "COMMIT"))]


async def test_a_read_sends_no_begin_and_no_rollback(engine: AsyncEngine) -> None:
    for connect, around in ((lambda: reading(engine), 0), (engine.connect, 2)):  # `engine.connect()` for contrast
        log: list[str] = []
        async with connect() as conn:
            raw, logged = await _sent(conn, log)
            assert (await conn.execute(text("SELECT 1"))).scalar() == 1
            assert (await driver.fetch(conn, "SELECT 2 AS n"))[0]["n"] == 2
        raw.remove_query_logger(logged)
        assert len(_around(log)) == around, log


async def test_reads_share_the_engines_pool_and_commit_watch(database_url: str) -> None:
    engine = make_engine(database_url, pool_size=1, max_overflow=0)
    try:
        async with reading(engine) as conn:
            reader_pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar()
        async with engine.begin() as conn:  # the pool's one connection, back from the read, in a transaction again
            assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar() == reader_pid
            assert (await conn.execute(text("SELECT txid_current_if_assigned() IS NULL"))).scalar() is True
            # a transaction id, kept for the rest of the transaction: the connection is out of autocommit again
            await conn.execute(text("SELECT txid_current()"))
            assert (await conn.execute(text("SELECT txid_current_if_assigned() IS NOT NULL"))).scalar() is True
        async with reading(engine) as conn:
            watch = watch_of(conn.engine)
        assert watch is not None and watch is watch_of(engine)
    finally:
        await engine.dispose()


async def test_release_pod_reads_without_a_transaction_of_its_own(database_url: str) -> None:
    """`Ledger.release_pod` of a pod without live allocations: its read, nothing around it (before: BEGIN and
    ROLLBACK, two round trips more, for every pod that ends)."""
    engine = make_engine(database_url, pool_size=1, max_overflow=0)
    log: list[str] = []
    try:
        async with engine.connect() as conn:  # the pool's one connection, logging from now on
            raw, logged = await _sent(conn, log)
        assert await Ledger(engine, prefix="t").release_pod("no-such-pod", "pod deleted") == 0
        raw.remove_query_logger(logged)
    finally:
        await engine.dispose()
    assert _around(log) == []
