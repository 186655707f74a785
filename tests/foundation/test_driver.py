"""Statements sent to asyncpg directly (`shared.ledger.driver`) behave as SQLAlchemy's own: inside the caller's
transaction, rolled back with it, and failing with the exceptions the rest of the code reads (real PostgreSQL)."""

from __future__ import annotations

import uuid

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.events.catalogue import BoundEvent
from shared.ledger import driver, outbox
from shared.ledger.db import is_transient

_COUNT = "SELECT count(*) AS n FROM outbox WHERE event_id = $1"


class _Abort(Exception):
    pass


def _event() -> BoundEvent:
    return BoundEvent(allocation_id=uuid.uuid4(), pod_uid=str(uuid.uuid4()), node="node-a", source="test")


async def _staged(engine: AsyncEngine, event_id: uuid.UUID) -> int:
    async with engine.connect() as conn:
        return int((await driver.fetch(conn, _COUNT, event_id))[0]["n"])


async def test_driver_statements_roll_back_with_the_transaction(engine: AsyncEngine) -> None:
    """The adapter begins lazily, with its own first statement: without an explicit begin, a transaction made
    only of driver statements ran them in autocommit and its rollback kept them."""
    event = _event()
    with pytest.raises(_Abort):
        async with engine.begin() as conn:
            await outbox.stage(conn, "t", event)  # the transaction's first statement
            raise _Abort
    assert await _staged(engine, event.event_id) == 0

    async with engine.begin() as conn:
        await outbox.stage(conn, "t", event)
    assert await _staged(engine, event.event_id) == 1


async def test_driver_and_sqlalchemy_statements_share_one_transaction(engine: AsyncEngine) -> None:
    event = _event()
    async with engine.begin() as conn:
        await outbox.stage(conn, "t", event)
        seen = await conn.execute(text("SELECT count(*) FROM outbox WHERE event_id = :e"), {"e": event.event_id})
        assert seen.scalar() == 1
        rows = await driver.fetch(conn, "SELECT txid_current_if_assigned() AS x")
        assert rows[0]["x"] is not None  # the insert made this one transaction, seen from both sides


async def test_a_constraint_violation_is_an_integrity_error(engine: AsyncEngine) -> None:
    event = _event()
    async with engine.begin() as conn:
        await outbox.stage(conn, "t", event)
    with pytest.raises(IntegrityError) as caught:
        async with engine.begin() as conn:
            await outbox.stage(conn, "t", event)
    assert outbox.is_repeat_of_staged_event(caught.value)
    assert not is_transient(caught.value)
    assert await _staged(engine, event.event_id) == 1


async def test_a_statement_error_is_not_transient(engine: AsyncEngine) -> None:
    with pytest.raises(DBAPIError) as caught:
        async with engine.connect() as conn:
            await driver.fetch(conn, "SELECT no_such_column FROM outbox")
    assert "no_such_column" in str(caught.value)
    assert not is_transient(caught.value)


async def _pid(conn: AsyncConnection) -> int:
    return int((await driver.fetch(conn, "SELECT pg_backend_pid() AS pid"))[0]["pid"])


async def _terminate(database_url: str, *pids: int) -> None:
    admin = await asyncpg.connect(database_url)
    try:
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()


async def _stages_once_more(engine: AsyncEngine) -> None:
    """The next transaction works, on its first try."""
    event = _event()
    async with engine.begin() as conn:
        await outbox.stage(conn, "t", event)
    assert await _staged(engine, event.event_id) == 1


async def test_a_lost_connection_is_transient_and_leaves_the_pool(engine: AsyncEngine, database_url: str) -> None:
    """A connection the server ended is invalidated: the error reads as transient, and the next transaction
    gets a working connection instead of the dead one."""
    with pytest.raises(OperationalError) as caught:
        async with engine.begin() as conn:
            await _terminate(database_url, await _pid(conn))
            await driver.fetch(conn, "SELECT 1")
    assert caught.value.connection_invalidated
    assert is_transient(caught.value)
    await _stages_once_more(engine)


async def test_a_connection_lost_before_begin_is_transient(engine: AsyncEngine, database_url: str) -> None:
    """The BEGIN sent for the driver fails like a statement would: the adapter's own error type (which
    `is_transient` does not know) came out unconverted, and the dead connection stayed in the pool."""
    with pytest.raises(OperationalError) as caught:
        async with engine.connect() as conn:
            await _terminate(database_url, await _pid(conn))
            async with conn.begin():
                await outbox.stage(conn, "t", _event())  # the BEGIN goes first, on a dead connection
    assert caught.value.connection_invalidated
    assert is_transient(caught.value)
    await _stages_once_more(engine)


async def test_a_lost_connection_retires_the_pools_older_connections(engine: AsyncEngine, database_url: str) -> None:
    """After a server restart every pooled connection is dead: the first failure drops them all (as SQLAlchemy
    does on a disconnect), so the next transaction does not meet another dead one."""
    async with engine.connect() as a, engine.connect() as b:
        pids = [await _pid(a), await _pid(b)]
    await _terminate(database_url, *pids)
    with pytest.raises(OperationalError):
        async with engine.begin() as conn:
            await outbox.stage(conn, "t", _event())
    await _stages_once_more(engine)
