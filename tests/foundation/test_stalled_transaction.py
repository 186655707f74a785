"""A process that stalls inside a ledger transaction (SIGSTOP, swapped out, cut off) cannot hold its locks for
ever: PostgreSQL ends its session after the engine's idle-transaction timeout, its transaction rolls back, and
the others go on. Against a real PostgreSQL and NATS: a relay that took the outbox lock and the staged rows,
then stopped, must not keep every other relay from publishing."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import delete, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.bus import EventBus
from shared.events.catalogue import HealthEvent
from shared.ledger.db import make_engine
from shared.ledger.models import outbox
from shared.ledger.outbox import RELAY_LOCK_KEY, OutboxRelay, stage
from tests.waiting import stream_events

STALL_TIMEOUT_S = 1.0


async def test_a_relay_stalled_mid_flush_does_not_block_the_others(
    engine: AsyncEngine, database_url: str, bus: EventBus
) -> None:
    event = HealthEvent(node="node-a", gpu_uuid="GPU-a-0", healthy=False)
    async with engine.begin() as conn:
        await stage(conn, bus.names.prefix, event)

    stalled_engine = make_engine(database_url, pool_size=1, max_overflow=0, idle_transaction_timeout_s=STALL_TIMEOUT_S)
    try:
        stalled = await stalled_engine.connect()
        tx = await stalled.begin()
        # what a relay does before it publishes: take the lock, delete (take) the staged rows; then it stops
        await stalled.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": RELAY_LOCK_KEY})
        taken = (await stalled.execute(delete(outbox).returning(outbox.c.event_id))).scalars().all()
        assert taken == [event.event_id]

        relay = OutboxRelay(engine, bus)
        published = await asyncio.wait_for(relay.flush(), timeout=30)

        assert published == 1, "the stalled relay's rows came back when its transaction ended"
        assert [e.event_id for e in await stream_events(bus, "health")] == [event.event_id]
        async with engine.connect() as conn:
            assert (await conn.execute(select(outbox.c.seq))).all() == []
        with pytest.raises(DBAPIError):  # its session is gone: the late commit fails and is retried elsewhere
            await tx.commit()
        await stalled.close()
    finally:
        await stalled_engine.dispose()


async def test_the_timeout_does_not_end_a_transaction_that_keeps_working(database_url: str) -> None:
    busy_engine = make_engine(database_url, pool_size=1, max_overflow=0, idle_transaction_timeout_s=STALL_TIMEOUT_S)
    try:
        async with busy_engine.begin() as conn:
            for _ in range(3):  # longer than the timeout in all, but never idle that long
                await conn.execute(text("SELECT pg_sleep(:s)"), {"s": STALL_TIMEOUT_S * 0.6})
            assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1
    finally:
        await busy_engine.dispose()
