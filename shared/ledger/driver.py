"""Hot-path statements on asyncpg itself, inside a SQLAlchemy transaction.

SQLAlchemy's execution machinery (greenlet hop, execution context, result object) costs its caller about
0.2 ms of CPU per statement over asyncpg's own, which was a fifth of the extender's and binder's time per pod
(docs/benchmarks.md, part 4). The statements that run for every pod go straight to the driver connection of
the caller's `AsyncConnection`: same connection, same transaction (SQLAlchemy still begins, commits, rolls
back and pools; the server-side BEGIN is sent before the first such statement, as SQLAlchemy sends it before
its own), and asyncpg prepares each statement once per connection and reuses it.

Errors look as they did through SQLAlchemy: a constraint violation is an `IntegrityError`, a lost connection
(or one on a server that has become read-only: a standby after a failover) an `OperationalError` with
`connection_invalidated` (the connection is invalidated, and the pool's older ones with it), any other database
error a `DBAPIError` whose text is the server's (a lock wait that ended at its deadline while the ledger's
COMMITs are held: `CommitsRefused`, naming why). `is_transient` and the callers' handlers read them unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import asyncpg
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.ledger.db import held_instead, on_read_only_server

_LOST = (
    asyncpg.PostgresConnectionError,  # SQLSTATE class 08, and "connection does not exist"
    asyncpg.exceptions.AdminShutdownError,  # 57P01: the server is shutting down, or the session was terminated
    asyncpg.exceptions.CrashShutdownError,  # 57P02
    asyncpg.exceptions.CannotConnectNowError,  # 57P03
    OSError,  # includes ConnectionError and TimeoutError
)


async def fetch(conn: AsyncConnection, sql: str, *args: Any) -> list[asyncpg.Record]:
    """Run `sql` (`$1`-style parameters) in `conn`'s transaction; its rows."""
    driver = await _driver(conn)
    try:
        return await driver.fetch(sql, *args)
    except Exception as exc:
        raise await _translated(conn, driver, exc, sql, args) from exc


async def execute_many(conn: AsyncConnection, sql: str, rows: Iterable[Sequence[Any]]) -> None:
    """Run `sql` once per row of arguments, in order, in one round trip, in `conn`'s transaction."""
    driver = await _driver(conn)
    rows = list(rows)
    try:
        await driver.executemany(sql, rows)
    except Exception as exc:
        raise await _translated(conn, driver, exc, sql, rows) from exc


async def _driver(conn: AsyncConnection) -> asyncpg.Connection:
    """The asyncpg connection under `conn`, inside `conn`'s transaction when it has one.

    SQLAlchemy's asyncpg adapter sends BEGIN lazily, with its first statement: a transaction whose statements
    all come through here would otherwise run them in autocommit, and its rollback would undo nothing. So the
    adapter is asked to begin first, as it would before a statement of its own (`tests/foundation/test_driver.py`
    holds it to that).
    """
    raw = await conn.get_raw_connection()
    adapted: Any = raw.dbapi_connection
    driver: asyncpg.Connection = raw.driver_connection  # type: ignore[assignment]
    if conn.in_transaction() and adapted._transaction is None:
        try:
            await adapted._start_transaction()
        except Exception as exc:  # the adapter's own error type, which nothing else reads
            # a connection that cannot begin is of no further use (asyncpg may even report a lost one as an
            # internal state error): dropped from the pool, and the failure reads as transient
            await _drop(conn, exc)
            raise OperationalError("BEGIN", (), exc.__cause__ or exc, connection_invalidated=True) from exc
    return driver


async def _translated(
    conn: AsyncConnection, driver: asyncpg.Connection, exc: Exception, sql: str, args: Any
) -> Exception:
    """`exc` as SQLAlchemy would have raised it; a lost connection is invalidated first."""
    if isinstance(exc, asyncpg.IntegrityConstraintViolationError):
        return IntegrityError(sql, args, exc)
    if isinstance(exc, _LOST) or driver.is_closed() or on_read_only_server(exc):
        # a lost connection, or one on a server that takes no writes (a standby after a failover): of no use
        await _drop(conn, exc)
        return OperationalError(sql, args, exc, connection_invalidated=True)
    if isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError):  # a statement error, a bad argument, ...
        # a lock wait ended at its deadline while COMMITs are held: the lock belongs to a held transaction
        return held_instead(exc, conn.sync_engine) or DBAPIError(sql, args, exc)
    return exc  # not the database's: raised as it came


async def _drop(conn: AsyncConnection, exc: BaseException) -> None:
    """Invalidate `conn` and, as SQLAlchemy does on a disconnect, every connection the pool holds from before:
    when the server restarted they are all dead, and each would otherwise fail one more transaction."""
    sync = conn.sync_connection
    if sync is not None and not sync.invalidated and sync._dbapi_connection is not None:
        sync.engine.pool._invalidate(sync._dbapi_connection, exc)  # type: ignore[arg-type]
    await conn.invalidate(exc)
